// nlmserve_load: a closed-loop load generator written against the C++ client library, the
// client a Moses decoder uses. N threads, each with its own Client (one channel each, the
// client-side cache off), send requests of B n-grams back to back for S seconds and
// report requests/s, n-grams/s and latency percentiles as one JSON line.
//
//   nlmserve_load TARGET NGRAM_FILE [--threads 32] [--batch 1] [--seconds 5] [--warmup 1]
//
// NGRAM_FILE: one n-gram per line, words separated by spaces (oldest first); words are
// mapped to ids once with the server's vocabulary, then sent as packed ids.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

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
};

Args Parse(int argc, char **argv) {
  if (argc < 3) {
    std::cerr << "usage: nlmserve_load TARGET NGRAM_FILE [--threads N] [--batch B] [--seconds S] [--warmup W]\n";
    std::exit(2);
  }
  Args a;
  a.target = argv[1];
  a.ngram_file = argv[2];
  for (int i = 3; i + 1 < argc; i += 2) {
    std::string flag = argv[i];
    const char *v = argv[i + 1];
    if (flag == "--threads") a.threads = std::atoi(v);
    else if (flag == "--batch") a.batch = std::atoi(v);
    else if (flag == "--seconds") a.seconds = std::atof(v);
    else if (flag == "--warmup") a.warmup = std::atof(v);
    else {
      std::cerr << "nlmserve_load: unknown flag " << flag << "\n";
      std::exit(2);
    }
  }
  if (a.threads < 1 || a.batch < 1 || a.seconds <= 0) {
    std::cerr << "nlmserve_load: --threads, --batch and --seconds must be positive\n";
    std::exit(2);
  }
  return a;
}

std::vector<std::vector<std::string> > ReadNgrams(const std::string &path) {
  std::ifstream in(path);
  if (!in) {
    std::cerr << "nlmserve_load: cannot read " << path << "\n";
    std::exit(2);
  }
  std::vector<std::vector<std::string> > out;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream words(line);
    std::vector<std::string> ngram;
    std::string w;
    while (words >> w) ngram.push_back(w);
    if (!ngram.empty()) out.push_back(ngram);
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

}  // namespace

int main(int argc, char **argv) {
  Args args = Parse(argc, argv);
  std::vector<std::vector<std::string> > words = ReadNgrams(args.ngram_file);
  nlmserve::ClientOptions options;
  options.cache_size = 0;  // every request reaches the server
  std::vector<std::unique_ptr<nlmserve::Client> > clients;
  for (int t = 0; t < args.threads; ++t) clients.emplace_back(new nlmserve::Client(args.target, options));
  std::vector<std::vector<uint32_t> > ids;
  for (const auto &ngram : words) {
    std::vector<uint32_t> row;
    for (const auto &w : ngram) row.push_back(clients[0]->WordId(w));
    ids.push_back(row);
  }

  std::atomic<bool> measuring(false), stop(false);
  std::vector<std::vector<double> > latencies(args.threads);
  std::vector<uint64_t> done(args.threads, 0), failed(args.threads, 0);
  std::vector<std::thread> pool;
  for (int t = 0; t < args.threads; ++t) {
    pool.emplace_back([&, t]() {
      std::size_t next = static_cast<std::size_t>(t) * args.batch;
      std::vector<std::vector<uint32_t> > batch(args.batch);
      while (!stop.load(std::memory_order_relaxed)) {
        for (int b = 0; b < args.batch; ++b) batch[b] = ids[(next + b) % ids.size()];
        next += static_cast<std::size_t>(args.threads) * args.batch;
        auto t0 = Clock::now();
        bool ok = true;
        try {
          clients[t]->ScoreBatch(batch);
        } catch (const nlmserve::ClientError &) {
          ok = false;
        }
        double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
        if (measuring.load(std::memory_order_relaxed)) {
          if (ok) {
            latencies[t].push_back(ms);
            ++done[t];
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
  double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  stop = true;
  for (auto &th : pool) th.join();

  std::vector<double> all;
  uint64_t requests = 0, failures = 0;
  for (int t = 0; t < args.threads; ++t) {
    all.insert(all.end(), latencies[t].begin(), latencies[t].end());
    requests += done[t];
    failures += failed[t];
  }
  std::printf(
      "{\"threads\": %d, \"batch\": %d, \"seconds\": %.3f, \"requests\": %llu, \"failed\": %llu, "
      "\"requests_per_s\": %.1f, \"ngrams_per_s\": %.1f, \"p50_ms\": %.3f, \"p90_ms\": %.3f, "
      "\"p99_ms\": %.3f}\n",
      args.threads, args.batch, elapsed, static_cast<unsigned long long>(requests),
      static_cast<unsigned long long>(failures), requests / elapsed, requests * args.batch / elapsed,
      Percentile(all, 50), Percentile(all, 90), Percentile(all, 99));
  return failures == 0 ? 0 : 1;
}
