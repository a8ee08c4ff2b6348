// The front end's memory guard: glibc's allocator set for a long-running server at start
// (ReturnFreedMemory), and the overload guard (MemoryGuard): the busiest connection shed
// while the heap in use passes --max-memory-mb, and the free pages glibc keeps handed back.
#ifndef NLMSERVE_FRONTEND_MEMORY_H
#define NLMSERVE_FRONTEND_MEMORY_H

#include <dlfcn.h>
#include <malloc.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

#include "connections.h"
#include "log.h"
#include "refusals.h"

namespace nlmserve_frontend {

// The heap, all arenas together: bytes allocated and not freed, and bytes the allocator
// keeps beyond them (glibc: freed and kept for reuse, resident until handed back to the
// system; jemalloc: its resident pages not in use, its own records among them).
struct Heap {
  std::size_t in_use, kept;
};

// jemalloc's mallctl when the process runs on jemalloc (`nlmserve serve` preloads it where
// the system has it: common/memory.py), else nullptr: glibc's malloc.
using Mallctl = int (*)(const char *, void *, std::size_t *, void *, std::size_t);

inline Mallctl JemallocCtl() {
  static const Mallctl ctl = reinterpret_cast<Mallctl>(dlsym(RTLD_DEFAULT, "mallctl"));
  return ctl;
}

inline std::size_t JemallocStat(Mallctl ctl, const char *name) {
  std::size_t value = 0, size = sizeof(value);
  return ctl(name, &value, &size, nullptr, 0) == 0 ? value : 0;
}

inline Heap HeapNow() {
  if (const Mallctl ctl = JemallocCtl()) {
    std::uint64_t epoch = 1;
    ctl("epoch", nullptr, nullptr, &epoch, sizeof(epoch));  // refreshes the stats
    const std::size_t allocated = JemallocStat(ctl, "stats.allocated");
    const std::size_t resident = JemallocStat(ctl, "stats.resident");
    return Heap{allocated, resident > allocated ? resident - allocated : 0};
  }
  const struct mallinfo2 m = mallinfo2();
  return Heap{m.uordblks + m.hblkhd, m.fordblks};
}

// Which malloc the process runs on, for its start-up log line.
inline std::string AllocatorReport() {
  if (JemallocCtl() == nullptr) return "glibc's";
  const char *conf = getenv("MALLOC_CONF");
  return std::string("jemalloc (MALLOC_CONF=") + (conf != nullptr ? conf : "") + ")";
}

// What the allocator keeps, handed back to the system: glibc's malloc_trim (the free pages
// anywhere in every arena), jemalloc's purge of every arena (MALLCTL_ARENAS_ALL).
inline void GiveBackFreed() {
  if (const Mallctl ctl = JemallocCtl()) {
    ctl("arena.4096.purge", nullptr, nullptr, nullptr, 0);
    return;
  }
  malloc_trim(0);
}

// The process's resident memory (VmRSS), 0 where /proc cannot be read.
inline std::size_t ResidentBytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return static_cast<std::size_t>(std::stoull(line.substr(6))) * 1024;
  }
  return 0;
}

// One log line on the heap (SIGUSR1, and after a drain): in use grows with memory held;
// free is what malloc keeps for reuse; resident memory that grows while in use stays level
// is freed memory whose pages the system has not had back. The Python server's /metrics
// has the same two as nlmserve_heap_bytes.
inline std::string HeapReport() {
  const Heap heap = HeapNow();
  char line[160];
  std::snprintf(line, sizeof(line), "heap: %.3f MiB in use, %.3f MiB free, %.3f MiB resident",
                heap.in_use / 1048576.0, heap.kept / 1048576.0, ResidentBytes() / 1048576.0);
  return line;
}

// The allocator settings of a long-running server (set before any thread starts): blocks of
// kMmapThresholdBytes and more get a mapping of their own, unmapped when freed, and every
// arena gives back the free top of its heap beyond kTrimThresholdBytes. Fixing both turns
// off glibc's dynamic threshold, which the first free of a large block (a message, a
// stream's buffers) raises to that block's size for good: the blocks of every later burst
// would then come from the arenas and stay there.
//
// And no fast bins (M_MXFAST 0): glibc keeps freed blocks of up to 128 bytes apart,
// unmerged, until something consolidates them; malloc_trim does, and when they lay next to
// the free top of a thread's arena, the merged top is left as it is: malloc_trim gives back
// free blocks inside an arena and the top of the main arena only. After a flood the arena
// of one of gRPC's threads could so keep megabytes resident with nothing in it (3-14 MiB
// after 1,000 connections, in some starts of the front end and not others). Without fast
// bins every free merges at once, and a thread arena's top past the trim threshold is
// given back there and then. No cost the 2-core machine could tell: bench/serve.py's 32
// clients of one n-gram through the front end, with GLIBC_TUNABLES=glibc.malloc.mxfast=0
// and without, 5 rounds in turn: 0.97 as many n-grams a second, 1.01 of the CPU per
// request, each round within ±15% of the median.
constexpr int kMmapThresholdBytes = 64 * 1024;
constexpr int kTrimThresholdBytes = 128 * 1024;

