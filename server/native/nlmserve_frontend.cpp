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
// Guards (call.h, guards.h and the headers it names), the Python server's (server/gate.py)
// with the same flags as `nlmserve serve`, which passes them: every call but health's needs a bearer token of
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
// where merged packed-id batches go (local_channel.h, in the frames of local_frames.h): one
// write and one read per batch instead of a Python gRPC call. String batches, requests
// sent alone and every other RPC go over gRPC to --backend.
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
//
// One concept a file: options.h (the command line), checks.h (the golden-file checks),
// backend.h (what the front end asks the backend), port.h (the public port's settings),
// service.h and the calls (call.h, score_call.h, relay_call.h, health_call.h, health.h),
// batcher.h, local_channel.h and local_frames.h, the guards (guards.h, tokens.h, slots.h,
// refusals.h, connections.h, memory.h), endings.h and log.h. This file starts and stops them.
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <iostream>
#include <memory>
#include <string>
#include <thread>

#ifdef NLMSERVE_ABSL_SYNC
#include <absl/synchronization/mutex.h>
#endif
#include <grpcpp/grpcpp.h>

#include "backend.h"
#include "batcher.h"
#include "checks.h"
#include "endings.h"
#include "guards.h"
#include "health.h"
#include "log.h"
#include "memory.h"
#include "options.h"
#include "poller.h"
#include "port.h"
#include "service.h"

namespace {

using namespace nlmserve_frontend;

// SIGTERM and SIGINT (stop), SIGHUP (re-read the token file) and SIGUSR1 (log the heap),
// taken by sigwait in the main thread: blocked before any thread starts so every thread
// inherits the mask.
sigset_t BlockSignals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGHUP);
  sigaddset(&signals, SIGUSR1);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  return signals;
}

// Waits for SIGTERM or SIGINT (returned), re-reading the token files on each SIGHUP and
// logging the heap on each SIGUSR1.
int WaitForStop(const sigset_t &signals, TokenSet *tokens) {
  int sig = 0;
  for (;;) {
    sigwait(&signals, &sig);
    if (sig == SIGUSR1) {
      Log("got SIGUSR1: " + HeapReport());
      continue;
    }
    if (sig != SIGHUP) return sig;
    if (!tokens->required()) {
      Log("got SIGHUP: no --token-file to read again");
      continue;
    }
    const std::string error = tokens->Load();
    Log("got SIGHUP: token files read again, " + std::to_string(tokens->size()) + " token(s) in force" +
        (error.empty() ? std::string() : "; not read (their previous tokens stay): " + error));
  }
}

// The largest batch: --max-batch-ngrams, or the backend's limit when lower.
long BatchLimit(const Options &options, const ModelInfo &info) {
  return std::min<long>(options.max_batch_ngrams, info.max_ngrams_per_request()
                                                      ? static_cast<long>(info.max_ngrams_per_request())
                                                      : options.max_batch_ngrams);
}

