// The public port's settings and what fits in the process: the gRPC limits of the port
// (Configure: messages, identity compression only, keepalive, connection lifetimes,
// handshake time, metadata, the connection registry), the connection cap and accept queue
// that fit in the open-files limit (FitInFileLimit), and the heap the memory guard allows
// (MemoryLimitBytes).
#ifndef NLMSERVE_FRONTEND_PORT_H
#define NLMSERVE_FRONTEND_PORT_H

#include <cstddef>

#include <grpcpp/grpcpp.h>

#include "connections.h"
#include "options.h"

namespace nlmserve_frontend {

// The heap the front end may hold in use before it sheds its busiest connection
// (MemoryGuard): --max-memory-mb, else sixteen of the largest messages, at least 1 GiB.
std::size_t MemoryLimitBytes(const Options &o);

// The connection cap, and the accept queue (0: the kernel's, as gRPC sets it), that fit in
// the open-files limit; and the connections gRPC may hold at once: the cap and those it
// accepts beyond it before the cap closes them (two accept queues' worth).
struct FileBudget {
  long connections;
  int backlog;
  long open_at_most;
};

// The open-files soft limit raised to the hard one, and the budget that fits in it (a line
// says so when --max-connections does not fit).
FileBudget FitInFileLimit(long max_connections);

// The public port's limits, on `builder`.
void Configure(const Options &o, int max_bytes, Connections *connections, grpc::ServerBuilder *builder);

}  // namespace nlmserve_frontend

#endif  // NLMSERVE_FRONTEND_PORT_H
