"""Weight buffers in 2 MiB pages where Linux's transparent huge pages allow it (issue 42).

A decode step of a model larger than the CPU's caches streams every weight byte from DRAM once: a
7B-shaped Q4_K_M file is 3.6 GiB a token, ~950,000 pages of 4 KiB, each a TLB miss and a page walk.
In 2 MiB pages that is ~1,900. With THP in `madvise` mode (a common default, and this machine's)
memory gets them only where asked: an anonymous private mapping, 2 MiB-aligned, `madvise(
MADV_HUGEPAGE)` before it is first written. PyTorch's allocator does that only with
THP_MEM_ALLOC_ENABLE=1 set before it first allocates, and for every tensor; this is for the long-lived
packed weights alone.

Where the kernel says no (THP `never`, not Linux, no MAP_ANONYMOUS) the buffer is plain memory, as
torch.empty gives: the same bytes, only the page size differs. HEADWISE_HUGEPAGES=0 turns it off (to
measure what it gives).
"""

from __future__ import annotations

import mmap
import os

import torch
from torch import Tensor

__all__ = ["HUGE_PAGE", "huge_empty"]

HUGE_PAGE = 1 << 21  # x86-64's PMD-sized page; madvise rounds whatever the CPU's is
MIN_BYTES = HUGE_PAGE  # below one huge page there is nothing to gain, and a mapping each costs a VMA


def _wanted() -> bool:
    return os.environ.get("HEADWISE_HUGEPAGES", "1").strip() != "0" and hasattr(mmap, "MADV_HUGEPAGE")


def huge_empty(nbytes: int) -> Tensor:
    """An uninitialised uint8 CPU tensor of nbytes, in huge pages where the OS gives them (else
    torch.empty's). The mapping lives as long as the tensor (torch.frombuffer keeps it)."""
    if nbytes < MIN_BYTES or not _wanted():
        return torch.empty(nbytes, dtype=torch.uint8)
    try:
        # private and anonymous: a shared one (mmap's default) is shmem, which THP's `enabled` does not cover
        m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError, AttributeError):
        return torch.empty(nbytes, dtype=torch.uint8)
    t = torch.frombuffer(m, dtype=torch.uint8, count=nbytes + HUGE_PAGE)
    off = -t.data_ptr() % HUGE_PAGE  # Linux >= 6.7 aligns large anonymous maps itself; older ones may not
    try:
        m.madvise(mmap.MADV_HUGEPAGE, off, nbytes)
    except OSError:
        pass  # THP off: 4 KiB pages, the same bytes
    return t[off : off + nbytes]
