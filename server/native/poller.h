// The connection records of gRPC's epoll1 poller, made at start (PresizePollerRecords).
//
// gRPC 1.51's default poller (epoll1, iomgr/ev_epoll1_linux.cc) makes a record (grpc_fd,
// about 100 bytes) for each connection it accepts and, when the connection closes, keeps it
// on a free list for the next one: it never gives one back. Made during a flood of
// connections, each record lands among that connection's buffers, so once the flood has
// gone every record keeps its 4 KiB page of the freed heap resident, which malloc_trim
// cannot give back: 4.6 MiB after 1,000 connections, 12.5 after 3,000
// (python -m bench.connection_floods), 1.19-1.22 of the front end's start after
// bench/soak.py's attacks. Made here at start, one after the other, the records of every
// connection the front end may hold at once lie together (about 1.3 MiB for the default
// 4,096 connections and two accept queues), and a flood takes them from the free list
// instead of scattering new ones.
//
// The records are made with gRPC's own calls (grpc_fd_create, then grpc_fd_orphan, which
// puts each on the free list): internal to gRPC's core library but exported by it, looked
// up by name at run time so that a gRPC without them still runs the front end (a line says
// the records were not made). The descriptors they wrap are duplicates of a pipe's reading
// end, which has nothing to read: the poller never wakes for them.
#ifndef NLMSERVE_FRONTEND_POLLER_H
#define NLMSERVE_FRONTEND_POLLER_H

#include <dlfcn.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

struct grpc_fd;
struct grpc_closure;

namespace nlmserve_frontend {

// What PresizePollerRecords did.
struct PollerRecords {
  std::string poller;  // gRPC's polling engine, "" where this gRPC does not export its calls
  long made;           // records put on the free list (0 for a poller that frees its own)
};

// Records for `connections` put on epoll1's free list; call after gRPC is initialised
// (the backend's channel made) and before the server listens.
inline PollerRecords PresizePollerRecords(long connections) {
  using Strategy = const char *(*)();
  using Create = grpc_fd *(*)(int, const char *, bool);
  using Orphan = void (*)(grpc_fd *, grpc_closure *, int *, const char *);
  const auto strategy = reinterpret_cast<Strategy>(dlsym(RTLD_DEFAULT, "_Z27grpc_get_poll_strategy_namev"));
  const auto create = reinterpret_cast<Create>(dlsym(RTLD_DEFAULT, "_Z14grpc_fd_createiPKcb"));
  const auto orphan =
      reinterpret_cast<Orphan>(dlsym(RTLD_DEFAULT, "_Z14grpc_fd_orphanP7grpc_fdP12grpc_closurePiPKc"));
  if (strategy == nullptr || create == nullptr || orphan == nullptr) return PollerRecords{"", 0};
  const char *name = strategy();
  PollerRecords done{name != nullptr ? name : "", 0};
  int ends[2];
  if (done.poller != "epoll1" || pipe2(ends, O_CLOEXEC) != 0) return done;
  std::vector<grpc_fd *> records;
  records.reserve(static_cast<std::size_t>(connections));
  for (long i = 0; i < connections; ++i) {
    const int fd = fcntl(ends[0], F_DUPFD_CLOEXEC, 0);
    if (fd < 0) break;  // out of descriptors: the records made so far
    records.push_back(create(fd, "nlmserve presized", false));
  }
  for (grpc_fd *record : records) {
    int released = -1;  // taken back (out of the poller's epoll set), then closed here
    orphan(record, nullptr, &released, "presized");
    if (released >= 0) close(released);
  }
  close(ends[0]);
  close(ends[1]);
  done.made = static_cast<long>(records.size());
  return done;
}

}  // namespace nlmserve_frontend

#endif  // NLMSERVE_FRONTEND_POLLER_H
