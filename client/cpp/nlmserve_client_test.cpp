// Test driver for the nlmserve C++ client against a server (the parts that need no
// server: nlmserve_unit_test).
//
//   nlmserve_client_test TARGET [--deadline-ms N] [--connect-timeout-ms N] [--retries N]
//                        [--cache-size N] [--lowercase] [--unnormalized]
//                        [--tls-ca PEM] [--tls-cert PEM] [--tls-key PEM]
//                        [--tls-server-name NAME] [--token-file FILE]
//       TARGET: HOST:PORT, a replica list A:1,B:2, or dns:///NAME:PORT.
//       connects, then reads one command per line on stdin and answers one block per
//       command on stdout (a driver such as tests/test_cpp_client.py talks to it):
//         info                      -> ok order=.. vocab=.. hash=.. bos=.. eos=.. unk=..
//         score W1 .. Wn            -> ok SCORE            (log10, %.9g)
//         ids I1 .. In              -> ok SCORE
//         row W1 .. Wn              -> ok I1 .. I_order   (the canonical row the client sends)
//         raw I1 .. In              -> ok SCORE           (the ids as one row, straight to ScoreRows)
//         phrase W1 .. Wn           -> ok N, then N lines "I1 .. I_order LOCAL SERVED": the rows
//                                      PhraseRows makes of a target phrase, their natural-log
//                                      score from GetScoringTables and their score from the server
//         file PATH                 -> ok N, then N lines of scores (one batch, one n-gram a line)
//         rows PATH                 -> ok N hits=.. misses=.. sent=.. round_trips=.., then N lines of
//                                      scores: the same n-grams as canonical rows in one flat
//                                      ScoreRows call, with the BatchCounts it returned
//         tables PATH [FILE]        -> ok N dim=.. bytes=.. hash=.. differ=.. normalized=0|1 mapped=0|1,
//                                      then N lines (FILE: a tables file mapped, not fetched tables)
//                                      of natural-log scores computed from GetScoringTables in this
//                                      process, self-normalised (0) or a tree's exact ones (1)
//                                      (differ: scores that change when asked one by one in reverse
//                                      order, which must be 0)
//         threads T PATH REPEATS    -> ok mismatches=.. far=.. max_diff=.. errors=.. calls=..
//                                      (mismatches: answers not bit-equal to the reference;
//                                       far: answers more than 1e-5 from it)
//         stats                     -> ok hits=.. misses=.. round_trips=.. failed=.. reconnects=.. entries=..
//         clear | reset             -> ok   (empty the cache | zero the counters)
//         quit
//       Any failure of a command prints "error CODE MESSAGE" and the driver goes on.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>
#include <algorithm>
#include <atomic>

#include "nlmserve_client.h"
#include "nlmserve_decoder.h"

namespace {

typedef std::vector<std::vector<std::string> > StringNgrams;

// The n-grams of a file (one per line, words) as the canonical rows the client sends.
std::vector<uint32_t> FileRows(const nlmserve::Client &client, const std::string &path, StringNgrams *ngrams) {
  if (!nlmserve::ReadNgramFile(path, ngrams)) throw nlmserve::ClientError(-1, "cannot read " + path);
  const std::size_t width = client.info().order;
  std::vector<uint32_t> rows(ngrams->size() * width), ids;
  for (std::size_t i = 0; i < ngrams->size(); ++i) {
    ids.clear();
    for (const std::string &w : (*ngrams)[i]) ids.push_back(client.WordId(w));
    client.CanonicalRow(ids.data(), ids.size(), rows.data() + i * width, i);
  }
  return rows;
}

// T threads score the n-grams REPEATS times each, in their own order and batch
// sizes, and compare every answer with a single-threaded reference.
std::string Threads(nlmserve::Client &client, int threads, const StringNgrams &ngrams, int repeats) {
  std::vector<float> reference = client.ScoreStrings(ngrams);
  std::atomic<long> mismatches(0), far(0), errors(0), calls(0);
  std::mutex max_mutex;
  double max_diff = 0.0;
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t]() {
      std::mt19937 rng(1234 + t);
      for (int r = 0; r < repeats; ++r) {
        std::vector<std::size_t> order(ngrams.size());
        for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
        std::shuffle(order.begin(), order.end(), rng);
        std::size_t batch = 1 + (rng() % 16);
        for (std::size_t b = 0; b < order.size(); b += batch) {
          StringNgrams part;
          std::vector<std::size_t> pos;
          for (std::size_t i = b; i < std::min(order.size(), b + batch); ++i) {
            part.push_back(ngrams[order[i]]);
            pos.push_back(order[i]);
          }
          try {
            std::vector<float> got = client.ScoreStrings(part);
            calls.fetch_add(1);
            for (std::size_t i = 0; i < got.size(); ++i) {
              if (!(got[i] == reference[pos[i]])) mismatches.fetch_add(1);
              double d = std::fabs(static_cast<double>(got[i]) - reference[pos[i]]);
              if (!(d <= 1e-5)) far.fetch_add(1);
              std::lock_guard<std::mutex> lock(max_mutex);
              if (d > max_diff) max_diff = d;
            }
          } catch (const nlmserve::ClientError &) {
            errors.fetch_add(1);
          }
        }
        if (r % 2 == 1 && t == 0) client.ClearCache();  // make later rounds ask the server again
      }
    });
  }
  for (auto &th : pool) th.join();
  std::ostringstream out;
  out << "ok mismatches=" << mismatches.load() << " far=" << far.load() << " max_diff=" << max_diff
      << " errors=" << errors.load() << " calls=" << calls.load();
  return out.str();
}

