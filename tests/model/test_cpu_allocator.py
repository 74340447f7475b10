"""The kernels' caching CPU allocator (model/kernels/cpu_allocator.cpp): installed when the kernels load, blocks
reused by size class, every block at least its request and 64-byte aligned, the cache bounded, torch's own
allocator back on request, and tensors freed across threads and across the switch."""

import os
import threading
import time

import pytest
import torch

from linserve.model import kernels
from tests.helpers import require_kernel

MAX_CACHED = 64 << 20  # cpu_allocator.cpp's kMaxCachedBytes


@pytest.fixture(autouse=True)
def caching_allocator():
    require_kernel()
    kernels.use_caching_allocator(True)
    yield
    kernels.use_caching_allocator(True)  # (the process's state as the kernels' loader left it)


def test_the_kernels_loader_installs_it_and_a_freed_block_serves_the_next_request_of_its_class():
    assert kernels.use_caching_allocator(True), "load() installs the caching allocator (LINSERVE_CPU_ALLOCATOR unset)"
    first = torch.empty(3000, dtype=torch.uint8)
    address, before = first.data_ptr(), kernels.cached_allocator_bytes()
    del first
    assert kernels.cached_allocator_bytes() == before + 3072  # (3000 bytes: the class of 3,072)
    again = torch.empty(2900, dtype=torch.uint8)  # (the same class)
    assert again.data_ptr() == address
    assert kernels.cached_allocator_bytes() == before


def test_a_block_over_a_megabyte_is_not_kept():
    before = kernels.cached_allocator_bytes()
    big = torch.empty((1 << 20) + 1, dtype=torch.uint8)
    del big
    assert kernels.cached_allocator_bytes() == before


@pytest.mark.parametrize("start", [1, 60, 63, 64, 65, 127, 4095, 4096, 4097, 65_530, (1 << 20) - 3])
def test_every_block_holds_its_request_aligned_and_apart_from_the_others(start):
    tensors = []
    for n in range(start, start + 40):
        t = torch.full((n,), n % 251, dtype=torch.uint8)  # (every byte of the request written)
        assert t.data_ptr() % 64 == 0
        tensors.append(t)
    for n, t in zip(range(start, start + 40), tensors):
        assert torch.equal(t, torch.full((n,), n % 251, dtype=torch.uint8)), n  # nothing overlapped
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel()) for t in tensors)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))


def test_the_cache_stays_bounded_whatever_is_freed():
    held = [torch.empty(1 << 20, dtype=torch.uint8) for _ in range(100)]  # 100 MB of the largest class
    del held
    assert 0 < kernels.cached_allocator_bytes() <= MAX_CACHED
    many = [torch.empty(4096, dtype=torch.uint8) for _ in range(200)]  # one class: at most 64 kept
    del many
    assert kernels.cached_allocator_bytes() <= MAX_CACHED


def test_torchs_own_allocator_comes_back_and_blocks_from_either_are_freed_by_their_own():
    cached = torch.empty(5000, dtype=torch.uint8)
    assert kernels.use_caching_allocator(False)
    own = torch.empty(5000, dtype=torch.uint8)
    del cached  # (a caching block freed while torch's allocator is in force: back to its class)
    bytes_now = kernels.cached_allocator_bytes()
    t = torch.empty(5000, dtype=torch.uint8)  # from torch's allocator: the cache untouched
    assert kernels.cached_allocator_bytes() == bytes_now
    assert not kernels.use_caching_allocator(True)
    del own, t  # (torch's blocks freed by torch's deleter while the cache is in force)
    assert kernels.cached_allocator_bytes() == bytes_now


def test_threads_allocating_and_freeing_at_once_keep_their_bytes():
    failures = []

    def churn(seed):
        generator = torch.Generator().manual_seed(seed)
        for _ in range(300):
            sizes = torch.randint(1, 20_000, (8,), generator=generator).tolist()
            blocks = [torch.full((n,), seed, dtype=torch.int16) for n in sizes]
            if not all(bool((b == seed).all()) for b in blocks):
                failures.append(seed)

    threads = [threading.Thread(target=churn, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures
    assert kernels.cached_allocator_bytes() <= MAX_CACHED


def test_a_process_forked_while_other_threads_allocate_can_allocate():
    """The forking thread holds every class's lock across a fork (pthread_atfork): a child never inherits a list
    locked by a thread that does not exist in it."""
    stop = threading.Event()

    def churn():  # (one class, so that a fork often finds its lock held)
        while not stop.is_set():
            torch.empty(3000, dtype=torch.uint8)

    threads = [threading.Thread(target=churn) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        for _ in range(300):
            pid = os.fork()
            if pid == 0:  # the child: the churned classes, then out without Python's teardown
                ok = torch.empty(3000, dtype=torch.uint8).numel() == 3000
                os._exit(0 if ok else 1)
            deadline = time.monotonic() + 30
            while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            if done[0] == 0:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                pytest.fail("a forked child hung allocating (a class's lock inherited locked)")
            assert os.waitstatus_to_exitcode(done[1]) == 0
    finally:
        stop.set()
        for thread in threads:
            thread.join()
