// nlmserve_frontend: a native micro-batching gRPC front end for `nlmserve serve`.
//
// Many decoder threads send ScoreNgrams requests of one or a few n-grams each. Answering
// each of them in Python costs a few hundred microseconds of gRPC machinery alone, which
// caps what the Python server's own micro-batching can gain. This process takes those
// small requests in C++, merges concurrent ones into one packed-id (or string) request of
// up to --max-batch-ngrams n-grams, waiting at most --max-delay-us for company, sends it
// to the Python server (the backend), and scatters the scores back in request order.
// Every other RPC (ScoreSentences, GetModelInfo, GetVocabulary, GetScoringTables,
// Admin.ReloadModel, server reflection) is forwarded to the backend as it is. It serves
// grpc.health.v1 itself (SERVING while the backend's own health service says so).
//
//   nlmserve_frontend --backend HOST:PORT --backend-socket PATH [--listen 127.0.0.1:0]
//       [--max-batch-ngrams 4096] [--max-delay-us 500] [--delay-policy adaptive] [--max-inflight 1]
//       [--max-queue-ngrams 1000000] [--backend-timeout-ms 30000] [--max-message-mb 64] [--grace-s 30]
//       [--connect-timeout-s 30] [--token-file F] [guard flags: Usage() lists them]
//
// Prints `listening on HOST:PORT` on stdout once bound (port 0 picks a free port) and logs
// to stderr. SIGTERM or SIGINT: health NOT_SERVING, stop accepting, finish in-flight
// requests within --grace-s, exit 0; a line of counts on the way out. SIGHUP: the token
// file is read again (an unusable file is logged and the tokens in force stay).
//
// Guards (calls.h, guards.h), the Python server's (server/gate.py) with the same flags as
// `nlmserve serve`, which passes them: every call but health's needs a bearer token of
// --token-file (all of its tokens are accepted), checked from the call's metadata before
// its message is read; a call's request message must come within --first-message-ms;
// calls held are limited in all, per connection and per client; a client that does not
// read an answer within --stream-write-timeout-ms loses the call; ScoreNgrams requests
// whose deadline passed or whose client left are dropped before they are batched or sent;
// connections are capped (--max-connections), kept alive or closed by the keepalive, idle
// and age flags, and must finish their HTTP/2 handshake within --handshake-timeout-ms;
// compressed requests are refused (identity only: nothing is inflated); a call's metadata
// is bounded (--max-metadata-kb), and when the heap passes --max-memory-mb the busiest
// connection is shed. gRPC's own log lines are rate-limited.
//
// Bearer tokens: each caller's `authorization` metadata is forwarded with its requests, so
// the backend checks it too; the first token of --token-file is the front end's own (the
// model info at start) when the backend requires one.
//
// It is part of the server, not a second one: `nlmserve serve --frontend native` starts it
// with --backend-socket PATH, the model server's private Unix socket (server/local.py),
// where merged packed-id batches go: one write and one read per batch instead of a Python
// gRPC call. String batches, requests sent alone and every other RPC go over gRPC to
// --backend.
//
// Exactness: requests are merged only when they agree on log base, normalisation and the
// caller's `authorization` metadata; packed rows shorter than the batch's widest are
// widened by the client library's WidenRows (their contexts left-padded with <s>), which
// the contract makes equivalent. A request that fails a cheap
// shape check, or is larger than a batch, goes to the backend alone. A merged packed batch
// tells the model server which rows are whose, and its answer gives each client request
// its own status: an invalid n-gram fails its own request only, with the status and
// message the backend gives that request alone. When the backend rejects a merged string
// batch as INVALID_ARGUMENT, each request of it is sent again alone, to the same end.
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <future>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#ifdef NLMSERVE_ABSL_SYNC
#include <absl/synchronization/mutex.h>
#endif
#include <grpc/compression.h>
#include <grpcpp/grpcpp.h>

#include "calls.h"
#include "guards.h"
#include "nlmserve/v1/lm.grpc.pb.h"
#include "nlmserve_client.h"

