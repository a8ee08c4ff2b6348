"""``nlmserve.common.memory``: process-wide allocator settings: the training loops keep freed
memory (:func:`keep_freed_memory`), a server gives it back (:func:`return_freed_memory`,
:func:`trim_heap`) and runs on jemalloc where the system has it (:func:`jemalloc_environment`).

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

A server wants the opposite: after a burst (large requests, many clients at once) its
resident memory should come back down. glibc's defaults keep it up. Its mmap threshold is
dynamic: the first free of a block that had a mapping of its own raises the threshold to
that block's size (up to 32 MiB) and the trim threshold to twice it, so from then on the
blocks of a message (its bytes, a streamed answer's chunks, gRPC's buffers) are carved
from malloc's per-thread arenas. Freed there, they stay resident: ``malloc_trim`` gives
back the free pages inside an arena but never the top of a thread's arena, which its
thread trims itself only above the raised trim threshold. :func:`return_freed_memory`
fixes both thresholds (as ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` would),
which turns the adjustment off: blocks of :data:`SERVER_MMAP_THRESHOLD` and more get a
mapping of their own, unmapped when freed, and every arena trims its top beyond
:data:`SERVER_TRIM_THRESHOLD`; what a burst leaves inside an arena, the server's periodic
:func:`trim_heap` gives back. Measured on ``nlmserve serve`` with the test model, three
bursts of 8 requests of 100,000 n-grams after a first one left 50-70 MB more resident
than before them with the defaults, 1-2 MB with these settings
(tests/test_memory.py). Fewer arenas (``M_ARENA_MAX``) made it worse, not better: in
``bench/soak.py`` with every attack, 1 or 2 arenas left 20-30% more resident after the
settle instead of 12%, since the long-lived blocks of every thread then sit between the
freed ones of a burst.

The mmap threshold is glibc's largest, not a message's size: a forward pass allocates and
frees temporaries of a few MB each (a batch of 4,096 rows of width 256 is 4 MB), and with
a threshold below them each gets fresh pages every batch. At 64 KiB the engine took 24,280
minor page faults (``/proc/self/stat``) per request of 10,000 n-grams and 141.7 ms instead
of 89.9 (bench/serve.py's model, one thread), and gRPC with packed ids reached 62% of the
in-process engine, whose process kept glibc's defaults; at 32 MiB, 250 faults and the
engine's speed, and bench/serve.py's gRPC row 97% of an engine under these settings
(docs/performance-serving.md).

Where glibc still loses is small blocks: after a flood of connections each of gRPC's
long-lived records (the polling engine keeps one per connection for reuse) shares a page
with the flood's freed blocks, and ``malloc_trim`` cannot give that page back: the native
front end kept about 4 KiB per connection of its largest flood, the Python server about 8.
jemalloc keeps blocks of one size class together on pages of their own, and with its
per-thread caches off and a background thread purging what was freed within a second
(:data:`SERVER_MALLOC_CONF`) the same floods left a fifth as much (python -m
bench.connection_floods; experiments/results.md, "Memory after hostile clients"), and the
Python server came back to 1.10 of its start after 10 minutes of every attack of
bench/soak.py, from 1.18. ``nlmserve serve``
therefore runs itself again with jemalloc preloaded where the system has it
(:func:`jemalloc_environment`, ``--allocator``); its native front end does not
(:func:`without_jemalloc`). :func:`heap_now` and :func:`trim_heap` speak to whichever
allocator the process runs on.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's largest (64-bit)
_TRIM_OFF = (1 << 31) - 1
_TOP_PAD = 64 << 20

#: A server's blocks of this many bytes and more get a mapping of their own: glibc's largest
#: (64-bit), so that a forward pass's temporaries are reused from the arenas (module docstring).
SERVER_MMAP_THRESHOLD = _MMAP_THRESHOLD_MAX
#: A server's arenas give back the free top of their heap beyond this many bytes (glibc's
#: default before it adjusts it).
SERVER_TRIM_THRESHOLD = 128 * 1024
#: At most this many blocks with mappings of their own at once, half of Linux's default
#: limit of mappings per process (``vm.max_map_count``, 65,530): beyond it blocks come from
#: the arenas, so that a flood of large blocks cannot take the mappings that threads and
#: Python's own allocator need.
SERVER_MMAPS_MAX = 32 * 1024


#: The shared library that brings jemalloc into a process (``LD_PRELOAD``; Debian's libjemalloc2).
JEMALLOC_LIBRARY = "libjemalloc.so.2"
#: jemalloc's settings for a server (``MALLOC_CONF``; a user's own ``MALLOC_CONF`` wins): no
#: per-thread caches (the blocks they hold after a flood keep whole pages), and freed pages
#: given back to the system by a background thread within a second.
SERVER_MALLOC_CONF = "background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0,tcache:false"
#: jemalloc's ``MALLCTL_ARENAS_ALL``: ``arena.<this>.purge`` purges every arena.
_ARENAS_ALL = 4096

_libc_handle: Any = None
_mallctl_handle: Any = None


def _libc() -> Any:
    """The C library (``ctypes.CDLL``), None where it cannot be found or opened."""
    global _libc_handle
    if _libc_handle is None:
        name = ctypes.util.find_library("c")
        try:
            _libc_handle = ctypes.CDLL(name) if name is not None else False
        except OSError:
            _libc_handle = False
    return _libc_handle or None


def _mallctl() -> Any:
    """jemalloc's ``mallctl`` when this process runs on jemalloc (preloaded), else None."""
    global _mallctl_handle
    if _mallctl_handle is None:
        mallctl = getattr(ctypes.CDLL(None), "mallctl", None)
        if mallctl is not None:
            mallctl.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p,
                                ctypes.c_size_t]
            mallctl.restype = ctypes.c_int
        _mallctl_handle = mallctl or False
    return _mallctl_handle or None


