// MemoryLimitBytes, FitInFileLimit and Configure (port.h).
#include "port.h"

#include <sys/resource.h>

#include <algorithm>
#include <fstream>
#include <string>

#include <grpc/compression.h>

#include "log.h"

namespace nlmserve_frontend {

namespace {

// Clients ping every 30 s while they have calls: pings at most this often are answered, not
// refused with GOAWAY (the Python server's CLIENT_PING_FLOOR_MS, server/app.py).
const int kClientPingFloorMs = 10000;

// Descriptors the front end keeps for its own use beside client connections (standard
// streams, gRPC's pollers, the backend's connections, the local channel's sockets, files).
const long kOwnFiles = 64;

// The connections the kernel queues for a listening port at most (net.core.somaxconn;
// gRPC listens with it).
int KernelBacklog() {
  std::ifstream in("/proc/sys/net/core/somaxconn");
  int n = 0;
  return (in >> n) && n > 0 ? n : 4096;
}

}  // namespace

// The heap the front end may hold in use before it sheds its busiest connection
// (MemoryGuard): --max-memory-mb, else sixteen of the largest messages, at least 1 GiB.
std::size_t MemoryLimitBytes(const Options &o) {
  const long mb = o.max_memory_mb ? o.max_memory_mb : std::max(1024L, 16 * o.max_message_mb);
  return static_cast<std::size_t>(mb) * 1024 * 1024;
}

// The open-files soft limit raised to the hard one, and the budget that fits in it. gRPC
// 1.51 stops accepting on a port for good when accept() fails for want of a descriptor,
// and it accepts every queued connection before the cap sees any, so the limit must hold
// kOwnFiles, the cap, and the connections accepted beyond it that gRPC has not closed yet
// (two accept queues' worth). When it cannot with the kernel's queue and
// --max-connections, both are lowered (the queue to a quarter of the room, the cap to what
// is left) and a line says so.
FileBudget FitInFileLimit(long max_connections) {
  rlimit files{};
  const int kernel = KernelBacklog();
  const FileBudget wanted{max_connections, 0, max_connections + 2L * kernel};
  if (getrlimit(RLIMIT_NOFILE, &files) != 0) return wanted;
  if (files.rlim_cur < files.rlim_max) {
    files.rlim_cur = files.rlim_max;
    setrlimit(RLIMIT_NOFILE, &files);
    getrlimit(RLIMIT_NOFILE, &files);
  }
  if (files.rlim_cur == RLIM_INFINITY ||
      static_cast<long>(files.rlim_cur) >= wanted.open_at_most + kOwnFiles) {
    return wanted;
  }
  const long room = std::max(4L, static_cast<long>(files.rlim_cur) - kOwnFiles);
  const int backlog = static_cast<int>(std::min<long>(kernel, room / 4));
  const long cap = std::max(1L, std::min(max_connections, room - 2L * backlog));
  Log("the open-files limit (" + std::to_string(files.rlim_cur) + ") leaves room for " + std::to_string(cap) +
      " connections and " + std::to_string(backlog) + " queued ones: at most " + std::to_string(cap) +
      " are kept (--max-connections " + std::to_string(max_connections) +
      "; raise the hard limit, ulimit -Hn, for more)");
  return FileBudget{cap, backlog, cap + 2L * backlog};
}

// The public port's limits: messages, compression, keepalive, connection lifetimes,
// handshake time, metadata, and the connection registry (cap and shedding).
void Configure(const Options &o, int max_bytes, Connections *connections, grpc::ServerBuilder *builder) {
  builder->SetMaxReceiveMessageSize(max_bytes);
  builder->SetMaxSendMessageSize(max_bytes);
  // Identity only: a compressed request is refused before anything is inflated.
  builder->SetCompressionAlgorithmSupportStatus(GRPC_COMPRESS_DEFLATE, false);
  builder->SetCompressionAlgorithmSupportStatus(GRPC_COMPRESS_GZIP, false);
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, static_cast<int>(o.keepalive_ms));
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, static_cast<int>(o.keepalive_timeout_ms));
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, kClientPingFloorMs);
  if (o.max_connection_idle_ms) {
    builder->AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, static_cast<int>(o.max_connection_idle_ms));
  }
  if (o.max_connection_age_ms) {
    builder->AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS, static_cast<int>(o.max_connection_age_ms));
    builder->AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS,
                                static_cast<int>(o.max_connection_age_grace_ms));
  }
  builder->AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS, static_cast<int>(o.handshake_timeout_ms));
  builder->AddChannelArgument(GRPC_ARG_MAX_METADATA_SIZE, static_cast<int>(o.max_metadata_kb * 1024));
  if (o.max_concurrent_streams) {
    builder->AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, static_cast<int>(o.max_concurrent_streams));
  }
  builder->SetOption(connections->Option());
}

}  // namespace nlmserve_frontend