namespace {

using nlmserve::v1::GetModelInfoRequest;
using nlmserve::v1::LanguageModel;
using nlmserve::v1::ModelInfo;
using nlmserve::v1::ScoreNgramsRequest;
using nlmserve::v1::ScoreNgramsResponse;
// The guards and calls (guards.h, calls.h), and the Ending values of the status table.
using namespace nlmserve_frontend;

const char kServiceName[] = "nlmserve.v1.LanguageModel";
// Clients ping every 30 s while they have calls: pings at most this often are answered, not
// refused with GOAWAY (the Python server's CLIENT_PING_FLOOR_MS, server/app.py).
const int kClientPingFloorMs = 10000;

struct Options {
  std::string listen = "127.0.0.1:0";
  std::string backend;
  long max_batch_ngrams = 4096;
  long max_delay_us = 500;
  long max_inflight = 1;
  // adaptive: wait for company only while fewer requests are queued than the last batch
  // held (a lone client never waits); fixed: always wait up to --max-delay-us.
  bool fixed_delay = false;
  long max_queue_ngrams = 1000000;
  long backend_timeout_ms = 30000;
  long max_message_mb = 64;
  long grace_s = 30;
  long connect_timeout_s = 30;
  // Bearer tokens: every one is accepted from callers; the first is sent on the front
  // end's own calls to the backend (the model info at start).
  std::string token_file;
  // Admin tokens (with --token-file): accepted from callers too; the backend says which
  // token may reload.
  std::string admin_token_file;
  // The model server's private Unix socket for merged packed batches.
  std::string backend_socket;
  // Guards (the flags of `nlmserve serve` of the same names, in milliseconds).
  long first_message_ms = 60000;
  long keepalive_ms = 60000;
  long keepalive_timeout_ms = 20000;
  long max_connection_idle_ms = 300000;  // 0: never
  long max_connection_age_ms = 0;        // 0: never
  long max_connection_age_grace_ms = 60000;
  long handshake_timeout_ms = 10000;
  long max_concurrent_rpcs = 256;
  long max_rpcs_per_connection = 128;
  long max_rpcs_per_client = 128;
  long max_health_watches = 1024;
  long max_health_watches_per_connection = 8;
  long stream_write_timeout_ms = 30000;
  long max_connections = 4096;
  long max_metadata_kb = 16;  // the Python server's METADATA_BYTES (server/app.py)
  long max_concurrent_streams = 0;  // HTTP/2 streams per connection; 0: gRPC's default
  long max_memory_mb = 0;  // 0: derived from --max-message-mb (MemoryLimitBytes)
};

// 0 when the file's "frontend:" rows are exactly kEndingCodes (condition and number); else
// each difference on stderr and 1.
int CheckStatusCodes(const std::string &path) {
  std::ifstream in(path);
  if (!in) {
    std::cerr << "nlmserve_frontend: cannot read " << path << "\n";
    return 2;
  }
  std::map<std::string, int> file;
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("frontend:", 0) != 0) continue;
    std::istringstream fields(line);
    std::string condition, name, number;
    std::getline(fields, condition, '\t');
    std::getline(fields, name, '\t');
    std::getline(fields, number, '\t');
    file[condition.substr(9)] = std::atoi(number.c_str());
  }
  int bad = 0;
  for (const EndingCode &e : kEndingCodes) {
    auto it = file.find(e.condition);
    if (it == file.end() || it->second != static_cast<int>(e.code)) {
      std::cerr << "frontend:" << e.condition << " ends with code " << static_cast<int>(e.code) << ", the file says "
                << (it == file.end() ? std::string("nothing") : std::to_string(it->second)) << "\n";
      ++bad;
    }
    if (it != file.end()) file.erase(it);
  }
  for (const auto &rest : file) {
    std::cerr << "frontend:" << rest.first << " is in the file, not in the front end\n";
    ++bad;
  }
  std::cout << "status codes: " << kEndings << " front-end endings, " << bad << " differ\n";
  return bad ? 1 : 0;
}

[[noreturn]] void Usage(const std::string &error) {
  std::cerr << "nlmserve_frontend: " << error << "\n"
            << "usage: nlmserve_frontend --backend HOST:PORT --backend-socket PATH [--listen HOST:PORT]\n"
            << "         [--max-batch-ngrams N] [--max-delay-us US] [--delay-policy adaptive|fixed] [--max-inflight N]\n"
            << "         [--max-queue-ngrams N] [--backend-timeout-ms MS] [--max-message-mb MB] [--grace-s S]\n"
            << "         [--connect-timeout-s S] [--token-file F] [--admin-token-file F]\n"
            << "       guards (defaults as `nlmserve serve`'s):\n"
            << "         [--first-message-ms 60000] [--keepalive-ms 60000] [--keepalive-timeout-ms 20000]\n"
            << "         [--max-connection-idle-ms 300000 (0: never)] [--max-connection-age-ms 0 (0: never)]\n"
            << "         [--max-connection-age-grace-ms 60000] [--handshake-timeout-ms 10000]\n"
            << "         [--max-concurrent-rpcs 256] [--max-rpcs-per-connection 128] [--max-rpcs-per-client 128]\n"
            << "         [--max-health-watches 1024] [--max-health-watches-per-connection 8]\n"
            << "         [--stream-write-timeout-ms 30000] [--max-connections 4096] [--max-metadata-kb 16]\n"
            << "         [--max-concurrent-streams N (HTTP/2 streams per connection; default gRPC's)]\n"
            << "         [--max-memory-mb MB (default: 16 x --max-message-mb, at least 1024)]\n";
  std::exit(2);
}

long ParsePositive(const std::string &flag, const char *text, long minimum) {
  char *end = nullptr;
  errno = 0;
  long v = std::strtol(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || v < minimum) {
    Usage(flag + " needs an integer >= " + std::to_string(minimum) + ", got '" + text + "'");
  }
  return v;
}

