// The native front end's guards: what a caller or a connection may hold, and how a call the
// front end ends itself ends. Included by nlmserve_frontend.cpp (one translation unit).
//
// - Endings: the status of each way the front end ends a call itself (kEndingCodes, the
//   "frontend:" rows of proto/contract/status_codes.tsv), counted for the stats line.
// - TokenSet: the bearer tokens of --token-file, checked from a call's metadata before
//   anything else is read; re-read on SIGHUP.
// - Slots: concurrency limits (in all, per connection, per client) on the calls held.
// - Refusals: refusals by a limit counted by reason and logged at most once per reason
//   every kRefusalLogSeconds.
// - Connections: the most client connections open at once, and which one to shed when the
//   heap passes its limit (MemoryGuard).
#ifndef NLMSERVE_FRONTEND_GUARDS_H
#define NLMSERVE_FRONTEND_GUARDS_H

#include <arpa/inet.h>
#include <fcntl.h>
#include <linux/tcp.h>
#include <malloc.h>
#include <netinet/in.h>
#include <sys/stat.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include <grpc/support/log.h>
#include <grpc/support/sync.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/server_builder_option.h>
#include <grpcpp/support/channel_arguments.h>

#include "nlmserve_client.h"

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

using Clock = std::chrono::steady_clock;

inline void Log(const std::string &message) {
  std::ostringstream line;
  line << "nlmserve_frontend: " << message << "\n";
  std::cerr << line.str() << std::flush;
}

// gRPC's own log lines (an error per refused compressed call, for one) at most
// kGrpcLogLines every kGrpcLogSeconds, then one line saying how many were left out, so
// that no client can flood the log through gRPC.
constexpr int kGrpcLogLines = 20;
constexpr double kGrpcLogSeconds = 10.0;

