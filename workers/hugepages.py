"""Large CPU buffers on transparent huge pages (2 MiB) where the kernel allows it.

Why: the paged KV pool is read in small pieces scattered over gigabytes (a block per head is a few
KiB), and with 4 KiB pages nearly every piece costs a TLB miss and restarts the hardware prefetcher,
which stops at page boundaries. With 2 MiB pages a request's scattered blocks cost about what its
contiguous ones do (benchmarks/engine/gather_ab.py measures both). Most Linux hosts ship THP in
``madvise`` mode, where only memory that asks gets huge pages; this asks. Elsewhere (another OS, THP
off, a GPU tensor) the buffer is an ordinary one: same values, same results.

The weights a decode step streams (:func:`arena`) gain the same way: one step reads all of them in
order, and on 4 KiB pages the stream pays a TLB miss and a prefetcher restart every 4 KiB.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import mmap
import os
import sys

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20  # bytes; x86-64's and aarch64's (4 KiB granule) transparent huge page
_MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux
ENV_DISABLE = "SPECSERVE_HUGEPAGES"  # "0": ordinary pages (for paired measurements)


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


def enabled() -> bool:
    return os.environ.get(ENV_DISABLE, "1") != "0" and _madvise() is not None


def _huge_buffer(nbytes: int) -> torch.Tensor | None:
    """``nbytes`` uint8 starting on a huge-page boundary and advised, untouched; ``None`` where huge pages
    are off or unavailable."""
    madvise = _madvise()
    if nbytes < HUGE_PAGE or madvise is None or not enabled():
        return None
    # A fresh anonymous mapping: memory the allocator hands back after a free may already be faulted in as
    # small pages, which the advice no longer changes. The tensor keeps the mapping alive.
    anon = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared would be shmem
    raw = torch.frombuffer(anon, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE
    buf = raw[offset : offset + nbytes]
    if madvise(buf.data_ptr(), nbytes // HUGE_PAGE * HUGE_PAGE, _MADV_HUGEPAGE) != 0:
        log.debug("madvise(MADV_HUGEPAGE) failed (errno %d); ordinary pages", ctypes.get_errno())
    return buf


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype, device=device)``, on huge pages if the CPU tensor is at least one.

    The buffer is over-allocated by one huge page so the tensor can start on a huge-page boundary, and
    advised before it is first touched (zeroed), so the kernel faults it in as huge pages directly."""
    numel = 1
    for s in shape:
        numel *= s
    esize = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * esize
    buf = _huge_buffer(nbytes) if device.type == "cpu" else None
    if buf is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    return buf.zero_().view(dtype).view(shape)


ALIGN = 64  # bytes: each tensor of an arena starts on a cache line


def arena(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies of CPU ``tensors`` laid out in one huge-page buffer, in the order given (the order a
    step reads them, so one call's stream runs on into the next one's), each on a cache line. Where huge
    pages are unavailable or the tensors are on another device, the tensors themselves, unchanged."""
    if not tensors or any(t.device.type != "cpu" for t in tensors):
        return tensors
    offsets, end = [], 0
    for t in tensors:
        offsets.append(end)
        end += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    buf = _huge_buffer(end)
    if buf is None:
        return tensors
    out = []
    for t, o in zip(tensors, offsets):
        dst = buf[o : o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        out.append(dst.copy_(t))
    return out