Options ParseArgs(int argc, char **argv) {
  Options o;
  // Flags whose value is an integer, and the least each takes.
  const std::pair<const char *, std::pair<long Options::*, long> > kNumbers[] = {
      {"--max-batch-ngrams", {&Options::max_batch_ngrams, 1}},
      {"--max-delay-us", {&Options::max_delay_us, 0}},
      {"--max-inflight", {&Options::max_inflight, 1}},
      {"--max-queue-ngrams", {&Options::max_queue_ngrams, 1}},
      {"--backend-timeout-ms", {&Options::backend_timeout_ms, 1}},
      {"--max-message-mb", {&Options::max_message_mb, 1}},
      {"--grace-s", {&Options::grace_s, 0}},
      {"--connect-timeout-s", {&Options::connect_timeout_s, 1}},
      {"--first-message-ms", {&Options::first_message_ms, 1}},
      {"--keepalive-ms", {&Options::keepalive_ms, 1000}},
      {"--keepalive-timeout-ms", {&Options::keepalive_timeout_ms, 1}},
      {"--max-connection-idle-ms", {&Options::max_connection_idle_ms, 0}},
      {"--max-connection-age-ms", {&Options::max_connection_age_ms, 0}},
      {"--max-connection-age-grace-ms", {&Options::max_connection_age_grace_ms, 0}},
      {"--handshake-timeout-ms", {&Options::handshake_timeout_ms, 1}},
      {"--max-concurrent-rpcs", {&Options::max_concurrent_rpcs, 1}},
      {"--max-rpcs-per-connection", {&Options::max_rpcs_per_connection, 1}},
      {"--max-rpcs-per-client", {&Options::max_rpcs_per_client, 1}},
      {"--max-health-watches", {&Options::max_health_watches, 0}},
      {"--max-health-watches-per-connection", {&Options::max_health_watches_per_connection, 0}},
      {"--stream-write-timeout-ms", {&Options::stream_write_timeout_ms, 1}},
      {"--max-connections", {&Options::max_connections, 1}},
      {"--max-metadata-kb", {&Options::max_metadata_kb, 1}},
      {"--max-concurrent-streams", {&Options::max_concurrent_streams, 0}},
      {"--max-memory-mb", {&Options::max_memory_mb, 1}},
  };
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (flag == "-h" || flag == "--help") Usage("a micro-batching front end for `nlmserve serve`");
    if (i + 1 >= argc) Usage(flag + " needs a value");
    const char *v = argv[++i];
    bool number = false;
    for (const auto &n : kNumbers) {
      if (flag == n.first) {
        o.*(n.second.first) = ParsePositive(flag, v, n.second.second);
        number = true;
      }
    }
    if (number) continue;
    if (flag == "--listen") o.listen = v;
    else if (flag == "--backend") o.backend = v;
    else if (flag == "--delay-policy") {
      std::string policy = v;
      if (policy != "adaptive" && policy != "fixed") Usage("--delay-policy is adaptive or fixed, got '" + policy + "'");
      o.fixed_delay = policy == "fixed";
    }
    else if (flag == "--token-file") o.token_file = v;
    else if (flag == "--admin-token-file") o.admin_token_file = v;
    else if (flag == "--backend-socket") o.backend_socket = v;
    else Usage("unknown flag " + flag);
  }
  if (o.backend.empty()) Usage("--backend HOST:PORT is required");
  if (o.backend_socket.empty()) Usage("--backend-socket PATH is required");
  if (o.max_queue_ngrams < o.max_batch_ngrams) Usage("--max-queue-ngrams must be >= --max-batch-ngrams");
  return o;
}

// One connection of the private channel to the model server (server/local.py: the wire
// format is described there), used by one sender thread: one batch out, its answer back.
class LocalChannel {
 public:
  LocalChannel(std::string path, long timeout_ms) : path_(std::move(path)), timeout_ms_(timeout_ms) {}
  ~LocalChannel() { Close(); }
  LocalChannel(const LocalChannel &) = delete;
  LocalChannel &operator=(const LocalChannel &) = delete;

  // Sends the merged packed request made of `parts` (each client request's rows and its
  // own packed order, in row order) and fills `res` (scores, OOV flags from `unk_id`, log
  // base, normalisation, model hash) as the gRPC servicer would. Returns the batch's
  // status (the server's, or the channel's failure); when it is OK, `part_status` holds
  // each part's own status (a failed part's rows hold no score).
  grpc::Status Call(const ScoreNgramsRequest &req, const std::vector<std::pair<uint32_t, uint32_t> > &parts,
                    const std::string &authorization, uint32_t unk_id, ScoreNgramsResponse *res,
                    std::vector<grpc::Status> *part_status) {
    std::string error;
    if (fd_ < 0 && !Connect(&error)) return End(kBackendUnreachable, error);
    const std::string &ids = req.packed_ids();
    const uint32_t width = req.packed_order();
    const uint32_t rows = width ? static_cast<uint32_t>(ids.size() / (4u * width)) : 0;
    const uint32_t id = next_id_++;
    const uint32_t n_parts = static_cast<uint32_t>(parts.size());
    uint32_t flags = (req.log_base() == nlmserve::v1::LN ? 0u : 1u) | (req.allow_unnormalized() ? 2u : 0u);
    uint32_t head[7] = {id, flags, static_cast<uint32_t>(timeout_ms_), rows, width,
                        static_cast<uint32_t>(authorization.size()), n_parts};
    std::string frame("NLQ2", 4);
    frame.append(reinterpret_cast<const char *>(head), sizeof(head));  // little-endian hosts (x86-64, aarch64)
    frame.append(authorization);
    for (const auto &part : parts) {
      uint32_t two[2] = {part.first, part.second};
      frame.append(reinterpret_cast<const char *>(two), sizeof(two));
    }
    if (!WriteAll(frame.data(), frame.size()) || !WriteAll(ids.data(), ids.size())) return Broken("send");
    char rmagic[4];
    uint32_t rhead[7];
    if (!ReadAll(rmagic, 4) || !ReadAll(reinterpret_cast<char *>(rhead), sizeof(rhead))) return Broken("receive");
    if (std::memcmp(rmagic, "NLR2", 4) != 0 || rhead[0] != id) {
      errno = EPROTO;
      return Broken("accept a malformed answer from");
    }
    const uint32_t status = rhead[1], rflags = rhead[2], n = rhead[3], hash_len = rhead[4], msg_len = rhead[5],
                   answered_parts = rhead[6];
    if (hash_len > 4096 || msg_len > (1u << 20) ||
        (status == 0 && (n != rows || answered_parts != n_parts)) || (status != 0 && (n != 0 || answered_parts != 0))) {
      errno = EPROTO;
      return Broken("accept an inconsistent answer from");
    }
    std::string hash(hash_len, '\0'), message(msg_len, '\0');
    if (!ReadAll(&hash[0], hash_len) || !ReadAll(&message[0], msg_len)) return Broken("receive");
    if (status != 0) return grpc::Status(static_cast<grpc::StatusCode>(status), message);
    std::vector<uint32_t> table(2u * n_parts);
    if (!ReadAll(reinterpret_cast<char *>(table.data()), table.size() * 4u)) return Broken("receive");
    part_status->clear();
    part_status->reserve(n_parts);
    for (uint32_t i = 0; i < n_parts; ++i) {
      const uint32_t code = table[2u * i], len = table[2u * i + 1];
      if (len > (1u << 20) || (code == 0 && len != 0)) {
        errno = EPROTO;
        return Broken("accept an inconsistent answer from");
      }
      std::string text(len, '\0');
      if (!ReadAll(&text[0], len)) return Broken("receive");
      part_status->push_back(code == 0 ? grpc::Status::OK : grpc::Status(static_cast<grpc::StatusCode>(code), text));
    }
    auto *scores = res->mutable_log_probs();
    scores->Resize(static_cast<int>(n), 0.0f);
    if (!ReadAll(reinterpret_cast<char *>(scores->mutable_data()), 4u * n)) return Broken("receive");
    auto *oov = res->mutable_oov();
    oov->Reserve(static_cast<int>(n));
    for (uint32_t row = 0; row < n; ++row) {
      uint32_t last;
      std::memcpy(&last, ids.data() + (static_cast<std::size_t>(row) * width + width - 1) * 4, 4);
      oov->Add(last == unk_id);
    }
    res->set_log_base((rflags & 1u) ? nlmserve::v1::LOG10 : nlmserve::v1::LN);
    res->set_normalized((rflags & 2u) != 0);
    res->set_model_hash(hash);
    return grpc::Status::OK;
  }