std::string Fmt(float v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.9g", static_cast<double>(v));
  return buf;
}

void Run(nlmserve::Client &client) {
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    if (!(in >> cmd)) continue;
    if (cmd == "quit") break;
    try {
      if (cmd == "info") {
        const nlmserve::ModelInfo &m = client.info();
        std::cout << "ok order=" << m.order << " vocab=" << m.vocab_size << " hash=" << m.model_hash
                  << " bos=" << m.bos_id << " eos=" << m.eos_id << " unk=" << m.unk_id << "\n";
      } else if (cmd == "score") {
        std::vector<std::string> words;
        std::string w;
        while (in >> w) words.push_back(w);
        float score = client.ScoreStrings(StringNgrams(1, words))[0];
        std::cout << "ok " << Fmt(score) << "\n";
      } else if (cmd == "ids") {
        std::vector<uint32_t> ids;
        unsigned long id;
        while (in >> id) ids.push_back(static_cast<uint32_t>(id));
        float score = client.Score(ids);
        std::cout << "ok " << Fmt(score) << "\n";
      } else if (cmd == "raw") {
        std::vector<uint32_t> row;
        unsigned long id;
        while (in >> id) row.push_back(static_cast<uint32_t>(id));
        float score = 0.0f;
        client.ScoreRows(row.data(), 1, row.size(), &score);
        std::cout << "ok " << Fmt(score) << "\n";
      } else if (cmd == "phrase") {
        // The rows the Moses feature scores for a target phrase on its own (PhraseRows: the
        // words before it are the no-word), scored by the tables here and by the server.
        std::vector<uint32_t> ids, rows;
        std::string w;
        while (in >> w) ids.push_back(client.WordId(w));
        std::size_t position = 0;
        const nlmserve::NgramError error =
            nlmserve::PhraseRows(client.info(), ids.data(), ids.size(), &rows, nullptr, nullptr, &position);
        if (error != nlmserve::NgramError::kNone) throw nlmserve::ClientError(3, "phrase rows failed");
        const std::size_t width = client.info().order, n = rows.size() / width;
        std::vector<float> local(n), served(n);
        nlmserve::ScoringTables::Scratch scratch;
        client.GetScoringTables()->Score(rows.data(), n, local.data(), &scratch);
        client.ScoreRows(rows.data(), n, width, served.data());
        std::ostringstream out;
        out << "ok " << n << "\n";
        for (std::size_t i = 0; i < n; ++i) {
          for (std::size_t j = 0; j < width; ++j) out << rows[i * width + j] << " ";
          out << Fmt(local[i]) << " " << Fmt(served[i]) << "\n";
        }
        std::cout << out.str();
      } else if (cmd == "row") {
        std::vector<uint32_t> ids;
        std::string w;
        while (in >> w) ids.push_back(client.WordId(w));
        std::ostringstream out;
        out << "ok";
        for (uint32_t id : client.CanonicalRow(ids)) out << " " << id;
        std::cout << out.str() << "\n";
      } else if (cmd == "file") {
        std::string path;
        in >> path;
        StringNgrams ngrams;
        if (!nlmserve::ReadNgramFile(path, &ngrams)) throw nlmserve::ClientError(-1, "cannot read " + path);
        std::vector<float> scores = client.ScoreStrings(ngrams);
        std::ostringstream out;
        out << "ok " << scores.size() << "\n";
        for (float s : scores) out << Fmt(s) << "\n";
        std::cout << out.str();
      } else if (cmd == "tables") {
        std::string path, file;
        in >> path >> file;  // FILE: a tables file to map instead of fetching the tables
        const std::size_t width = client.info().order;
        StringNgrams ngrams;
        const std::vector<uint32_t> rows = FileRows(client, path, &ngrams);
        std::shared_ptr<const nlmserve::ScoringTables> tables;
        std::string error;
        if (file.empty()) {
          tables = client.GetScoringTables();
        } else if (!nlmserve::MapTablesFile(file, &tables, &error)) {
          throw nlmserve::ClientError(-1, error);
        }
        // Twice, in two orders: the context vectors the scratch keeps must not change a score.
        std::vector<float> scores(ngrams.size()), again(ngrams.size());
        nlmserve::ScoringTables::Scratch scratch;
        tables->Score(rows.data(), ngrams.size(), scores.data(), &scratch);
        for (std::size_t i = ngrams.size(); i-- > 0;) tables->Score(rows.data() + i * width, 1, &again[i], &scratch);
        std::size_t differ = 0;
        for (std::size_t i = 0; i < scores.size(); ++i) differ += scores[i] != again[i];
        std::ostringstream out;
        out << "ok " << scores.size() << " dim=" << tables->dim() << " bytes=" << tables->bytes()
            << " hash=" << tables->model_hash() << " differ=" << differ
            << " normalized=" << tables->normalized() << " mapped=" << tables->mapped() << "\n";
        for (float s : scores) out << Fmt(s) << "\n";
        std::cout << out.str();
      } else if (cmd == "rows") {
        std::string path;
        in >> path;
        const std::size_t width = client.info().order;
        StringNgrams ngrams;
        const std::vector<uint32_t> rows = FileRows(client, path, &ngrams);
        std::vector<float> scores(ngrams.size());
        nlmserve::BatchCounts counts;
        client.ScoreRows(rows.data(), ngrams.size(), width, scores.data(), &counts);
        std::ostringstream out;
        out << "ok " << scores.size() << " hits=" << counts.cache_hits << " misses=" << counts.cache_misses
            << " sent=" << counts.ngrams_sent << " round_trips=" << counts.round_trips << "\n";
        for (float s : scores) out << Fmt(s) << "\n";
        std::cout << out.str();
      } else if (cmd == "threads") {
        int threads = 0, repeats = 0;
        std::string path;
        in >> threads >> path >> repeats;
        StringNgrams ngrams;
        if (!nlmserve::ReadNgramFile(path, &ngrams)) throw nlmserve::ClientError(-1, "cannot read " + path);
        std::cout << Threads(client, threads, ngrams, repeats) << "\n";
      } else if (cmd == "stats") {
        nlmserve::ClientStats s = client.stats();
        std::cout << "ok hits=" << s.cache_hits << " misses=" << s.cache_misses
                  << " round_trips=" << s.round_trips << " failed=" << s.failed_calls
                  << " reconnects=" << s.reconnects << " sent=" << s.ngrams_sent
                  << " entries=" << client.CacheEntries() << "\n";
      } else if (cmd == "clear") {
        client.ClearCache();
        std::cout << "ok\n";
      } else if (cmd == "reset") {
        client.ResetStats();
        std::cout << "ok\n";
      } else {
        std::cout << "error -1 unknown command " << cmd << "\n";
      }
    } catch (const nlmserve::ClientError &e) {
      std::cout << "error " << e.code() << " " << e.what() << "\n";
    }
    std::cout.flush();
  }
}

}  // namespace

