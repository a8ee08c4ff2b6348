// nlmserve_tables_speed: the decoder's local scorer (nlmserve_tables.h, what the Moses feature's
// tables=FILE scores with) timed on a text's n-grams, from a tables file mapped as the feature
// maps it (MapTablesFile). bench/vocab_scale.py compiles it beside its run (header only, no
// gRPC: g++ -O3 -std=c++11 -I client/cpp) and runs it in interleaved rounds.
//
//   nlmserve_tables_speed FILE TEXT [PASSES]
//
// Maps FILE; turns TEXT (one tokenised sentence a line) into canonical rows through the file's
// vocabulary (each word's id as the feature gives it: lowercased first when the model is
// lowercased, <unk> when unknown; order-1 <s> before a sentence, </s> after it); then scores
// every row, one sentence's rows a call (the feature's calls are a phrase's or a hypothesis'
// few rows), 1 + PASSES times (default 5), each pass with a new Scratch (nothing remembered
// from the pass before; sized by scoring the first row before the clock starts). The first
// pass reads each page of the tables for the first time in this process, the others find
// them mapped. Prints one JSON line: the seconds MapTablesFile took; ns per word looked up
// (every word of TEXT, twice: the first time also faults the vocabulary's pages in); ns per
// row of the first pass and of each later pass; the rows the Scratch answered from memory
// and the position rows it summed in the last pass; a checksum of the first pass's scores.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "nlmserve_tables_file.h"

namespace {

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

}  // namespace

int main(int argc, char **argv) {
  if (argc < 3 || argc > 4) {
    std::fprintf(stderr, "usage: %s FILE TEXT [PASSES]\n", argv[0]);
    return 2;
  }
  const int passes = argc == 4 ? std::atoi(argv[3]) : 5;
  std::ifstream text(argv[2]);
  if (!text) {
    std::fprintf(stderr, "%s: cannot be read\n", argv[2]);
    return 1;
  }
  std::vector<std::vector<std::string> > sentences;
  std::size_t words = 0;
  for (std::string line; std::getline(text, line);) {
    std::istringstream in(line);
    sentences.push_back(std::vector<std::string>());
    for (std::string w; in >> w;) sentences.back().push_back(w);
    words += sentences.back().size();
  }

  nlmserve::TablesFile file;
  std::string error;
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  if (!nlmserve::MapTablesFile(argv[1], &file, &error)) {
    std::fprintf(stderr, "%s\n", error.c_str());
    return 1;
  }
  const double map_s = Seconds(start);
  const uint32_t order = file.info.order;

  // Every sentence's rows, one after the other; calls[k] is where sentence k's rows end.
  std::vector<uint32_t> ids;
  ids.reserve(words + sentences.size());
  // Twice: the first time also faults the vocabulary's pages into this process.
  std::vector<std::vector<uint32_t> > sentence_ids;
  double lookup_s[2];
  for (int time = 0; time < 2; ++time) {
    sentence_ids.assign(sentences.size(), std::vector<uint32_t>());
    start = std::chrono::steady_clock::now();
    for (std::size_t k = 0; k < sentences.size(); ++k) {
      for (std::size_t i = 0; i < sentences[k].size(); ++i) {
        sentence_ids[k].push_back(file.vocabulary.Id(sentences[k][i]));
      }
    }
    lookup_s[time] = Seconds(start);
  }
  std::size_t unknown = 0;
  std::vector<uint32_t> rows;
  std::vector<std::size_t> calls;
  for (std::size_t k = 0; k < sentence_ids.size(); ++k) {
    std::vector<uint32_t> history(order - 1, file.info.bos_id);
    for (std::size_t i = 0; i < sentence_ids[k].size(); ++i) {
      if (sentence_ids[k][i] == file.info.unk_id) ++unknown;
      history.push_back(sentence_ids[k][i]);
    }
    history.push_back(file.info.eos_id);
    for (std::size_t t = 0; t + order <= history.size(); ++t) rows.insert(rows.end(), &history[t], &history[t] + order);
    calls.push_back(rows.size() / order);
  }
  const std::size_t n = rows.size() / order;
  std::vector<float> scores(n);

  std::vector<double> ns;
  double checksum = 0;
  std::size_t remembered = 0, added = 0;
  for (int pass = 0; pass <= passes; ++pass) {
    nlmserve::ScoringTables::Scratch scratch;
    float one;
    file.tables->Score(&rows[0], 1, &one, &scratch);  // sizes the scratch (a few MB) before the clock starts
    start = std::chrono::steady_clock::now();
    std::size_t from = 0;
    for (std::size_t k = 0; k < calls.size(); ++k) {
      file.tables->Score(&rows[from * order], calls[k] - from, &scores[from], &scratch);
      from = calls[k];
    }
    ns.push_back(1e9 * Seconds(start) / static_cast<double>(n));
    remembered = static_cast<std::size_t>(scratch.rows_remembered);
    added = static_cast<std::size_t>(scratch.rows_added);
    if (pass == 0) {
      for (std::size_t i = 0; i < n; ++i) checksum += scores[i];
    }
  }

  std::printf("{\"map_s\": %.6f, \"first_lookup_ns_per_word\": %.2f, \"lookup_ns_per_word\": %.2f, "
              "\"words\": %zu, \"unknown\": %zu, \"rows\": %zu, \"calls\": %zu, \"first_ns_per_row\": %.2f, "
              "\"ns_per_row\": [",
              map_s, 1e9 * lookup_s[0] / static_cast<double>(words ? words : 1),
              1e9 * lookup_s[1] / static_cast<double>(words ? words : 1), words, unknown, n, calls.size(), ns[0]);
  for (std::size_t i = 1; i < ns.size(); ++i) std::printf("%s%.2f", i > 1 ? ", " : "", ns[i]);
  std::printf("], \"remembered_last_pass\": %zu, \"position_rows_last_pass\": %zu, \"vocab_size\": %u, "
              "\"dim\": %u, \"order\": %u, \"quantization\": \"%s\", \"tables_bytes\": %zu, \"checksum\": %.6f}\n",
              remembered, added, file.info.vocab_size, file.info.dim, order,
              nlmserve::QuantizationName(file.info.quantization), file.tables->bytes(), checksum);
  return 0;
}