 private:
  bool Connect(std::string *error) {
    fd_ = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (fd_ < 0 || path_.size() >= sizeof(addr.sun_path)) {
      *error = "cannot open the backend socket " + path_;
      Close();
      return false;
    }
    std::memcpy(addr.sun_path, path_.c_str(), path_.size() + 1);
    if (connect(fd_, reinterpret_cast<sockaddr *>(&addr), sizeof(addr)) != 0) {
      *error = "cannot connect to the backend socket " + path_ + ": " + std::strerror(errno);
      Close();
      return false;
    }
    // A backend that stops answering costs a batch its timeout, not the front end forever.
    timeval tv{};
    tv.tv_sec = timeout_ms_ / 1000 + 1;
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    return true;
  }

  void Close() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }

  // The connection is unusable (server gone, timeout, garbage): drop it; the next call reconnects.
  grpc::Status Broken(const std::string &what) {
    bool timed_out = errno == EAGAIN || errno == EWOULDBLOCK;
    Close();
    if (timed_out) return End(kBackendTimeout, "the backend socket did not answer in time");
    return End(kBackendUnreachable, "cannot " + what + " the backend socket " + path_);
  }

  bool WriteAll(const char *p, std::size_t n) {
    while (n > 0) {
      ssize_t k = send(fd_, p, n, MSG_NOSIGNAL);
      if (k < 0 && errno == EINTR) continue;
      if (k <= 0) return false;
      p += k;
      n -= static_cast<std::size_t>(k);
    }
    return true;
  }

  bool ReadAll(char *p, std::size_t n) {
    while (n > 0) {
      ssize_t k = recv(fd_, p, n, 0);
      if (k < 0 && errno == EINTR) continue;
      if (k <= 0) {
        if (k == 0) errno = ECONNRESET;
        return false;
      }
      p += k;
      n -= static_cast<std::size_t>(k);
    }
    return true;
  }

  const std::string path_;
  const long timeout_ms_;
  int fd_ = -1;
  uint32_t next_id_ = 1;
};

// What merged requests must agree on.
struct BatchKey {
  bool packed = true;
  int log_base = 0;
  bool allow_unnormalized = false;
  std::string authorization;
  bool operator==(const BatchKey &o) const {
    return packed == o.packed && log_base == o.log_base && allow_unnormalized == o.allow_unnormalized &&
           authorization == o.authorization;
  }
};

// One queued ScoreNgrams call.
struct Pending {
  std::shared_ptr<ScoreCall> call;
  BatchKey key;
  long ngrams;
  Clock::time_point arrival;
};

// One merged backend call and the calls it answers.
struct Batch {
  std::vector<Pending> items;
  grpc::ClientContext context;
  ScoreNgramsRequest request;
  ScoreNgramsResponse response;
  long ngrams = 0;
  // Packed batches (the local channel): each item's rows and packed order, and, once
  // answered, each item's own status.
  std::vector<std::pair<uint32_t, uint32_t> > parts;
  std::vector<grpc::Status> part_status;
};

// The batcher: ScoreNgrams calls (ScoreCall, admitted by the guards) merged into backend
// batches. A call whose deadline has passed or whose client has gone by the time its turn
// comes is dropped (DEADLINE_EXCEEDED or CANCELLED, counted) rather than batched or sent,
// so expired and abandoned requests cost the model nothing.
class Frontend final : public ScoreQueue {
 public:
  Frontend(const Options &options, std::shared_ptr<grpc::Channel> channel, const ModelInfo &info)
      : options_(options),
        stub_(LanguageModel::NewStub(channel)),
        order_(info.order()),
        bos_id_(info.bos_id()),
        unk_id_(info.unk_id()),
        max_batch_(std::min<long>(options.max_batch_ngrams,
                                  info.max_ngrams_per_request() ? static_cast<long>(info.max_ngrams_per_request())
                                                                : options.max_batch_ngrams)) {
    batcher_ = std::thread([this]() { Run(); });
    for (long i = 0; i < options_.max_inflight; ++i) senders_.emplace_back([this]() { SendLocal(); });
  }