def on_jemalloc() -> bool:
    """True when this process's malloc is jemalloc's."""
    return _mallctl() is not None


def _jemalloc_stat(name: str) -> int:
    value, size = ctypes.c_size_t(0), ctypes.c_size_t(ctypes.sizeof(ctypes.c_size_t))
    if _mallctl()(name.encode(), ctypes.byref(value), ctypes.byref(size), None, 0) != 0:
        raise OSError(f"mallctl {name} failed")
    return int(value.value)


def _preloads_but_jemalloc(env: dict[str, str]) -> list[str]:
    """The entries of ``env``'s ``LD_PRELOAD`` (space- or colon-separated) that are not jemalloc."""
    return [e for e in env.get("LD_PRELOAD", "").replace(":", " ").split()
            if not os.path.basename(e).startswith("libjemalloc")]


def jemalloc_environment(env: dict[str, str]) -> dict[str, str] | None:
    """``env`` with jemalloc preloaded (:data:`JEMALLOC_LIBRARY` ahead of any ``LD_PRELOAD``),
    :data:`SERVER_MALLOC_CONF` unless ``MALLOC_CONF`` is set, and Python's objects in it too
    (``PYTHONMALLOC=malloc`` unless set: CPython's own allocator keeps each 1 MiB arena it took
    until the arena is empty, about 20 MB more after the soak's attacks); None where the
    system has no jemalloc, or where ``env`` already preloads it (a process started so and not
    on jemalloc could not load it: starting it again would loop)."""
    preload = env.get("LD_PRELOAD", "")
    if len(_preloads_but_jemalloc(env)) < len(preload.replace(":", " ").split()):
        return None
    if ctypes.util.find_library("jemalloc") is None:
        return None
    out = dict(env)
    out["LD_PRELOAD"] = f"{JEMALLOC_LIBRARY} {preload}".strip()
    out.setdefault("MALLOC_CONF", SERVER_MALLOC_CONF)
    out.setdefault("PYTHONMALLOC", "malloc")
    return out


def without_jemalloc(env: dict[str, str]) -> dict[str, str]:
    """``env`` with no jemalloc among its ``LD_PRELOAD`` entries: for the native front end,
    which keeps glibc's malloc (its own settings, server/native/memory.h). On jemalloc the
    front end gave back more after floods of connections but kept more after the soak's
    large messages (1.09-1.39 of its start, against 1.19-1.21 on glibc's)."""
    entries = _preloads_but_jemalloc(env)
    out = dict(env)
    if entries:
        out["LD_PRELOAD"] = " ".join(entries)
    else:
        out.pop("LD_PRELOAD", None)
    return out