// The threads beside gRPC's: health following the backend's own health service (one Check
// a second), and the overload guard (the heap checked every MemoryGuard::kCheckMs).
class Watchers {
 public:
  Watchers(std::shared_ptr<grpc::Channel> channel, HealthState *health, MemoryGuard *memory) : probe_(channel) {
    monitor_ = std::thread([this, health]() {
      bool serving = true;
      while (!stopping_.load()) {
        bool ok = BackendServing(&probe_);
        if (stopping_.load()) break;
        if (ok != serving) {
          serving = ok;
          Log(ok ? "backend answers again: SERVING" : "backend does not answer: NOT_SERVING");
          health->Set(ok);
        }
        for (int i = 0; i < 10 && !stopping_.load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    });
    watchdog_ = std::thread([this, memory]() {
      while (!stopping_.load()) {
        if (!memory->Check()) std::this_thread::sleep_for(std::chrono::milliseconds(MemoryGuard::kCheckMs));
      }
    });
  }

  // The threads stop at their next look (Join waits for them).
  void Stop() { stopping_ = true; }
  void Join() {
    monitor_.join();
    watchdog_.join();
  }

 private:
  std::atomic<bool> stopping_{false};
  grpc::GenericStub probe_;
  std::thread monitor_, watchdog_;
};

// Serves until SIGTERM or SIGINT, then drains; the exit status.
int Serve(const Options &options, Guards *guards, const sigset_t &signals) {
  const FileBudget files = FitInFileLimit(options.max_connections);
  const int max_bytes = static_cast<int>(std::min<long>(options.max_message_mb * 1024L * 1024L, INT32_MAX));
  grpc::ChannelArguments channel_args;
  channel_args.SetMaxReceiveMessageSize(max_bytes);
  channel_args.SetMaxSendMessageSize(max_bytes);
  auto channel = grpc::CreateCustomChannel(options.backend, grpc::InsecureChannelCredentials(), channel_args);
  std::unique_ptr<LanguageModel::Stub> info_stub(LanguageModel::NewStub(channel));
  ModelInfo info;
  grpc::Status status;
  if (!FetchInfo(info_stub.get(), options.connect_timeout_s, guards->tokens.First(), &info, &status)) {
    Log("no answer from the backend " + options.backend + " within " + std::to_string(options.connect_timeout_s) +
        " s: " + status.error_message());
    return 1;
  }
  Log("backend " + options.backend + ": model " + info.model_hash().substr(0, 12) + ", order " +
      std::to_string(info.order()) + ", vocabulary " + std::to_string(info.vocab_size()) + ", device " + info.device() +
      ", packed batches over " + options.backend_socket);

  Batcher batcher(options, channel, info);
  HealthState health(kServiceName);
  CallLimits limits;
  limits.first_message_ms = options.first_message_ms;
  limits.stream_write_timeout_ms = options.stream_write_timeout_ms;
  limits.backend_timeout_ms = options.backend_timeout_ms;
  limits.max_metadata_bytes = options.max_metadata_kb * 1024;
  CallService service(guards, &health, &batcher, channel, limits);
  Connections connections(files.connections, &guards->refusals);
  guards->connections = &connections;
  MemoryGuard memory(MemoryLimitBytes(options), &connections, &guards->refusals);

  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(options.listen, grpc::InsecureServerCredentials(), &port);
  Configure(options, max_bytes, &connections, &builder);
  builder.RegisterCallbackGenericService(&service);
  const PollerRecords records = PresizePollerRecords(files.open_at_most);
  if (records.poller.empty()) {
    Log("this gRPC does not export its poller's calls: no connection records made at start (a flood of "
        "connections may leave up to 4 KiB resident for each)");
  } else if (records.made > 0) {
    Log(records.poller + " poller: records for " + std::to_string(records.made) +
        (records.made < files.open_at_most ? " of " + std::to_string(files.open_at_most) : std::string()) +
        " connections made at start");
  }
  std::unique_ptr<grpc::Server> server(builder.BuildAndStart());
  if (!server || port == 0) {
    Log("cannot listen on " + options.listen);
    return 1;
  }
  if (files.backlog) connections.LimitBacklog(files.backlog);

  std::string host = options.listen.substr(0, options.listen.rfind(':'));
  std::cout << "listening on " << host << ":" << port << std::endl;
  Log("listening on " + host + ":" + std::to_string(port) + ", batches of up to " +
      std::to_string(BatchLimit(options, info)) + " n-grams, delay " + std::to_string(options.max_delay_us) + " us, " +
      std::to_string(options.max_inflight) + " in flight; " +
      (guards->tokens.required() ? std::to_string(guards->tokens.size()) + " bearer token(s)"
                                 : std::string("no token")) +
      ", at most " + std::to_string(options.max_concurrent_rpcs) + " calls held, " +
      std::to_string(files.connections) + " connections, " + std::to_string(MemoryLimitBytes(options) >> 20) +
      " MiB of heap; malloc: " + AllocatorReport());

  Watchers watchers(channel, &health, &memory);
  const int sig = WaitForStop(signals, &guards->tokens);
  Log(std::string("got ") + (sig == SIGTERM ? "SIGTERM" : "SIGINT") + ": draining");
  watchers.Stop();
  guards->stopping = true;
  health.CloseAll();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(options.grace_s));
  batcher.Stop();
  watchers.Join();
  Log(batcher.Stats());
  Log("drained: " + HeapReport());
  const std::string endings = Endings().Summary(), refusals = guards->refusals.Summary();
  Log("calls ended by the front end: " + (endings.empty() ? std::string("none") : endings) +
      "; refused by a guard: " + (refusals.empty() ? std::string("none") : refusals));
  return 0;
}

}  // namespace

int main(int argc, char **argv) {
  if (argc == 3 && std::string(argv[1]) == "--check-status-codes") return CheckStatusCodes(argv[2]);
  if (argc == 3 && std::string(argv[1]) == "--check-local-frames") return CheckLocalFrames(argv[2]);
  RunWithoutThreadCache(argv);
  const Options options = ParseArgs(argc, argv);
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
  LimitGrpcLog();
  return Serve(options, &guards, BlockSignals());
}