  ~Frontend() { Stop(); }

  // Drains the queue and the in-flight batches, then ends the batching thread.
  void Stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      stopping_ = true;
    }
    cv_.notify_all();
    if (batcher_.joinable()) batcher_.join();
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [this]() { return inflight_ == 0; });
    senders_done_ = true;
    lock.unlock();
    outbox_cv_.notify_all();
    for (auto &t : senders_) t.join();
    senders_.clear();
  }

  std::string Stats() {
    std::lock_guard<std::mutex> lock(mu_);
    std::ostringstream s;
    s << requests_ << " ScoreNgrams requests (" << ngrams_ << " n-grams merged) in " << batches_
      << " backend batches, " << alone_ << " sent alone, " << rejected_ << " refused (queue full), " << dropped_
      << " dropped unsent (deadline passed or client gone)";
    return s.str();
  }

  // A ScoreNgrams call, parsed and holding its slot.
  void Submit(std::shared_ptr<ScoreCall> call) override {
    Ending gone;
    if (call->Gone(&gone)) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++requests_;
        ++dropped_;
      }
      call->Drop(gone);
      return;
    }
    const ScoreNgramsRequest &request = call->request();
    Pending p{std::move(call), BatchKey(), 0, Clock::now()};
    if (!Shape(request, &p.key, &p.ngrams) || p.ngrams > max_batch_) {
      SendAlone(p);
      return;
    }
    p.key.log_base = request.log_base();
    p.key.allow_unnormalized = request.allow_unnormalized();
    p.key.authorization = p.call->authorization();
    bool wake = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++requests_;
      ngrams_ += p.ngrams;
      if (stopping_ || queued_ngrams_ + p.ngrams > options_.max_queue_ngrams) {
        ++rejected_;
        p.call->Answer(stopping_ ? End(kStopping, "the front end is shutting down")
                                 : End(kQueueFull, "the front end's queue is full (" +
                                                       std::to_string(options_.max_queue_ngrams) +
                                                       " n-grams); retry later"));
        return;
      }
      const bool was_empty = queue_.empty();
      queued_ngrams_ += p.ngrams;
      queue_.push_back(std::move(p));
      // Wake the batching thread only when this arrival can change what it waits for: the
      // first request of an empty queue, a full batch, or (adaptive policy) as many
      // requests as the last batch held. Otherwise it is waiting out the delay or for a
      // batch in flight, and a wake-up would only cost a context switch.
      wake = was_empty || queued_ngrams_ >= max_batch_ ||
             (!options_.fixed_delay && static_cast<long>(queue_.size()) >= last_batch_requests_);
    }
    if (wake) cv_.notify_one();
  }

 private:
  // Whether the request has a shape that can be merged, and its key kind and size.
  bool Shape(const ScoreNgramsRequest &r, BatchKey *key, long *ngrams) const {
    // A log base the enum does not hold goes alone: the model server refuses it.
    if (r.log_base() != nlmserve::v1::LOG_BASE_UNSPECIFIED && r.log_base() != nlmserve::v1::LOG10 &&
        r.log_base() != nlmserve::v1::LN)
      return false;
    bool has_packed = !r.packed_ids().empty() || r.packed_order() != 0;
    if (has_packed && r.ngrams_size() > 0) return false;
    if (has_packed) {
      std::size_t bytes = r.packed_ids().size();
      uint32_t k = r.packed_order();
      if (k == 0 || k > order_ || bytes == 0 || bytes % (4u * k) != 0) return false;
      key->packed = true;
      *ngrams = static_cast<long>(bytes / (4u * k));
      return true;
    }
    if (r.ngrams_size() == 0) return false;
    for (const auto &g : r.ngrams()) {
      if (g.words_size() == 0 || static_cast<uint32_t>(g.words_size()) > order_) return false;
    }
    key->packed = false;
    *ngrams = r.ngrams_size();
    return true;
  }

  // Forwards one request unchanged; the caller gets the backend's answer as it is. A call
  // whose deadline passed or whose client left is dropped instead.
  void SendAlone(const Pending &p, bool resent = false) {
    Ending gone;
    const bool drop = p.call->Gone(&gone);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!resent) ++requests_;
      ++(drop ? dropped_ : alone_);
    }
    if (drop) {
      p.call->Drop(gone);
      return;
    }
    std::shared_ptr<ScoreCall> call = p.call;
    grpc::ClientContext *ctx = call->NewForward(options_.backend_timeout_ms);
    stub_->async()->ScoreNgrams(ctx, &call->request(), call->response(),
                                [call](grpc::Status status) { call->Answer(status); });
  }

  // The batching thread: waits for company up to the delay, takes one key's requests in
  // arrival order up to the batch size, and sends them while fewer than --max-inflight
  // batches are at the backend.
  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    const auto delay = std::chrono::microseconds(options_.max_delay_us);
    for (;;) {
      cv_.wait(lock, [this]() { return (!queue_.empty() && inflight_ < options_.max_inflight) || (stopping_ && queue_.empty()); });
      if (queue_.empty()) return;  // stopping, nothing left
      // Wait for company up to the delay; under the adaptive policy only while fewer
      // requests are queued than the last batch held: a lone client's request (last batch:
      // one request) goes at once, a crowd's batches wait for the crowd.
      auto until = queue_.front().arrival + delay;
      while (!stopping_ && queued_ngrams_ < max_batch_ &&
             (options_.fixed_delay || static_cast<long>(queue_.size()) < last_batch_requests_) &&
             Clock::now() < until) {
        cv_.wait_until(lock, until);
      }
      std::unique_ptr<Batch> batch(new Batch());
      std::vector<std::pair<std::shared_ptr<ScoreCall>, Ending> > gone;
      long left = 0;  // n-grams leaving the queue, taken or dropped
      bool keyed = false;
      BatchKey key;
      for (auto it = queue_.begin(); it != queue_.end();) {
        Ending why;
        if (it->call->Gone(&why)) {
          left += it->ngrams;
          gone.emplace_back(std::move(it->call), why);
          it = queue_.erase(it);
          continue;
        }
        if (!keyed) {
          key = it->key;
          keyed = true;
        }
        if (it->key == key && batch->ngrams + it->ngrams <= max_batch_) {
          batch->ngrams += it->ngrams;
          left += it->ngrams;
          batch->items.push_back(std::move(*it));
          it = queue_.erase(it);
          if (batch->ngrams == max_batch_) break;
        } else {
          ++it;
        }
      }
      queued_ngrams_ -= left;
      dropped_ += gone.size();
      if (batch->items.empty()) {  // every request looked at had gone
        lock.unlock();
        for (auto &g : gone) g.first->Drop(g.second);
        lock.lock();
        continue;
      }
      last_batch_requests_ = static_cast<long>(batch->items.size());
      ++inflight_;
      ++batches_;
      lock.unlock();
      for (auto &g : gone) g.first->Drop(g.second);
      Send(std::move(batch));
      lock.lock();
    }
  }

  void Send(std::unique_ptr<Batch> batch) {
    const BatchKey &key = batch->items.front().key;
    ScoreNgramsRequest &req = batch->request;
    req.set_log_base(static_cast<nlmserve::v1::LogBase>(key.log_base));
    req.set_allow_unnormalized(key.allow_unnormalized);
    if (key.packed) {
      uint32_t width = 0;
      for (const auto &p : batch->items) width = std::max(width, p.call->request().packed_order());
      std::string *out = req.mutable_packed_ids();
      out->reserve(static_cast<std::size_t>(batch->ngrams) * width * 4);
      batch->parts.reserve(batch->items.size());
      std::vector<uint32_t> narrow, wide;
      for (const auto &p : batch->items) {
        const std::string &in = p.call->request().packed_ids();
        uint32_t k = p.call->request().packed_order();
        batch->parts.emplace_back(static_cast<uint32_t>(p.ngrams), k);
        if (k == width) {
          out->append(in);
          continue;
        }
        // Shorter rows are widened as the client library's owner of the canonical context
        // does it (little-endian ids on the wire and on the hosts this builds for).
        const std::size_t rows = in.size() / (4u * k);
        narrow.resize(rows * k);
        wide.resize(rows * width);
        std::memcpy(narrow.data(), in.data(), rows * k * 4u);
        nlmserve::WidenRows(narrow.data(), rows, k, width, bos_id_, wide.data());
        out->append(reinterpret_cast<const char *>(wide.data()), wide.size() * 4u);
      }
      req.set_packed_order(width);
    } else {
      for (const auto &p : batch->items) {
        for (const auto &g : p.call->request().ngrams()) *req.add_ngrams() = g;
      }
    }
    if (key.packed) {  // to a sender thread of the local channel
      {
        std::lock_guard<std::mutex> lock(mu_);
        outbox_.push_back(std::move(batch));
      }
      outbox_cv_.notify_one();
      return;
    }
    batch->context.set_deadline(std::chrono::system_clock::now() +
                                std::chrono::milliseconds(options_.backend_timeout_ms));
    if (!key.authorization.empty()) batch->context.AddMetadata("authorization", key.authorization);
    Batch *raw = batch.release();
    stub_->async()->ScoreNgrams(&raw->context, &raw->request, &raw->response,
                                [this, raw](grpc::Status status) { Done(std::unique_ptr<Batch>(raw), status); });
  }

  // A sender thread of the local channel: one connection, one batch at a time.
  void SendLocal() {
    LocalChannel channel(options_.backend_socket, options_.backend_timeout_ms);
    for (;;) {
      std::unique_ptr<Batch> batch;
      {
        std::unique_lock<std::mutex> lock(mu_);
        outbox_cv_.wait(lock, [this]() { return !outbox_.empty() || senders_done_; });
        if (outbox_.empty()) return;
        batch = std::move(outbox_.front());
        outbox_.pop_front();
      }
      grpc::Status status = channel.Call(batch->request, batch->parts, batch->items.front().key.authorization, unk_id_,
                                         &batch->response, &batch->part_status);
      Done(std::move(batch), status);
    }
  }

  // Backend answer for a merged batch: scatter (a packed batch's failed parts get their own
  // status), or hand every request the batch's error.
  void Done(std::unique_ptr<Batch> batch, const grpc::Status &status) {
    const ScoreNgramsResponse &res = batch->response;
    const bool per_part = batch->part_status.size() == batch->items.size();
    if (status.ok() && res.log_probs_size() == batch->ngrams && res.oov_size() == batch->ngrams) {
      int at = 0;
      for (std::size_t item = 0; item < batch->items.size(); ++item) {
        Pending &p = batch->items[item];
        if (per_part && !batch->part_status[item].ok()) {
          at += static_cast<int>(p.ngrams);
          p.call->Answer(batch->part_status[item]);
          continue;
        }
        ScoreNgramsResponse *out = p.call->response();
        out->mutable_log_probs()->Reserve(static_cast<int>(p.ngrams));
        out->mutable_oov()->Reserve(static_cast<int>(p.ngrams));
        for (long i = 0; i < p.ngrams; ++i, ++at) {
          out->add_log_probs(res.log_probs(at));
          out->add_oov(res.oov(at));
        }
        out->set_log_base(res.log_base());
        out->set_normalized(res.normalized());
        out->set_model_hash(res.model_hash());
        p.call->Answer(grpc::Status::OK);
      }
    } else if (status.error_code() == grpc::StatusCode::INVALID_ARGUMENT && batch->items.size() > 1 &&
               !batch->items.front().key.packed) {
      // Some request of a string batch is invalid: each one alone gets its own exact answer.
      for (auto &p : batch->items) SendAlone(p, true);
    } else {
      grpc::Status err = status.ok() ? End(kBackendBadAnswer, "the backend answered " +
                                                                  std::to_string(res.log_probs_size()) + " scores for " +
                                                                  std::to_string(batch->ngrams) + " n-grams")
                                     : status;
      for (auto &p : batch->items) p.call->Answer(err);
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      --inflight_;
    }
    cv_.notify_one();
    done_cv_.notify_all();
  }

  const Options options_;
  std::unique_ptr<LanguageModel::Stub> stub_;
  const uint32_t order_;
  const uint32_t bos_id_;
  const uint32_t unk_id_;
  const long max_batch_;

  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::deque<Pending> queue_;
  long queued_ngrams_ = 0;
  long inflight_ = 0;
  long last_batch_requests_ = 1;
  bool stopping_ = false;
  uint64_t requests_ = 0, ngrams_ = 0, batches_ = 0, alone_ = 0, rejected_ = 0, dropped_ = 0;
  std::thread batcher_;
  std::deque<std::unique_ptr<Batch>> outbox_;  // batches for the local channel's senders
  std::condition_variable outbox_cv_;
  bool senders_done_ = false;
  std::vector<std::thread> senders_;
};