def _mallopt(settings: tuple[tuple[int, int], ...]) -> bool:
    """Apply glibc ``mallopt`` settings; False where there is no glibc or one is refused."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in settings)


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to serve large blocks from the heap and keep freed memory, and
    torch to advise huge pages for large tensors; False where there is no glibc ``mallopt``
    (then only the huge-page advice is set)."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # read by torch at its first large allocation
    ok = _mallopt(((_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX), (_M_TRIM_THRESHOLD, _TRIM_OFF), (_M_TOP_PAD, _TOP_PAD)))
    log.debug("malloc keeps freed memory: %s", ok)
    return ok


def return_freed_memory() -> bool:
    """Tell glibc's malloc to give freed memory back, as a long-running server needs (module
    docstring): fixed mmap and trim thresholds, so that a burst of large blocks does not
    move them into the arenas for good; False where there is no glibc ``mallopt``."""
    ok = _mallopt(((_M_MMAP_THRESHOLD, SERVER_MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, SERVER_TRIM_THRESHOLD),
                   (_M_MMAP_MAX, SERVER_MMAPS_MAX)))
    log.debug("malloc returns freed memory: %s", ok)
    return ok


def trim_heap() -> bool:
    """Ask the allocator to give the free parts of its heap back to the system (glibc's
    ``malloc_trim(0)``, jemalloc's purge of every arena); False where there is neither. A
    server calls it after what leaves freed memory behind (a flood of calls with large
    metadata or messages, a refused reload): glibc would otherwise keep it resident."""
    if on_jemalloc():
        return _mallctl()(f"arena.{_ARENAS_ALL}.purge".encode(), None, None, None, 0) == 0
    malloc_trim = getattr(_libc(), "malloc_trim", None)
    if malloc_trim is None:
        return False
    malloc_trim.argtypes = [ctypes.c_size_t]
    malloc_trim(0)
    return True


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_now() -> tuple[int, int] | None:
    """The heap, every arena and mapping together: bytes handed out and not freed, and bytes
    the allocator keeps beyond them (glibc's ``mallinfo2``: freed and kept for reuse,
    resident until given back; jemalloc's ``stats.resident - stats.allocated``: its resident
    pages not in use, its own records among them); None where there is neither jemalloc nor
    glibc 2.33 or later. In use that grows from one quiet moment to the next is memory held;
    resident memory that grows while it stays level is freed memory whose pages the system
    has not had back (pages a live block keeps)."""
    if on_jemalloc():
        epoch = ctypes.c_uint64(1)
        _mallctl()(b"epoch", None, None, ctypes.byref(epoch), ctypes.sizeof(epoch))  # refreshes the stats
        allocated = _jemalloc_stat("stats.allocated")
        return allocated, max(0, _jemalloc_stat("stats.resident") - allocated)
    mallinfo2 = getattr(_libc(), "mallinfo2", None)
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return int(info.uordblks + info.hblkhd), int(info.fordblks)


def resident_bytes(pid: int | None = None) -> int | None:
    """A live process's resident memory (VmRSS; this process's without ``pid``), None when it
    is gone or there is no /proc."""
    try:
        for line in Path(f"/proc/{pid or 'self'}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def allocator_report() -> str:
    """Which malloc this process runs on, for a server's start-up log line."""
    if on_jemalloc():
        return (f"jemalloc (MALLOC_CONF={os.environ.get('MALLOC_CONF', '')}, "
                f"PYTHONMALLOC={os.environ.get('PYTHONMALLOC', 'pymalloc')})")
    return "glibc's" if _libc() is not None and hasattr(_libc(), "mallinfo2") else "the C library's"


def heap_report() -> str:
    """The heap in one log line (a server's on SIGUSR1), as the native front end writes it
    (server/native/memory.h, HeapReport): ``heap: X MiB in use, Y MiB free, Z MiB resident``
    (:func:`heap_now`; "unknown" where there is no mallinfo2)."""
    heap, resident = heap_now(), (resident_bytes() or 0) / 2**20
    if heap is None:
        return f"heap: unknown, {resident:.3f} MiB resident"
    return f"heap: {heap[0] / 2**20:.3f} MiB in use, {heap[1] / 2**20:.3f} MiB free, {resident:.3f} MiB resident"
