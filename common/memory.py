"""``nlmserve.common.memory``: process-wide allocator settings: the training loops keep freed
memory (:func:`keep_freed_memory`), a server gives it back (:func:`trim_heap`).

A training step allocates and frees the same large tensors every time (at width 512 the
(N, 1 + k, E) noise products are 11.5 MB each). With glibc's defaults some of them come
from fresh ``mmap`` pages or from heap memory that was trimmed back to the system, and the
step pays a page fault per 4 KiB it touches. :func:`keep_freed_memory` raises the mmap
threshold to its 32 MiB maximum and turns trimming off (as ``MALLOC_MMAP_THRESHOLD_`` /
``MALLOC_TRIM_THRESHOLD_`` would), and sets torch's own ``THP_MEM_ALLOC_ENABLE``, with which
tensors of 2 MiB and more are aligned to 2 MiB and advised as transparent huge pages (one
fault per 2 MiB where the kernel grants them). Neither removes every fault (torch allocates
with ``posix_memalign``, whose requests freed blocks do not always fit); measured on the
step itself, one NCE step at width 512 with n-gram features and one thread takes
34.9–40.3 ms without and 32.6–33.6 ms with both (experiments/results.md, "Training"). The cost is that the process keeps its
peak heap until it exits; ``nlmserve train`` calls it, the library does not. Call it
before the first large tensor is allocated.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from typing import Any

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's largest (64-bit)
_TRIM_OFF = (1 << 31) - 1
_TOP_PAD = 64 << 20


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to serve large blocks from the heap and keep freed memory, and
    torch to advise huge pages for large tensors; False where there is no glibc ``mallopt``
    (then only the huge-page advice is set)."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # read by torch at its first large allocation
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = all(mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX), (_M_TRIM_THRESHOLD, _TRIM_OFF), (_M_TOP_PAD, _TOP_PAD)))
    log.debug("malloc keeps freed memory: %s", ok)
    return ok


_malloc_trim: Any = None


def trim_heap() -> bool:
    """Ask glibc to give the free parts of its heap back to the system (``malloc_trim(0)``);
    False where there is no glibc. A server calls it after what leaves freed memory behind
    (a flood of calls with large metadata or messages, a refused reload): glibc would
    otherwise keep it resident."""
    global _malloc_trim
    if _malloc_trim is None:
        name = ctypes.util.find_library("c")
        try:
            _malloc_trim = ctypes.CDLL(name).malloc_trim if name is not None else False
        except (OSError, AttributeError):
            _malloc_trim = False
        if _malloc_trim:
            _malloc_trim.argtypes = [ctypes.c_size_t]
    if not _malloc_trim:
        return False
    _malloc_trim(0)
    return True