// The backend's model info, waiting up to the connect timeout for it to come up.
bool FetchInfo(LanguageModel::Stub *stub, long timeout_s, const std::string &token, ModelInfo *info,
               grpc::Status *last) {
  auto until = std::chrono::system_clock::now() + std::chrono::seconds(timeout_s);
  while (std::chrono::system_clock::now() < until) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::min(until, std::chrono::system_clock::now() + std::chrono::seconds(5)));
    ctx.set_wait_for_ready(true);
    if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
    *last = stub->GetModelInfo(&ctx, GetModelInfoRequest(), info);
    if (last->ok()) return true;
    if (last->error_code() != grpc::StatusCode::UNAVAILABLE &&
        last->error_code() != grpc::StatusCode::DEADLINE_EXCEEDED) {
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  return false;
}

// Whether the backend's own health service reports the LanguageModel service SERVING. The
// backend never limits its health service (server/gate.py), so no client, however many
// calls it holds, can make this probe fail.
bool BackendServing(grpc::GenericStub *stub) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  grpc::ByteBuffer request = HealthRequest(kServiceName), response;
  std::promise<grpc::Status> done;
  stub->UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                  [&done](grpc::Status status) { done.set_value(status); });
  return done.get_future().get().ok() && ParseHealthResponse(&response) == kServing;
}