inline void GrpcLogLine(gpr_log_func_args *args) {
  static std::mutex mu;
  static Clock::time_point window;
  static int lines = 0;
  static uint64_t left_out = 0;
  std::string out;
  {
    std::lock_guard<std::mutex> lock(mu);
    const auto now = Clock::now();
    if (now - window >= std::chrono::duration<double>(kGrpcLogSeconds)) {
      if (left_out > 0) out = "grpc: " + std::to_string(left_out) + " more line(s) left out\n";
      window = now;
      lines = 0;
      left_out = 0;
    }
    if (lines >= kGrpcLogLines) {
      ++left_out;
      if (out.empty()) return;
    } else {
      ++lines;
      out += std::string("grpc: ") + gpr_log_severity_string(args->severity) + " " + args->message + " (" +
             args->file + ":" + std::to_string(args->line) + ")";
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  Log(out);
}

inline void LimitGrpcLog() { gpr_set_log_function(GrpcLogLine); }

// ------------------------------------------------------------------------------ endings

// The ways a call ends in the front end itself, and their codes: the rows "frontend:" of
// proto/contract/status_codes.tsv, which `nlmserve_frontend --check-status-codes FILE`
// checks this table against (tests/test_native_frontend.py runs it). Every other status a
// client sees is the backend's own.
enum Ending {
  kBackendUnreachable,
  kBackendTimeout,
  kBackendBadAnswer,
  kQueueFull,
  kStopping,
  kUnauthenticated,      // no or an unknown bearer token (before the message is read)
  kMalformed,            // a request message that does not parse
  kNoMessage,            // the call ended without a request message
  kFirstMessageTimeout,  // no request message within --first-message-ms of the headers
  kSlotsFull,            // a concurrency limit (Slots)
  kExpired,              // the call's deadline passed before its request was sent on
  kCancelled,            // the client cancelled or went away before its request was sent on
  kStreamWriteTimeout,   // the client did not read an answer within --stream-write-timeout-ms
  kUnknownMethod,        // a method the front end does not serve
  kUnknownHealthService, // health Check of a service the front end does not report
  kMetadataTooLarge,     // a header list larger than --max-metadata-kb
  kWatchesFull,          // a health Watch beyond its pool (gRFC A17: then counted healthy)
  kEndings
};
struct EndingCode {
  const char *condition;
  grpc::StatusCode code;
};
const EndingCode kEndingCodes[kEndings] = {
    {"backend_unreachable", grpc::StatusCode::UNAVAILABLE},
    {"backend_timeout", grpc::StatusCode::DEADLINE_EXCEEDED},
    {"backend_bad_answer", grpc::StatusCode::INTERNAL},
    {"queue_full", grpc::StatusCode::RESOURCE_EXHAUSTED},
    {"stopping", grpc::StatusCode::UNAVAILABLE},
    {"unauthenticated", grpc::StatusCode::UNAUTHENTICATED},
    {"malformed", grpc::StatusCode::INVALID_ARGUMENT},
    {"no_message", grpc::StatusCode::INVALID_ARGUMENT},
    {"first_message_timeout", grpc::StatusCode::DEADLINE_EXCEEDED},
    {"slots_full", grpc::StatusCode::RESOURCE_EXHAUSTED},
    {"expired", grpc::StatusCode::DEADLINE_EXCEEDED},
    {"cancelled", grpc::StatusCode::CANCELLED},
    {"stream_write_timeout", grpc::StatusCode::DEADLINE_EXCEEDED},
    {"unknown_method", grpc::StatusCode::UNIMPLEMENTED},
    {"unknown_health_service", grpc::StatusCode::NOT_FOUND},
    {"metadata_too_large", grpc::StatusCode::RESOURCE_EXHAUSTED},
    {"watches_full", grpc::StatusCode::UNIMPLEMENTED},
};

// How many calls ended each way; thread-safe.
class EndingCounts {
 public:
  EndingCounts() {
    for (auto &n : counts_) n.store(0);
  }
  void Add(Ending ending) { counts_[ending].fetch_add(1, std::memory_order_relaxed); }
  uint64_t Get(Ending ending) const { return counts_[ending].load(std::memory_order_relaxed); }

  // "N condition, ..." for the conditions that happened (empty when none).
  std::string Summary() const {
    std::ostringstream s;
    for (int e = 0; e < kEndings; ++e) {
      uint64_t n = counts_[e].load(std::memory_order_relaxed);
      if (n == 0) continue;
      if (s.tellp() > 0) s << ", ";
      s << n << " " << kEndingCodes[e].condition;
    }
    return s.str();
  }

 private:
  std::atomic<uint64_t> counts_[kEndings];
};

// The process's one tally of endings (the stats line at exit reads it).
inline EndingCounts &Endings() {
  static EndingCounts counts;
  return counts;
}

// The status of `ending` with `message`, counted.
inline grpc::Status End(Ending ending, const std::string &message) {
  Endings().Add(ending);
  return grpc::Status(kEndingCodes[ending].code, message);
}

// ------------------------------------------------------------------------------ tokens

// The bearer tokens callers may present: those of --token-file and, when it is set too,
// of --admin-token-file (an admin token may call every method, as the Python server's call
// gate accepts it; which token may reload is the backend's to say). Every token of a file
// is accepted (the rule of proto/contract/token_files.tsv, nlmserve::ParseTokens of the
// client library); the token file's first is the one the front end sends on its own calls.
// Thread-safe; each file is read whole or its tokens in force stay.
class TokenSet {
 public:
  // The longest token file read (the Python server's limit, server/files.py).
  static constexpr std::size_t kMaxFileBytes = 1024 * 1024;

  // The files to read: `path` (none: calls need no token) and `admin_path` (may be empty).
  void SetFiles(const std::string &path, const std::string &admin_path) {
    std::lock_guard<std::mutex> lock(mu_);
    paths_.clear();
    if (!path.empty()) paths_.push_back(path);
    if (!path.empty() && !admin_path.empty()) paths_.push_back(admin_path);
    files_.assign(paths_.size(), nullptr);
  }

  // Reads every file; returns what is wrong with those that could not be read (one line
  // each; empty when all were), whose tokens in force stay.
  std::string Load() {
    std::vector<std::string> paths;
    {
      std::lock_guard<std::mutex> lock(mu_);
      paths = paths_;
    }
    std::string errors;
    for (std::size_t i = 0; i < paths.size(); ++i) {
      auto tokens = std::make_shared<std::vector<std::string> >();
      const std::string error = ReadFile(paths[i], tokens.get());
      if (!error.empty()) {
        errors += (errors.empty() ? "" : "; ") + error;
        continue;
      }
      std::lock_guard<std::mutex> lock(mu_);
      files_[i] = std::move(tokens);
    }
    return errors;
  }

  // Whether calls need a token (--token-file is set).
  bool required() const {
    std::lock_guard<std::mutex> lock(mu_);
    return !paths_.empty();
  }

  // The token of the front end's own calls (empty: none).
  std::string First() const {
    auto files = Current();
    return !files.empty() && files[0] ? files[0]->front() : std::string();
  }

  // The tokens in force, all files together.
  std::size_t size() const {
    std::size_t n = 0;
    for (const auto &file : Current()) n += file ? file->size() : 0;
    return n;
  }

  // Null when the `authorization` metadata `header` (null: none) may call, else the
  // UNAUTHENTICATED message; `*client` is then the token when more than one is in force
  // (the caller's identity for its share of the slots), else left empty. "Bearer" in any
  // case, one space, the token (surrounding white space ignored), compared with every
  // token in a time that does not depend on which one matches or where a wrong one differs.
  const char *Refusal(const grpc::string_ref *header, std::string *client) const {
    if (!required()) return nullptr;
    if (header == nullptr) return "missing bearer token";
    const std::string raw(header->data(), header->size());
    const std::size_t space = raw.find(' ');
    std::string scheme = raw.substr(0, space);
    for (char &c : scheme) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (scheme != "bearer" || space == std::string::npos) return "invalid bearer token";
    std::string given = raw.substr(space + 1);
    const char *white = " \t\r\n\v\f";
    const std::size_t a = given.find_first_not_of(white);
    given = a == std::string::npos ? std::string() : given.substr(a, given.find_last_not_of(white) - a + 1);
    bool ok = false;
    std::size_t count = 0;
    for (const auto &file : Current()) {
      if (!file) continue;
      for (const std::string &token : *file) ok |= SameBytes(given, token);
      count += file->size();
    }
    if (!ok) return "invalid bearer token";
    if (count > 1) *client = "token:" + given;
    return nullptr;
  }

 private:
  // The tokens of the file `path` in `tokens`; else what is wrong with the file. The file
  // must be a regular one (opened non-blocking, then fstat: a FIFO or a device is refused
  // without waiting on it) of at most kMaxFileBytes.
  static std::string ReadFile(const std::string &path, std::vector<std::string> *tokens) {
    int fd = open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return "cannot read token file " + path + ": " + std::strerror(errno);
    struct stat st {};
    std::string text, error;
    if (fstat(fd, &st) != 0) {
      error = "cannot read token file " + path + ": " + std::strerror(errno);
    } else if (!S_ISREG(st.st_mode)) {
      error = "token file " + path + " is not a regular file";
    } else {
      char buffer[65536];
      for (;;) {
        ssize_t k = read(fd, buffer, sizeof(buffer));
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) {
          error = "cannot read token file " + path + ": " + std::strerror(errno);
          break;
        }
        if (k == 0) break;
        text.append(buffer, static_cast<std::size_t>(k));
        if (text.size() > kMaxFileBytes) {
          error = "token file " + path + " is larger than " + std::to_string(kMaxFileBytes) + " bytes";
          break;
        }
      }
    }
    close(fd);
    if (!error.empty()) return error;
    const int bad = nlmserve::ParseTokens(text, tokens);
    if (bad > 0) return path + ":" + std::to_string(bad) + ": a token is printable ASCII and holds no whitespace";
    if (bad < 0) return "token file " + path + " holds no token";
    return std::string();
  }

  std::vector<std::shared_ptr<const std::vector<std::string> > > Current() const {
    std::lock_guard<std::mutex> lock(mu_);
    return files_;
  }

  // Equality in a time that depends on the lengths only.
  static bool SameBytes(const std::string &a, const std::string &b) {
    unsigned char diff = a.size() == b.size() ? 0 : 1;
    const std::size_t n = std::min(a.size(), b.size());
    for (std::size_t i = 0; i < n; ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
    return diff == 0;
  }

  mutable std::mutex mu_;
  std::vector<std::string> paths_;
  std::vector<std::shared_ptr<const std::vector<std::string> > > files_;  // null: never read
};

// Failed authentications per client address, answered more slowly as they accumulate (the
// Python server's rule, server/auth.py AuthFailures): an address's first kFree failures
// within kWindowSeconds are answered at once (a client with a wrong token learns it at
// once); after them each refusal waits kFirstDelaySeconds, doubling with each further
// failure up to kMaxDelaySeconds, so that one address can test at most a few tokens a
// second per call it keeps waiting. At most kHeldPerAddress refusals of one address, and
// kHeld in all, wait at once; beyond those a refusal is answered at once, so that waiting
// refusals hold bounded memory. Calls with a valid token are never slowed. Thread-safe.
class AuthFailures {
 public:
  static constexpr int kFree = 10;
  static constexpr double kWindowSeconds = 60.0;
  static constexpr double kFirstDelaySeconds = 0.05;
  static constexpr double kMaxDelaySeconds = 1.0;
  static constexpr int kHeldPerAddress = 32;
  static constexpr int kHeld = 1024;
  // Addresses remembered at most; the one that failed longest ago is forgotten first.
  static constexpr std::size_t kAddresses = 65536;

  // Counts a failure of `address`; the seconds its refusal waits (0: answer at once). A
  // positive delay must be followed by Answered(address) once the refusal is sent.
  double Failed(const std::string &address) {
    std::lock_guard<std::mutex> lock(mu_);
    const auto now = Clock::now();
    auto it = recent_.find(address);
    Window window{now, 0, order_.end()};
    if (it != recent_.end()) {
      window = it->second;
      order_.erase(window.position);
      recent_.erase(it);
    }
    if (now - window.start > std::chrono::duration<double>(kWindowSeconds)) window = Window{now, 0, order_.end()};
    ++window.failures;
    order_.push_back(address);
    window.position = std::prev(order_.end());
    recent_[address] = window;
    if (recent_.size() > kAddresses) {
      recent_.erase(order_.front());
      order_.pop_front();
    }
    int &held = held_[address];
    if (window.failures <= kFree || held >= kHeldPerAddress || total_held_ >= kHeld) {
      if (held == 0) held_.erase(address);
      return 0.0;
    }
    ++held;
    ++total_held_;
    const int doublings = std::min(window.failures - kFree - 1, 30);
    return std::min(kMaxDelaySeconds, kFirstDelaySeconds * static_cast<double>(1L << doublings));
  }

  // A delayed refusal of `address` was sent (or its call ended).
  void Answered(const std::string &address) {
    std::lock_guard<std::mutex> lock(mu_);
    --total_held_;
    auto it = held_.find(address);
    if (it != held_.end() && --it->second <= 0) held_.erase(it);
  }

 private:
  struct Window {
    Clock::time_point start;
    int failures;
    std::list<std::string>::iterator position;  // in order_
  };
  std::mutex mu_;
  std::unordered_map<std::string, Window> recent_;
  std::list<std::string> order_;  // addresses, the one that failed longest ago first
  std::unordered_map<std::string, int> held_;
  int total_held_ = 0;
};

// ------------------------------------------------------------------------------ refusals

// Why a call or a connection was refused by a guard: the names of the Python server's
// refusal reasons (nlmserve_refused_total{reason}), so that both front ends' logs read alike.
enum Reason {
  kReasonUnauthenticated,
  kReasonMaxConcurrentRpcs,
  kReasonMaxRpcsPerConnection,
  kReasonMaxRpcsPerClient,
  kReasonMaxHealthWatches,
  kReasonMaxHealthWatchesPerConnection,
  kReasonFirstMessageTimeout,
  kReasonStreamWriteTimeout,
  kReasonMaxConnections,
  kReasonMaxMemory,
  kReasonAwaitingMessage,
  kReasonPrematureResets,
  kReasons
};
const char *const kReasonNames[kReasons] = {
    "unauthenticated",   "max_concurrent_rpcs",       "max_rpcs_per_connection",
    "max_rpcs_per_client", "max_health_watches",      "max_health_watches_per_connection",
    "first_message_timeout", "stream_write_timeout", "max_connections", "max_memory", "calls_awaiting_message",
    "premature_resets",
};

// Seconds between two log lines about refusals of one reason.
constexpr double kRefusalLogSeconds = 10.0;

// Refusals counted by reason and logged without letting a flood of them flood the log:
// one line per reason every kRefusalLogSeconds at most, with the count since the last.
class Refusals {
 public:
  void Note(Reason reason, const std::string &what, const std::string &peer) {
    std::string line;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++total_[reason];
      ++unlogged_[reason];
      const auto now = Clock::now();
      if (!logged_once_[reason] || now - logged_at_[reason] >= std::chrono::duration<double>(kRefusalLogSeconds)) {
        std::ostringstream s;
        const bool connections =
            reason == kReasonMaxConnections || reason == kReasonMaxMemory || reason == kReasonPrematureResets;
        s << "refused " << unlogged_[reason] << (connections ? " connection(s) by " : " call(s) by ") << kReasonNames[reason]
          << " since the last such line; the latest: " << Printable(what) << " from " << Printable(peer);
        line = s.str();
        unlogged_[reason] = 0;
        logged_at_[reason] = now;
        logged_once_[reason] = true;
      }
    }
    if (!line.empty()) Log(line);
  }

  // "N reason, ..." for the reasons that happened (empty when none).
  std::string Summary() const {
    std::lock_guard<std::mutex> lock(mu_);
    std::ostringstream s;
    for (int r = 0; r < kReasons; ++r) {
      if (total_[r] == 0) continue;
      if (s.tellp() > 0) s << ", ";
      s << total_[r] << " " << kReasonNames[r];
    }
    return s.str();
  }

  // A client-chosen string as a log may show it: at most 200 bytes, control and non-ASCII
  // bytes as \xHH, so that no caller can forge or break a log line.
  static std::string Printable(const std::string &text) {
    static const char kHex[] = "0123456789abcdef";
    std::string out;
    for (std::size_t i = 0; i < text.size() && i < 200; ++i) {
      unsigned char c = static_cast<unsigned char>(text[i]);
      if (c >= 0x20 && c < 0x7f && c != '\\') {
        out += static_cast<char>(c);
      } else {
        out += "\\x";
        out += kHex[c >> 4];
        out += kHex[c & 15];
      }
    }
    if (text.size() > 200) out += "...";
    return out;
  }

 private:
  mutable std::mutex mu_;
  uint64_t total_[kReasons] = {};
  uint64_t unlogged_[kReasons] = {};
  bool logged_once_[kReasons] = {};
  Clock::time_point logged_at_[kReasons];
};

// ------------------------------------------------------------------------------ slots

// The client a call counts against for a per-client share: its token when the token file
// holds several (TokenSet::Refusal sets it), else its address without the port
// ("ipv4:127.0.0.1:5000" -> "ipv4:127.0.0.1"), as the Python server's call gate does.
inline std::string ClientOf(const std::string &peer, const std::string &token_client) {
  if (!token_client.empty()) return token_client;
  const std::size_t colon = peer.rfind(':');
  const std::size_t bracket = peer.rfind(']');
  if (colon == std::string::npos || (bracket != std::string::npos && colon < bracket)) return peer;
  return peer.substr(0, colon);
}

// One kind of slot: what it holds (for messages), its limits in all, per connection (a
// peer address and port) and per client (ClientOf), and the reason and flag of each.
struct SlotKind {
  const char *what;
  long limit, per_connection, per_client;
  Reason reasons[3];
  const char *flags[3];
};

// Slots of one kind: at most `limit` held in all, `per_connection` by one connection,
// `per_client` by one client (each at most `limit`). A slot is given back in two parts, as
// the Python server's call gate does (server/gate.py, Pool): the front end's and its
// connection's (LeaveServer), and its client's (LeaveClient), which a call cut for not
// reading its answer keeps until gRPC has let it go (Call).
class Slots {
 public:
  explicit Slots(const SlotKind &kind)
      : kind_(kind),
        per_connection_(std::min(kind.per_connection, kind.limit)),
        per_client_(std::min(kind.per_client, kind.limit)) {}

  // Takes a slot for `connection` and `client`: true, or false with the refusal's reason
  // and RESOURCE_EXHAUSTED message.
  bool Take(const std::string &connection, const std::string &client, Reason *reason, std::string *message) {
    std::lock_guard<std::mutex> lock(mu_);
    int which = -1;
    long value = 0;
    if (active_ >= kind_.limit) {
      which = 0;
      value = kind_.limit;
    } else if (Held(by_connection_, connection) >= per_connection_) {
      which = 1;
      value = per_connection_;
    } else if (Held(by_client_, client) >= per_client_) {
      which = 2;
      value = per_client_;
    }
    if (which >= 0) {
      static const char *const kWho[] = {"the front end holds", "this connection holds", "this client holds"};
      *reason = kind_.reasons[which];
      *message = std::string(kWho[which]) + " its most " + kind_.what + " (" + kind_.flags[which] + " " +
                 std::to_string(value) + "); retry later";
      return false;
    }
    ++active_;
    ++by_connection_[connection];
    ++by_client_[client];
    return true;
  }

  // The call no longer holds a slot of the front end or of its connection.
  void LeaveServer(const std::string &connection) {
    std::lock_guard<std::mutex> lock(mu_);
    --active_;
    Release(&by_connection_, connection);
  }

  // The call no longer counts against its client's share.
  void LeaveClient(const std::string &client) {
    std::lock_guard<std::mutex> lock(mu_);
    Release(&by_client_, client);
  }

  long active() const {
    std::lock_guard<std::mutex> lock(mu_);
    return active_;
  }

 private:
  static long Held(const std::unordered_map<std::string, long> &held, const std::string &key) {
    auto it = held.find(key);
    return it == held.end() ? 0 : it->second;
  }
  static void Release(std::unordered_map<std::string, long> *held, const std::string &key) {
    auto it = held->find(key);
    if (it != held->end() && --it->second <= 0) held->erase(it);
  }

  const SlotKind kind_;
  const long per_connection_, per_client_;
  mutable std::mutex mu_;
  long active_ = 0;
  std::unordered_map<std::string, long> by_connection_, by_client_;
};

// ------------------------------------------------------------------------------ connections

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
// it is done only when the remembered ones reach the cap, and at most every kRecountMs.
class Connections {
 public:
  static constexpr long kRecountMs = 20;
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
  // are queued at once, so queue and cap together must fit in the open-files limit.
  void LimitBacklog(int backlog) {
    std::lock_guard<std::mutex> lock(mu_);
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
        for (auto it = open_.begin(); it != open_.end();) {
          it = InodeOf(it->first) == it->second.inode ? std::next(it) : Forget(it);
        }
        next_recount_ = Clock::now() + std::chrono::milliseconds(kRecountMs);
      }
      refuse = static_cast<long>(open_.size()) >= limit_;
      if (!refuse) {
        open_[fd] = Open{inode, peer, 0, 0, false};
        by_peer_[peer] = fd;
      }
    }
    if (refuse) {
      refusals_->Note(kReasonMaxConnections, "a new connection", peer);
      shutdown(fd, SHUT_RDWR);
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
  Clock::time_point next_recount_;
};

// ------------------------------------------------------------------------------ memory

// The heap as glibc counts it, all arenas together: bytes allocated and not freed, and
// bytes freed and kept for reuse (which the resident size includes until they are handed
// back to the system).
struct Heap {
  std::size_t in_use, kept;
};

inline Heap HeapNow() {
  const struct mallinfo2 m = mallinfo2();
  return Heap{m.uordblks + m.hblkhd, m.fordblks};
}

// The allocator settings of a long-running server (set before any thread starts): blocks of
// kMmapThresholdBytes and more get a mapping of their own, unmapped when freed, and every
// arena gives back the free top of its heap beyond kTrimThresholdBytes. Fixing both turns
// off glibc's dynamic threshold, which the first free of a large block (a message, a
// stream's buffers) raises to that block's size for good: the blocks of every later burst
// would then come from the arenas and stay there.
constexpr int kMmapThresholdBytes = 64 * 1024;
constexpr int kTrimThresholdBytes = 128 * 1024;

inline void ReturnFreedMemory() {
  mallopt(M_MMAP_THRESHOLD, kMmapThresholdBytes);
  mallopt(M_TRIM_THRESHOLD, kTrimThresholdBytes);
}

// The overload guard, every kCheckMs: when the heap in use passes the limit
// (--max-memory-mb), the busiest connection is shut down (Connections::ShedBusiest), until
// the heap is back under it. And what the allocator keeps is handed back to the system
// (malloc_trim), at most every kTrimSeconds, whenever it exceeds both kKeptFloorBytes and
// the heap in use. malloc_trim gives back the free pages anywhere in every arena, which
// glibc does not do by itself: after a flood the heap is a few MB in use scattered over
// the hundreds of MB the flood took, and the next calls' blocks, carved from those free
// chunks, touch their pages again: 12-19 MB of a settled front end's resident memory
// came back within the 10 s the trim used to wait (bench/soak.py), none within a second.
// A trim costs about a millisecond (one madvise per large free chunk).
class MemoryGuard {
 public:
  static constexpr long kCheckMs = 100;
  static constexpr long kSampleMs = 50;
  static constexpr std::size_t kKeptFloorBytes = 4u << 20;
  static constexpr double kTrimSeconds = 1.0;

  MemoryGuard(std::size_t limit_bytes, Connections *connections, Refusals *refusals)
      : limit_(limit_bytes), connections_(connections), refusals_(refusals) {}

  // One check; true when a connection was shed.
  bool Check() {
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
      malloc_trim(0);
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

#endif  // NLMSERVE_FRONTEND_GUARDS_H
