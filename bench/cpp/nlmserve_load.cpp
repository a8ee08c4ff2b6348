// nlmserve_load: a closed-loop load generator. N clients, each on its own channel (its own
// connection), send requests of B n-grams back to back for S seconds: a client sends its
// next request the moment the answer to the last one arrives, so N requests are always in
// flight. Prints requests/s, n-grams/s and latency percentiles as one JSON line.
//
//   nlmserve_load TARGET NGRAM_FILE [--clients 32] [--batch 1] [--seconds 5] [--warmup 1]
//       [--mode threads|async]
//
// --mode threads (the default): each client is a thread calling the C++ client library
// (nlmserve_client.h, the client a Moses decoder links; its n-gram cache off) synchronously.
// --mode async: one thread drives all N clients' calls through a gRPC completion queue, as
// Triton's perf_analyzer does in its async mode. Both send the same packed-id requests; the
// async generator spends several times less CPU per request, which matters when it shares
// the machine with the server it measures. --threads N is a synonym of --clients N.
//
// NGRAM_FILE: one n-gram per line, words separated by spaces (oldest first); words are
// mapped to ids once with the server's vocabulary, then sent as packed ids.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "nlmserve/v1/lm.grpc.pb.h"
#include "nlmserve_client.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Args {
  std::string target;
  std::string ngram_file;
  int threads = 32;
  int batch = 1;
  double seconds = 5.0;
  double warmup = 1.0;
  bool async = false;
};

Args Parse(int argc, char **argv) {
  if (argc < 3) {
    std::cerr << "usage: nlmserve_load TARGET NGRAM_FILE [--clients N] [--batch B] [--seconds S] [--warmup W]"
                 " [--mode threads|async]\n";
    std::exit(2);
  }
  Args a;
  a.target = argv[1];
  a.ngram_file = argv[2];
  for (int i = 3; i + 1 < argc; i += 2) {
    std::string flag = argv[i];
    const char *v = argv[i + 1];
    if (flag == "--threads" || flag == "--clients") a.threads = std::atoi(v);
    else if (flag == "--batch") a.batch = std::atoi(v);
    else if (flag == "--seconds") a.seconds = std::atof(v);
    else if (flag == "--warmup") a.warmup = std::atof(v);
    else if (flag == "--mode") {
      std::string mode = v;
      if (mode != "threads" && mode != "async") {
        std::cerr << "nlmserve_load: --mode is threads or async, got '" << mode << "'\n";
        std::exit(2);
      }
      a.async = mode == "async";
    }
    else {
      std::cerr << "nlmserve_load: unknown flag " << flag << "\n";
      std::exit(2);
    }
  }
  if (a.threads < 1 || a.batch < 1 || a.seconds <= 0) {
    std::cerr << "nlmserve_load: --clients, --batch and --seconds must be positive\n";
    std::exit(2);
  }
  return a;
}

std::vector<std::vector<std::string> > ReadNgrams(const std::string &path) {
  std::vector<std::vector<std::string> > out;
  if (!nlmserve::ReadNgramFile(path, &out)) {
    std::cerr << "nlmserve_load: cannot read " << path << "\n";
    std::exit(2);
  }
  if (out.empty()) {
    std::cerr << "nlmserve_load: no n-grams in " << path << "\n";
    std::exit(2);
  }
  return out;
}

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0.0;
  std::size_t k = static_cast<std::size_t>(q / 100.0 * (v.size() - 1) + 0.5);
  std::nth_element(v.begin(), v.begin() + k, v.end());
  return v[k];
}

// What a run measured: the latency of every answered request in the measured window, the
// failed ones, and the window's length.
struct Result {
  std::vector<double> latencies;
  uint64_t failed = 0;
  double elapsed = 0.0;
};

// Rows in the server's canonical shape (the client library's CanonicalRow: the async
// mode builds its packed requests itself). Exits with status 2 on an n-gram the model
// cannot score.
std::vector<std::vector<uint32_t> > CanonicalRows(const nlmserve::Client &client,
                                                  const std::vector<std::vector<std::string> > &words) {
  std::vector<std::vector<uint32_t> > rows;
  for (std::size_t i = 0; i < words.size(); ++i) {
    std::vector<uint32_t> ids;
    for (const auto &w : words[i]) ids.push_back(client.WordId(w));
    try {
      rows.push_back(client.CanonicalRow(ids, i));
    } catch (const nlmserve::ClientError &e) {
      std::cerr << "nlmserve_load: in the n-gram file (counting from 0): " << e.what() << "\n";
      std::exit(2);
    }
  }
  return rows;
}

