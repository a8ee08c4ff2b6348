// The front end's connection guards: the public port's client connections, registered
// from gRPC's socket mutator before their handshake: the cap (--max-connections), the
// accept queue, shedding the busiest connection when the heap passes its limit
// (MemoryGuard, memory.h), and the premature-reset guard (HTTP/2 rapid reset).
#ifndef NLMSERVE_FRONTEND_CONNECTIONS_H
#define NLMSERVE_FRONTEND_CONNECTIONS_H

#include <arpa/inet.h>
#include <fcntl.h>
#include <linux/tcp.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include <grpc/support/sync.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/server_builder_option.h>
#include <grpcpp/support/channel_arguments.h>

#include "log.h"
#include "refusals.h"

// gRPC core's socket mutator (src/core/lib/iomgr/socket_mutator.h, not installed with the
// library): the server calls it with each socket it accepts, which is the only place gRPC
// 1.51 lets an application see its connections. These definitions are that header's; the
// structure has kept this layout since gRPC 1.30, and the functions named here are the
// library's exported symbols (a different signature does not link).
typedef enum {
  GRPC_FD_CLIENT_CONNECTION_USAGE,
  GRPC_FD_SERVER_LISTENER_USAGE,
  GRPC_FD_SERVER_CONNECTION_USAGE,
} grpc_fd_usage;
typedef struct {
  int fd;
  grpc_fd_usage usage;
} grpc_mutate_socket_info;
struct grpc_socket_mutator_vtable {
  bool (*mutate_fd)(int fd, grpc_socket_mutator *mutator);
  int (*compare)(grpc_socket_mutator *a, grpc_socket_mutator *b);
  void (*destroy)(grpc_socket_mutator *mutator);
  bool (*mutate_fd_2)(const grpc_mutate_socket_info *info, grpc_socket_mutator *mutator);
};
struct grpc_socket_mutator {
  const grpc_socket_mutator_vtable *vtable;
  gpr_refcount refcount;
};
void grpc_socket_mutator_init(grpc_socket_mutator *mutator, const grpc_socket_mutator_vtable *vtable);

namespace nlmserve_frontend {

// The client connections of the public port. gRPC hands every socket it accepts to this
// registry (a socket mutator, above) before its handshake, which gives the front end three
// guards gRPC 1.51 does not have:
//
// - a cap (--max-connections): a socket beyond it is shut down there (the client sees the
//   connection closed: UNAVAILABLE), and gRPC then closes it;
// - shedding (ShedBusiest): when the heap passes --max-memory-mb, the connection that sent
//   the most bytes over a short interval is shut down, with its calls. gRPC 1.51 applies
//   its metadata limit only once a client has acknowledged the server's settings, so a
//   client that never does can grow one unfinished header block without bound; its
//   resource quota, which should bound it, aborts the process in gRPC's TCP reader under
//   memory pressure (seen here), so none is set;
// - premature resets (CallEnded): a connection whose client resets half of its calls
//   within kPrematureSeconds of their start (and before their deadline) is shut down once
//   it has reset kResetCalls / 2, Envoy's rule for HTTP/2 rapid reset with its defaults
//   (premature_reset_total_stream_count 500, premature_reset_min_stream_lifetime_seconds
//   1). gRPC 1.51 forgets a stream as soon as its client resets it, so its stream limit does
//   not bound them: each reset call still costs a call and its reactions, and 10,000
//   HEADERS + RST_STREAM pairs every 5 s held about 200 MiB and delayed every other
//   client's answers by seconds.
//
// A connection is remembered by its descriptor, inode and peer; one whose descriptor no
// longer names that inode was closed. Counting the open ones again takes one fstat each, so
// it is done when the remembered ones reach the cap (at most every kRecountMs), and by
// ForgetClosed at most every kForgetMs.
class Connections {
 public:
  static constexpr long kRecountMs = 20;
  static constexpr long kForgetMs = 1000;
  static constexpr uint64_t kResetCalls = 500;
  static constexpr double kPrematureSeconds = 1.0;

  Connections(long limit, Refusals *refusals) : limit_(limit), refusals_(refusals) {
    static const grpc_socket_mutator_vtable kVtable = {nullptr, Compare, Destroy, Mutate};
    grpc_socket_mutator_init(&mutator_.base, &kVtable);
    mutator_.connections = this;
  }
  Connections(const Connections &) = delete;
  Connections &operator=(const Connections &) = delete;

