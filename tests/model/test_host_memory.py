"""model/host_memory.py and the kernel's packed weights: memory a decode step streams, advised as huge pages."""

import os

import pytest
import torch

from linserve.model import host_memory, kernels
from tests.helpers import require_kernel


def advised_huge(tensor: torch.Tensor) -> bool:
    """Whether the mapping holding `tensor`'s data carries madvise(MADV_HUGEPAGE) (`hg` in /proc/self/smaps)."""
    address, mapping = tensor.data_ptr(), None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                start, end = (int(part, 16) for part in head.split("-"))
                mapping = start <= address < end
            elif head == "VmFlags:" and mapping:
                return "hg" in line.split()[1:]
    return False


linux = pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux's /proc/self/smaps")


@linux
def test_a_large_buffer_is_zeros_on_memory_advised_as_huge_pages():
    shape = (3, 5, 64, 1000)  # 3.84 MB of fp32
    tensor = host_memory.zeros(shape, torch.float32, torch.device("cpu"))
    assert tensor.shape == shape and tensor.dtype == torch.float32 and tensor.is_contiguous()
    assert tensor.data_ptr() % host_memory.HUGE_PAGE == 0 and advised_huge(tensor)
    assert not tensor.any()
    tensor[1] = 2.5  # writable, and each element its own
    assert tensor.sum().item() == 2.5 * 5 * 64 * 1000
    assert not advised_huge(torch.zeros(shape))  # (the check itself tells the difference)


def test_a_small_buffer_is_a_plain_allocation():
    tensor = host_memory.zeros((4, 8), torch.bfloat16, torch.device("cpu"))
    assert tensor.shape == (4, 8) and tensor.dtype == torch.bfloat16 and not tensor.any()


@linux
def test_a_large_packed_weight_is_advised_as_huge_pages():
    require_kernel()
    if kernels.form() == "scalar":
        pytest.skip("the scalar form reads weights as they are: nothing is packed")
    weight = torch.randn(2816, 1024).bfloat16()
    packed = torch.ops.linserve.pack_weight(weight)
    assert packed.data_ptr() % 4096 == 0 and advised_huge(packed)
    x = torch.randn(3, 1024).bfloat16()
    assert torch.equal(torch.ops.linserve.invariant_linear(x, packed, None, None, 2816),
                       torch.ops.linserve.invariant_linear(x, weight, None, None, 2816))


def mapped(address: int) -> bool:
    """Whether `address` lies in one of this process's mappings (/proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            start, end = (int(part, 16) for part in line.split()[0].split("-"))
            if start <= address < end:
                return True
    return False


@linux
def test_packed_weights_lie_back_to_back_and_their_memory_goes_with_the_last_of_them():
    """Weights share huge pages (a mapping a weight would leave up to 2 MB of its last huge page resident and empty):
    the next weight starts at the next 4 KB after the last, or at the start of a new 2 MB-aligned chunk when it does
    not fit. A chunk is unmapped once no tensor lies on it."""
    require_kernel()
    if kernels.form() == "scalar":
        pytest.skip("the scalar form reads weights as they are: nothing is packed")
    first, second = (torch.ops.linserve.pack_weight(torch.ones(1040, 1056).bfloat16()) for _ in range(2))
    size = first.numel() * first.element_size()  # 2.2 MB: past one huge page, not a multiple of 4 KB
    assert size % 4096 and advised_huge(first) and advised_huge(second)
    assert (second.data_ptr() == first.data_ptr() + -(-size // 4096) * 4096
            or second.data_ptr() % host_memory.HUGE_PAGE == 0)
    assert torch.equal(first, second) and first.data_ptr() != second.data_ptr()
    alone = torch.ops.linserve.pack_weight(torch.empty(8448, 8192).bfloat16())  # 138 MB: a chunk of its own
    address = alone.data_ptr()
    assert address % host_memory.HUGE_PAGE == 0 and mapped(address)
    del alone
    assert not mapped(address)