inline void ReturnFreedMemory() {
  mallopt(M_MMAP_THRESHOLD, kMmapThresholdBytes);
  mallopt(M_TRIM_THRESHOLD, kTrimThresholdBytes);
  mallopt(M_MXFAST, 0);
}

// glibc's per-thread cache of freed blocks (tcache, up to 7 blocks of each of 64 sizes per
// thread) turned off: the blocks a thread cached during a flood stay allocated as glibc
// sees them, scattered over the heap the flood took, and each keeps its page resident
// after malloc_trim has given back the rest (bench/soak.py's front end settled 0.1-0.15 of
// its start lower without the cache; the micro-batching row of bench/serve.py moved within
// its run-to-run noise). glibc reads its tunables only as a process starts, so the front
// end runs itself again with GLIBC_TUNABLES set (its own path, so that it keeps its name),
// unless the variable already sets the cache: a user's setting wins.
constexpr char kTcacheTunable[] = "glibc.malloc.tcache_count";

inline void RunWithoutThreadCache(char **argv) {
  if (JemallocCtl() != nullptr) return;  // on jemalloc, which `nlmserve serve` sets up without its caches
  const char *tunables = getenv("GLIBC_TUNABLES");
  if (tunables != nullptr && std::strstr(tunables, kTcacheTunable) != nullptr) return;  // set: kept
  std::string value = std::string(kTcacheTunable) + "=0";
  if (tunables != nullptr && *tunables != '\0') value = std::string(tunables) + ":" + value;
  setenv("GLIBC_TUNABLES", value.c_str(), 1);
  char path[4096];
  const ssize_t n = readlink("/proc/self/exe", path, sizeof(path) - 1);  // its name, not "exe"
  if (n <= 0) return;
  path[n] = '\0';
  execv(path, argv);  // returns only when it failed: the process goes on with the cache
}

// The overload guard, every kCheckMs: closed connections are forgotten
// (Connections::ForgetClosed); when the heap in use passes the limit (--max-memory-mb), the
// busiest connection is shut down (Connections::ShedBusiest), until the heap is back under
// it. And what the allocator keeps is handed back to the system (malloc_trim), at most
// every kTrimSeconds, whenever it exceeds both kKeptFloorBytes and the heap in use.
// malloc_trim gives back the free pages anywhere in every arena, which glibc does not do by
// itself: after a flood the heap is a few MB in use scattered over the hundreds of MB the
// flood took, and the next calls' blocks, carved from those free chunks, touch their pages
// again: 12-19 MB of a settled front end's resident memory came back within the 10 s the
// trim used to wait (bench/soak.py), none within a second. A trim costs about a
// millisecond (one madvise per large free chunk). The floor was 4 MiB: once glibc had
// shrunk its heaps after a flood to less than that kept, no trim came and all of it could
// stay resident (600 connections, gRPC's poll engine: 4.4 MiB stayed in one of two runs;
// 0.3-0.7 MiB in three with the 1 MiB floor).
class MemoryGuard {
 public:
  static constexpr long kCheckMs = 100;
  static constexpr long kSampleMs = 50;
  static constexpr std::size_t kKeptFloorBytes = 1u << 20;
  static constexpr double kTrimSeconds = 1.0;

  MemoryGuard(std::size_t limit_bytes, Connections *connections, Refusals *refusals)
      : limit_(limit_bytes), connections_(connections), refusals_(refusals) {}

  // One check; true when a connection was shed.
  bool Check() {
    connections_->ForgetClosed();
    const Heap heap = HeapNow();
    if (heap.in_use > limit_) {
      const std::string peer = connections_->ShedBusiest(std::chrono::milliseconds(kSampleMs));
      if (!peer.empty()) {
        refusals_->Note(kReasonMaxMemory, "the busiest connection (its calls with it)", peer);
        return true;
      }
    }
    const auto now = Clock::now();
    if (heap.kept > std::max(kKeptFloorBytes, heap.in_use) &&
        std::chrono::duration<double>(now - trimmed_at_).count() >= kTrimSeconds) {
      GiveBackFreed();
      trimmed_at_ = now;
    }
    return false;
  }

 private:
  const std::size_t limit_;
  Connections *connections_;
  Refusals *refusals_;
  Clock::time_point trimmed_at_;
};

}  // namespace nlmserve_frontend

#endif  // NLMSERVE_FRONTEND_MEMORY_H