int main(int argc, char **argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s TARGET [options]\n", argv[0]);
    return 2;
  }
  nlmserve::ClientOptions opts;
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> long {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return std::atol(argv[++i]);
    };
    auto text = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--deadline-ms") opts.deadline_ms = static_cast<int>(next());
    else if (a == "--connect-timeout-ms") opts.connect_timeout_ms = static_cast<int>(next());
    else if (a == "--retries") opts.retries = static_cast<int>(next());
    else if (a == "--cache-size") opts.cache_size = static_cast<std::size_t>(next());
    else if (a == "--lowercase") opts.lowercase = true;
    else if (a == "--unnormalized") opts.normalized = false;
    else if (a == "--tls-ca") opts.tls_ca = text();
    else if (a == "--tls-cert") opts.tls_cert = text();
    else if (a == "--tls-key") opts.tls_key = text();
    else if (a == "--tls-server-name") opts.tls_server_name = text();
    else if (a == "--token-file") opts.token_file = text();
    else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  try {
    nlmserve::Client client(argv[1], opts);
    std::cout << "ready\n";
    std::cout.flush();
    Run(client);
  } catch (const nlmserve::ClientError &e) {
    std::cout << "error " << e.code() << " " << e.what() << "\n";
    return 1;
  }
  return 0;
}