  // The server builder option that installs the registry (the builder owns the option;
  // the registry must outlive the server).
  std::unique_ptr<grpc::ServerBuilderOption> Option() {
    class Install : public grpc::ServerBuilderOption {
     public:
      explicit Install(grpc_socket_mutator *m) : m_(m) {}
      void UpdateArguments(grpc::ChannelArguments *args) override { args->SetSocketMutator(m_); }
      void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin> > *) override {}

     private:
      grpc_socket_mutator *m_;
    };
    return std::unique_ptr<grpc::ServerBuilderOption>(new Install(&mutator_.base));
  }

  // Sets the queue of connections the kernel accepts for the port before gRPC takes them
  // (listen() again on the port's sockets, once the server listens): gRPC takes all that
  // are queued at once, so queue and cap together must fit in the open-files limit. While
  // the cap refuses connections the queue is narrowed to one, and widened again once one
  // is kept: each refused socket holds its descriptor until gRPC's event loop closes it,
  // which on a starved CPU came after more than two full queues of a flood had been taken
  // (accept() then failed for want of a descriptor, and gRPC 1.51 stopped accepting on the
  // port for good: 3 in 16 floods of tests/test_native_hostile.py beside three busy loops).
  void LimitBacklog(int backlog) {
    std::lock_guard<std::mutex> lock(mu_);
    backlog_ = backlog;
    for (int fd : listeners_) listen(fd, backlog);
  }

  // Shuts down the open connection that received the most bytes over `interval` (none
  // when no connection received any); returns its peer, or an empty string.
  std::string ShedBusiest(std::chrono::milliseconds interval) {
    std::unordered_map<int, uint64_t> before = Received();
    std::this_thread::sleep_for(interval);
    std::unordered_map<int, uint64_t> after = Received();
    int busiest = -1;
    uint64_t most = 0;
    for (const auto &c : after) {
      auto it = before.find(c.first);
      const uint64_t delta = c.second - (it == before.end() ? 0 : std::min(it->second, c.second));
      if (delta > most) {
        most = delta;
        busiest = c.first;
      }
    }
    if (busiest < 0) return std::string();
    std::lock_guard<std::mutex> lock(mu_);
    auto it = open_.find(busiest);
    if (it == open_.end() || InodeOf(busiest) != it->second.inode) return std::string();  // closed meanwhile
    shutdown(busiest, SHUT_RDWR);
    return it->second.peer;
  }

  // Forgets the remembered connections that have closed, at most every kForgetMs (the
  // overload guard calls it every MemoryGuard::kCheckMs). Without it a closed connection
  // stayed remembered until its descriptor number was reused or the cap was reached: after
  // bench/soak.py's attack 408 closed connections were still remembered, four small blocks
  // each, allocated while the flood's blocks surrounded them, and each kept a page of the
  // heap the flood had taken resident after the flood's blocks were given back.
  void ForgetClosed() {
    std::lock_guard<std::mutex> lock(mu_);
    if (Clock::now() < next_forget_) return;
    ForgetClosedLocked();
    next_forget_ = Clock::now() + std::chrono::milliseconds(kForgetMs);
  }