// --mode threads: one thread and one client library Client per client.
Result RunThreads(const Args &args, const std::vector<std::vector<uint32_t> > &ids) {
  nlmserve::ClientOptions options;
  options.cache_size = 0;  // every request reaches the server
  std::vector<std::unique_ptr<nlmserve::Client> > clients;
  for (int t = 0; t < args.threads; ++t) clients.emplace_back(new nlmserve::Client(args.target, options));
  std::atomic<bool> measuring(false), stop(false);
  std::vector<std::vector<double> > latencies(args.threads);
  std::vector<uint64_t> failed(args.threads, 0);
  std::vector<std::thread> pool;
  for (int t = 0; t < args.threads; ++t) {
    pool.emplace_back([&, t]() {
      std::size_t next = static_cast<std::size_t>(t) * args.batch;
      const std::size_t width = clients[t]->info().order;
      std::vector<uint32_t> batch(args.batch * width);
      std::vector<float> scores(args.batch);
      while (!stop.load(std::memory_order_relaxed)) {
        for (int b = 0; b < args.batch; ++b) {
          const std::vector<uint32_t> &row = ids[(next + b) % ids.size()];
          std::copy(row.begin(), row.end(), batch.begin() + b * width);
        }
        next += static_cast<std::size_t>(args.threads) * args.batch;
        auto t0 = Clock::now();
        bool ok = true;
        try {
          clients[t]->ScoreRows(batch.data(), args.batch, width, scores.data());
        } catch (const nlmserve::ClientError &) {
          ok = false;
        }
        double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
        if (measuring.load(std::memory_order_relaxed)) {
          if (ok) {
            latencies[t].push_back(ms);
          } else {
            ++failed[t];
          }
        }
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::duration<double>(args.warmup));
  auto start = Clock::now();
  measuring = true;
  std::this_thread::sleep_for(std::chrono::duration<double>(args.seconds));
  measuring = false;
  Result r;
  r.elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  stop = true;
  for (auto &th : pool) th.join();
  for (int t = 0; t < args.threads; ++t) {
    r.latencies.insert(r.latencies.end(), latencies[t].begin(), latencies[t].end());
    r.failed += failed[t];
  }
  return r;
}

// --mode async: one thread, one completion queue, one channel per client.
Result RunAsync(const Args &args, const nlmserve::Client &client, const std::vector<std::vector<uint32_t> > &ids) {
  namespace pb = nlmserve::v1;
  struct Call {
    std::unique_ptr<pb::LanguageModel::Stub> stub;
    std::unique_ptr<grpc::ClientContext> ctx;
    pb::ScoreNgramsRequest request;
    pb::ScoreNgramsResponse response;
    grpc::Status status;
    std::unique_ptr<grpc::ClientAsyncResponseReader<pb::ScoreNgramsResponse> > rpc;
    Clock::time_point sent;
    std::size_t next = 0;
  };
  grpc::CompletionQueue cq;
  std::vector<Call> calls(args.threads);
  const uint32_t order = client.info().order;
  auto start_call = [&](std::size_t c) {
    Call &call = calls[c];
    std::string *packed = call.request.mutable_packed_ids();
    packed->clear();
    for (int b = 0; b < args.batch; ++b) {
      const auto &row = ids[(call.next + b) % ids.size()];
      packed->append(reinterpret_cast<const char *>(row.data()), row.size() * 4);  // little-endian hosts
    }
    call.next += static_cast<std::size_t>(args.threads) * args.batch;
    call.ctx.reset(new grpc::ClientContext());
    call.ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    call.response.Clear();
    call.sent = Clock::now();
    call.rpc = call.stub->AsyncScoreNgrams(call.ctx.get(), call.request, &cq);
    call.rpc->Finish(&call.response, &call.status, reinterpret_cast<void *>(c));
  };
  for (int c = 0; c < args.threads; ++c) {
    grpc::ChannelArguments channel_args;
    channel_args.SetMaxReceiveMessageSize(-1);
    channel_args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a connection of its own
    channel_args.SetInt("nlmserve.load_client", c);
    auto channel = grpc::CreateCustomChannel(args.target, grpc::InsecureChannelCredentials(), channel_args);
    calls[c].stub = pb::LanguageModel::NewStub(channel);
    calls[c].request.set_packed_order(order);
    calls[c].request.set_log_base(pb::LOG10);
    calls[c].next = static_cast<std::size_t>(c) * args.batch;
  }
  for (int c = 0; c < args.threads; ++c) start_call(c);

  Result r;
  const auto t_begin = Clock::now();
  const auto t_measure = t_begin + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(args.warmup));
  const auto t_end = t_measure + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(args.seconds));
  int outstanding = args.threads;
  while (outstanding > 0) {
    void *tag = nullptr;
    bool ok = false;
    if (!cq.Next(&tag, &ok)) break;
    const auto now = Clock::now();
    Call &call = calls[reinterpret_cast<std::size_t>(tag)];
    if (now >= t_measure && now <= t_end) {  // answered inside the measured window
      if (ok && call.status.ok() && call.response.log_probs_size() == args.batch) {
        r.latencies.push_back(std::chrono::duration<double, std::milli>(now - call.sent).count());
      } else {
        ++r.failed;
      }
    }
    if (now < t_end) {
      start_call(reinterpret_cast<std::size_t>(tag));
    } else {
      --outstanding;
    }
  }
  r.elapsed = args.seconds;
  cq.Shutdown();
  void *tag;
  bool ok;
  while (cq.Next(&tag, &ok)) {
  }
  return r;
}

}  // namespace

int main(int argc, char **argv) {
  Args args = Parse(argc, argv);
  std::vector<std::vector<std::string> > words = ReadNgrams(args.ngram_file);
  nlmserve::ClientOptions options;
  options.cache_size = 0;
  nlmserve::Client vocabulary(args.target, options);  // fetches the id map once
  std::vector<std::vector<uint32_t> > ids = CanonicalRows(vocabulary, words);
  Result r = args.async ? RunAsync(args, vocabulary, ids) : RunThreads(args, ids);
  const uint64_t requests = r.latencies.size();
  std::printf(
      "{\"mode\": \"%s\", \"clients\": %d, \"batch\": %d, \"seconds\": %.3f, \"requests\": %llu, \"failed\": %llu, "
      "\"requests_per_s\": %.1f, \"ngrams_per_s\": %.1f, \"p50_ms\": %.3f, \"p90_ms\": %.3f, "
      "\"p99_ms\": %.3f}\n",
      args.async ? "async" : "threads", args.threads, args.batch, r.elapsed, static_cast<unsigned long long>(requests),
      static_cast<unsigned long long>(r.failed), requests / r.elapsed, requests * args.batch / r.elapsed,
      Percentile(r.latencies, 50), Percentile(r.latencies, 90), Percentile(r.latencies, 99));
  return r.failed == 0 ? 0 : 1;
}
