"""Host memory backed by transparent huge pages where Linux offers them.

A decode step reads every projection weight once: hundreds of MB a step for fla's 340M shapes. On 4 KB pages each
4 KB of that stream is a TLB miss and a restart of the hardware prefetchers; asked for huge pages
(madvise(MADV_HUGEPAGE) before the first touch: honoured where /sys/kernel/mm/transparent_hugepage/enabled is
`madvise` or `always`) the same read runs faster — one row over 340M's gate and up projections went from 21 to 28
GB/s on one Zen 4 thread. The packed weights get theirs in the kernel (`pack_weight`); the benchmarks read their
DRAM floor from a buffer made here. Elsewhere (no mmap's madvise, another OS, a CUDA device, less than a megabyte)
a plain torch allocation.
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros(shape), on a CPU in memory asked to be huge pages (touched here: every page faulted in now)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if (device.type != "cpu" or nbytes < HUGE_PAGE // 2 or not hasattr(mmap, "MADV_HUGEPAGE")
            or not hasattr(mmap, "MAP_ANONYMOUS")):
        return torch.zeros(shape, dtype=dtype, device=device)
    rounded = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    region = mmap.mmap(-1, rounded + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # (slack: never touched)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # (holds the mapping: unmapped with the last tensor on it)
    start = -raw.data_ptr() % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start, rounded)
    except OSError:  # (a kernel without THP: plain pages, the same tensor)
        pass
    tensor = raw[start:start + nbytes].view(dtype).view(shape)
    return tensor.zero_()