  // A call of the connection `peer` (as gRPC names it) has ended; `premature`: its client
  // reset it (premature resets, above). Shuts the connection down when its resets reach
  // the limit.
  void CallEnded(const std::string &peer, bool premature) {
    uint64_t calls = 0, resets = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto at = by_peer_.find(peer);
      if (at == by_peer_.end()) return;
      auto it = open_.find(at->second);
      if (it == open_.end()) return;
      Open &c = it->second;
      ++c.calls;
      c.resets += premature ? 1 : 0;
      if (c.shut || 2 * c.resets < std::max(c.calls, kResetCalls)) return;
      if (InodeOf(it->first) != c.inode) return;  // closed, its descriptor reused meanwhile
      c.shut = true;
      calls = c.calls;
      resets = c.resets;
      shutdown(it->first, SHUT_RDWR);
    }
    refusals_->Note(kReasonPrematureResets,
                    "a connection whose client reset " + std::to_string(resets) + " of its " + std::to_string(calls) +
                        " calls as they began",
                    peer);
  }

 private:
  struct Mutator {
    grpc_socket_mutator base;  // first: gRPC sees a grpc_socket_mutator*
    Connections *connections;
  };

  // An open connection: its socket's inode, its peer, its calls ended and reset.
  struct Open {
    ino_t inode;
    std::string peer;
    uint64_t calls, resets;
    bool shut;
  };

  static bool Mutate(const grpc_mutate_socket_info *info, grpc_socket_mutator *m) {
    Connections *connections = reinterpret_cast<Mutator *>(m)->connections;
    if (info->usage == GRPC_FD_SERVER_CONNECTION_USAGE) connections->Accepted(info->fd);
    if (info->usage == GRPC_FD_SERVER_LISTENER_USAGE) {
      std::lock_guard<std::mutex> lock(connections->mu_);
      connections->listeners_.push_back(info->fd);
    }
    return true;  // false would make gRPC stop accepting on the port
  }
  static int Compare(grpc_socket_mutator *a, grpc_socket_mutator *b) { return a < b ? -1 : a > b ? 1 : 0; }
  static void Destroy(grpc_socket_mutator *) {}  // the registry owns it

  // The address of the socket's other end, as gRPC writes peers ("ipv4:127.0.0.1:5000").
  static std::string PeerOf(int fd) {
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    char host[INET6_ADDRSTRLEN] = "?";
    if (getpeername(fd, reinterpret_cast<sockaddr *>(&addr), &len) != 0) return "an unknown peer";
    if (addr.ss_family == AF_INET) {
      const auto *a = reinterpret_cast<const sockaddr_in *>(&addr);
      inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
      return std::string("ipv4:") + host + ":" + std::to_string(ntohs(a->sin_port));
    }
    if (addr.ss_family == AF_INET6) {
      const auto *a = reinterpret_cast<const sockaddr_in6 *>(&addr);
      if (IN6_IS_ADDR_V4MAPPED(&a->sin6_addr)) {  // as gRPC writes it
        inet_ntop(AF_INET, &a->sin6_addr.s6_addr[12], host, sizeof(host));
        return std::string("ipv4:") + host + ":" + std::to_string(ntohs(a->sin6_port));
      }
      inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
      return std::string("ipv6:[") + host + "]:" + std::to_string(ntohs(a->sin6_port));
    }
    return "a local peer";
  }

  static ino_t InodeOf(int fd) {
    struct stat st {};
    return fstat(fd, &st) == 0 ? st.st_ino : 0;
  }

  // Bytes each open connection has received (TCP_INFO), by descriptor.
  std::unordered_map<int, uint64_t> Received() {
    std::unordered_map<int, uint64_t> out;
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto &c : open_) {
      tcp_info info{};
      socklen_t len = sizeof(info);
      if (InodeOf(c.first) == c.second.inode && getsockopt(c.first, IPPROTO_TCP, TCP_INFO, &info, &len) == 0 &&
          len >= offsetof(tcp_info, tcpi_bytes_received) + sizeof(info.tcpi_bytes_received)) {
        out[c.first] = info.tcpi_bytes_received;
      }
    }
    return out;
  }

  void Accepted(int fd) {
    const ino_t inode = InodeOf(fd);
    const std::string peer = PeerOf(fd);
    bool refuse = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      Forget(open_.find(fd));  // a descriptor number reused: its former socket is closed
      if (static_cast<long>(open_.size()) >= limit_ && Clock::now() >= next_recount_) {
        ForgetClosedLocked();
        next_recount_ = Clock::now() + std::chrono::milliseconds(kRecountMs);
      }
      refuse = static_cast<long>(open_.size()) >= limit_;
      if (!refuse) {
        open_[fd] = Open{inode, peer, 0, 0, false};
        by_peer_[peer] = fd;
      }
      if (backlog_ > 1 && refuse != narrowed_) {  // LimitBacklog's comment
        narrowed_ = refuse;
        for (int listener : listeners_) listen(listener, refuse ? 1 : backlog_);
      }
    }
    if (refuse) {
      refusals_->Note(kReasonMaxConnections, "a new connection", peer);
      shutdown(fd, SHUT_RDWR);
    }
  }

  // Drops every remembered connection whose descriptor no longer names its socket. Under mu_.
  void ForgetClosedLocked() {
    for (auto it = open_.begin(); it != open_.end();) {
      it = InodeOf(it->first) == it->second.inode ? std::next(it) : Forget(it);
    }
  }

  // Drops a remembered connection (none: `it` is the end); the next one. Under mu_.
  std::unordered_map<int, Open>::iterator Forget(std::unordered_map<int, Open>::iterator it) {
    if (it == open_.end()) return it;
    auto at = by_peer_.find(it->second.peer);
    if (at != by_peer_.end() && at->second == it->first) by_peer_.erase(at);
    return open_.erase(it);
  }

  const long limit_;
  Refusals *refusals_;
  Mutator mutator_;
  std::mutex mu_;
  std::unordered_map<int, Open> open_;
  std::unordered_map<std::string, int> by_peer_;  // the descriptor of each open connection
  std::vector<int> listeners_;  // the port's listening sockets
  int backlog_ = 0;             // LimitBacklog's queue (0: the kernel's)
  bool narrowed_ = false;       // the queue narrowed to one while the cap refuses
  Clock::time_point next_recount_;
  Clock::time_point next_forget_;
};

}  // namespace nlmserve_frontend

#endif  // NLMSERVE_FRONTEND_CONNECTIONS_H