// The heap the front end may hold in use before it sheds its busiest connection
// (MemoryGuard): --max-memory-mb, else sixteen of the largest messages, at least 1 GiB.
std::size_t MemoryLimitBytes(const Options &o) {
  const long mb = o.max_memory_mb ? o.max_memory_mb : std::max(1024L, 16 * o.max_message_mb);
  return static_cast<std::size_t>(mb) * 1024 * 1024;
}

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

// The connection cap, and the accept queue (0: the kernel's, as gRPC sets it), that fit in
// the open-files limit.
struct FileBudget {
  long connections;
  int backlog;
};

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
  if (getrlimit(RLIMIT_NOFILE, &files) != 0) return FileBudget{max_connections, 0};
  if (files.rlim_cur < files.rlim_max) {
    files.rlim_cur = files.rlim_max;
    setrlimit(RLIMIT_NOFILE, &files);
    getrlimit(RLIMIT_NOFILE, &files);
  }
  if (files.rlim_cur == RLIM_INFINITY ||
      static_cast<long>(files.rlim_cur) >= max_connections + 2L * kernel + kOwnFiles) {
    return FileBudget{max_connections, 0};
  }
  const long room = std::max(4L, static_cast<long>(files.rlim_cur) - kOwnFiles);
  const int backlog = static_cast<int>(std::min<long>(kernel, room / 4));
  const long cap = std::max(1L, std::min(max_connections, room - 2L * backlog));
  Log("the open-files limit (" + std::to_string(files.rlim_cur) + ") leaves room for " + std::to_string(cap) +
      " connections and " + std::to_string(backlog) + " queued ones: at most " + std::to_string(cap) +
      " are kept (--max-connections " + std::to_string(max_connections) +
      "; raise the hard limit, ulimit -Hn, for more)");
  return FileBudget{cap, backlog};
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

}  // namespace

int main(int argc, char **argv) {
  if (argc == 3 && std::string(argv[1]) == "--check-status-codes") return CheckStatusCodes(argv[2]);
  Options options = ParseArgs(argc, argv);
  ReturnFreedMemory();  // before the first thread and the first large block
#ifdef NLMSERVE_ABSL_SYNC
  // Debian's absl tracks the order of every mutex gRPC takes to report deadlock cycles:
  // about 3% of the front end's CPU under load, for a debugging aid.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
#endif
  Guards guards(options.max_concurrent_rpcs, options.max_rpcs_per_connection, options.max_rpcs_per_client,
                options.max_health_watches, options.max_health_watches_per_connection);
  guards.tokens.SetFiles(options.token_file, options.admin_token_file);
  const std::string token_error = guards.tokens.Load();
  if (!token_error.empty()) Usage(token_error);
  const FileBudget files = FitInFileLimit(options.max_connections);
  const long max_connections = files.connections;
  LimitGrpcLog();

  // SIGTERM and SIGINT (stop) and SIGHUP (re-read the token file) are taken by sigwait in
  // the main thread: block them before any thread starts so every thread inherits the mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  const int max_bytes = static_cast<int>(std::min<long>(options.max_message_mb * 1024L * 1024L, INT32_MAX));
  grpc::ChannelArguments channel_args;
  channel_args.SetMaxReceiveMessageSize(max_bytes);
  channel_args.SetMaxSendMessageSize(max_bytes);
  auto channel = grpc::CreateCustomChannel(options.backend, grpc::InsecureChannelCredentials(), channel_args);
  std::unique_ptr<LanguageModel::Stub> info_stub(LanguageModel::NewStub(channel));
  ModelInfo info;
  grpc::Status status;
  if (!FetchInfo(info_stub.get(), options.connect_timeout_s, guards.tokens.First(), &info, &status)) {
    Log("no answer from the backend " + options.backend + " within " + std::to_string(options.connect_timeout_s) +
        " s: " + status.error_message());
    return 1;
  }
  Log("backend " + options.backend + ": model " + info.model_hash().substr(0, 12) + ", order " +
      std::to_string(info.order()) + ", vocabulary " + std::to_string(info.vocab_size()) + ", device " + info.device() +
      ", packed batches over " + options.backend_socket);

  Frontend frontend(options, channel, info);
  HealthState health(kServiceName);
  CallLimits limits;
  limits.first_message_ms = options.first_message_ms;
  limits.stream_write_timeout_ms = options.stream_write_timeout_ms;
  limits.backend_timeout_ms = options.backend_timeout_ms;
  limits.max_metadata_bytes = options.max_metadata_kb * 1024;
  CallService service(&guards, &health, &frontend, channel, limits);
  Connections connections(max_connections, &guards.refusals);
  guards.connections = &connections;
  MemoryGuard memory(MemoryLimitBytes(options), &connections, &guards.refusals);

  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(options.listen, grpc::InsecureServerCredentials(), &port);
  Configure(options, max_bytes, &connections, &builder);
  builder.RegisterCallbackGenericService(&service);
  std::unique_ptr<grpc::Server> server(builder.BuildAndStart());
  if (!server || port == 0) {
    Log("cannot listen on " + options.listen);
    return 1;
  }
  if (files.backlog) connections.LimitBacklog(files.backlog);

  std::string host = options.listen.substr(0, options.listen.rfind(':'));
  std::cout << "listening on " << host << ":" << port << std::endl;
  Log("listening on " + host + ":" + std::to_string(port) + ", batches of up to " +
      std::to_string(std::min<long>(options.max_batch_ngrams, info.max_ngrams_per_request()
                                                                   ? static_cast<long>(info.max_ngrams_per_request())
                                                                   : options.max_batch_ngrams)) +
      " n-grams, delay " + std::to_string(options.max_delay_us) + " us, " + std::to_string(options.max_inflight) +
      " in flight; " + (guards.tokens.required() ? std::to_string(guards.tokens.size()) + " bearer token(s)"
                                                 : std::string("no token")) +
      ", at most " + std::to_string(options.max_concurrent_rpcs) + " calls held, " +
      std::to_string(max_connections) + " connections, " + std::to_string(MemoryLimitBytes(options) >> 20) +
      " MiB of heap");

  // Health follows the backend's own health service: one Check a second.
  std::atomic<bool> stopping(false);
  grpc::GenericStub probe(channel);
  std::thread monitor([&]() {
    bool serving = true;
    while (!stopping.load()) {
      bool ok = BackendServing(&probe);
      if (stopping.load()) break;
      if (ok != serving) {
        serving = ok;
        Log(ok ? "backend answers again: SERVING" : "backend does not answer: NOT_SERVING");
        health.Set(ok);
      }
      for (int i = 0; i < 10 && !stopping.load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  });

  // The overload guard: the heap checked every MemoryGuard::kCheckMs.
  std::thread watchdog([&]() {
    while (!stopping.load()) {
      if (!memory.Check()) std::this_thread::sleep_for(std::chrono::milliseconds(MemoryGuard::kCheckMs));
    }
  });

  int sig = 0;
  for (;;) {
    sigwait(&signals, &sig);
    if (sig != SIGHUP) break;
    if (!guards.tokens.required()) {
      Log("got SIGHUP: no --token-file to read again");
      continue;
    }
    const std::string error = guards.tokens.Load();
    Log("got SIGHUP: token files read again, " + std::to_string(guards.tokens.size()) + " token(s) in force" +
        (error.empty() ? std::string() : "; not read (their previous tokens stay): " + error));
  }
  Log(std::string("got ") + (sig == SIGTERM ? "SIGTERM" : "SIGINT") + ": draining");
  stopping = true;
  guards.stopping = true;
  health.CloseAll();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(options.grace_s));
  frontend.Stop();
  monitor.join();
  watchdog.join();
  Log(frontend.Stats());
  const std::string endings = Endings().Summary(), refusals = guards.refusals.Summary();
  Log("calls ended by the front end: " + (endings.empty() ? std::string("none") : endings) +
      "; refused by a guard: " + (refusals.empty() ? std::string("none") : refusals));
  return 0;
}
