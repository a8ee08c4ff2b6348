// Tests of the Moses feature's Moses-free parts (nlmserve_decoder.h): the n-gram rows of a
// phrase and of a phrase boundary (hand-computed), the word-id table, the expansion scores,
// the error pause, the order= rule, and where the feature finds its model (a tables file, a
// server, or both: nlmserve_moses_ini.h's SourceError). No Moses, no server: built by client/cpp's CMake project from this folder
// and run by tests/test_cpp_client.py.
//
//   nlmserve_decoder_test
//       prints "decoder: N passed, 0 failed" (exit 1 on a failure, each named on stderr).
#include <atomic>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "nlmserve_client.h"
#include "nlmserve_decoder.h"
#include "nlmserve_moses_ini.h"

namespace {

int g_passed = 0;
int g_failed = 0;

void Check(bool ok, const char *what) {
  if (ok) {
    ++g_passed;
  } else {
    ++g_failed;
    std::fprintf(stderr, "decoder FAILED: %s\n", what);
  }
}

typedef std::vector<uint32_t> Row;

nlmserve::ModelInfo Model(uint32_t order, uint32_t vocab_size) {
  nlmserve::ModelInfo m;  // <unk> 0, <s> 1, </s> 2 by default
  m.order = order;
  m.vocab_size = vocab_size;
  return m;
}

void TestPhraseRows() {
  using nlmserve::kNonTerminal;
  const nlmserve::ModelInfo m = Model(3, 50);
  std::vector<uint32_t> rows;
  std::vector<uint8_t> complete;
  std::size_t unknown = 0, position = 99;
  const Row plain = {5, 0, 7, 8};
  Check(nlmserve::PhraseRows(m, plain.data(), plain.size(), &rows, &complete, &unknown, &position) ==
                nlmserve::NgramError::kNone &&
            rows == Row({50, 50, 5, 50, 5, 0, 5, 0, 7, 0, 7, 8}) && complete == std::vector<uint8_t>({0, 0, 1, 1}) &&
            unknown == 1,
        "phrase rows: growing context (the words before the phrase: the no-word, id 50), full n-grams "
        "complete, <unk> counted");
  rows.clear();
  complete.clear();
  const Row starts = {1, 5, 6};
  Check(nlmserve::PhraseRows(m, starts.data(), starts.size(), &rows, &complete, nullptr, &position) ==
                nlmserve::NgramError::kNone &&
            rows == Row({1, 1, 5, 1, 5, 6}) && complete == std::vector<uint8_t>({0, 1}),
        "phrase rows: <s> at position 0 is context, counted in the n-gram's length");
  rows.clear();
  const Row gap = {5, kNonTerminal, 6, 7};
  Check(nlmserve::PhraseRows(m, gap.data(), gap.size(), &rows, nullptr, nullptr, &position) ==
                nlmserve::NgramError::kNone &&
            rows == Row({50, 50, 5, 50, 50, 6, 50, 6, 7}),
        "phrase rows: a non-terminal resets the context (to no-words)");
  rows.clear();
  const Row inner = {5, 1, 6};
  Check(nlmserve::PhraseRows(m, inner.data(), inner.size(), &rows, nullptr, nullptr, &position) ==
                nlmserve::NgramError::kBosTarget &&
            position == 1 && rows == Row({50, 50, 5}),
        "phrase rows: <s> inside a phrase is an error at its position");
}

void TestBoundaryRows() {
  const nlmserve::ModelInfo m = Model(3, 50);
  std::vector<uint32_t> rows;
  const Row after = {8, 9, 5, 6, 7};  // context 8 9, phrase 5 6 7
  Check(nlmserve::BoundaryRows(m, after.data(), 2, after.size(), true, &rows) == nlmserve::NgramError::kNone &&
            rows == Row({8, 9, 5, 9, 5, 6, 6, 7, 2}),
        "boundary rows: the first order-1 words of the phrase, then </s>");
  rows.clear();
  const Row first = {5};  // the first phrase of a sentence
  Check(nlmserve::BoundaryRows(m, first.data(), 0, 1, true, &rows) == nlmserve::NgramError::kNone &&
            rows == Row({1, 1, 5, 1, 5, 2}),
        "boundary rows: sentence start padded with <s>");
  rows.clear();
  const Row short_context = {9, 5, 6};
  Check(nlmserve::BoundaryRows(m, short_context.data(), 1, 3, false, &rows) == nlmserve::NgramError::kNone &&
            rows == Row({1, 9, 5, 9, 5, 6}),
        "boundary rows: no </s> unless the sentence completes");
  const Row empty = {8, 9};
  Check(nlmserve::BoundaryRows(m, empty.data(), 2, 2, true, &rows) == nlmserve::NgramError::kNone &&
            rows == Row({1, 9, 5, 9, 5, 6}),
        "boundary rows: an empty phrase adds none, not even </s>");
  rows.clear();
  const Row bad = {9, 50};
  Check(nlmserve::BoundaryRows(m, bad.data(), 1, 2, false, &rows) == nlmserve::NgramError::kOutOfRange && rows.empty(),
        "boundary rows: an id outside the vocabulary is an error");
  // The window path (a full context of plain words) against CanonicalRow row by row, on
  // random words that include <s>, </s>, <unk>, the no-word and ids out of range.
  std::mt19937 rng(7);
  int differ = 0, windows = 0;
  for (int trial = 0; trial < 4000; ++trial) {
    const nlmserve::ModelInfo r = Model(2 + rng() % 5, 12);
    const std::size_t context = rng() % r.order, n = context + rng() % 6;
    Row words(n);
    for (std::size_t i = 0; i < n; ++i) words[i] = rng() % 4 == 0 ? rng() % 14 : 3 + rng() % 9;
    const bool completes = rng() % 2 == 0;
    Row got, want;
    const nlmserve::NgramError error = nlmserve::BoundaryRows(r, words.data(), context, n, completes, &got);
    nlmserve::NgramError expected = nlmserve::NgramError::kNone;
    const std::size_t predicted = n > context ? std::min<std::size_t>(r.order - 1, n - context) : 0;
    for (std::size_t pos = context; pos < context + predicted && expected == nlmserve::NgramError::kNone; ++pos) {
      const std::size_t start = pos + 1 > r.order ? pos + 1 - r.order : 0;
      Row row(r.order);
      expected = nlmserve::CanonicalRow(words.data() + start, pos + 1 - start, r, row.data());
      if (expected == nlmserve::NgramError::kNone) want.insert(want.end(), row.begin(), row.end());
    }
    if (expected == nlmserve::NgramError::kNone && completes && n > context) {
      Row row(r.order);
      nlmserve::CanonicalContext(words.data(), n, r.order - 1, r.bos_id, row.data());
      row[r.order - 1] = r.eos_id;
      want.insert(want.end(), row.begin(), row.end());
    }
    if (context == r.order - 1 && nlmserve::PlainWords(words.data(), n, r)) ++windows;
    if (error != expected || (error == nlmserve::NgramError::kNone && got != want)) ++differ;
  }
  Check(differ == 0 && windows > 500, "boundary rows: the window path gives CanonicalRow's rows");
  const float parts[] = {-0.25f, -1.5f, -0.125f};
  Check(nlmserve::SumScores(parts, 3) == -1.875f && nlmserve::SumScores(parts, 0) == 0.0f, "scores summed");
}

void TestDenseIdMap() {
  nlmserve::DenseIdMap map;
  int computed = 0;
  auto triple = [&computed](std::size_t key) {
    ++computed;
    return static_cast<uint32_t>(3 * key);
  };
  Check(map.Get(7, triple) == 21 && map.Get(7, triple) == 21 && computed == 1, "an id is computed once per key");
  Check(map.Get(0, triple) == 0 && map.Get(0, triple) == 0 && computed == 2, "id 0 is stored too");
  map.Set(9000, 1);
  Check(map.Get(9000, triple) == 1 && computed == 2, "Set fixes an id");
  const std::size_t beyond = nlmserve::DenseIdMap::kChunks * nlmserve::DenseIdMap::kChunkSize;
  map.Get(beyond, triple);
  map.Get(beyond, triple);
  Check(computed == 4, "keys beyond the table are computed each time");
  // Four threads fill one table at once: every answer right.
  nlmserve::DenseIdMap shared;
  std::atomic<int> wrong(0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&shared, &wrong, t]() {
      std::mt19937 rng(7 + t);
      for (int i = 0; i < 50000; ++i) {
        const std::size_t key = rng() % 100000;
        if (shared.Get(key, [](std::size_t k) { return static_cast<uint32_t>(k * 5 + 1); }) != key * 5 + 1) {
          wrong.fetch_add(1);
        }
      }
    });
  }
  for (std::size_t t = 0; t < threads.size(); ++t) threads[t].join();
  Check(wrong.load() == 0, "concurrent lookups and fills agree");
}

void TestPairScores() {
  nlmserve::PairScores scores;
  int a[2000] = {0};  // only the addresses are keys
  float s = 1.0f;
  Check(!scores.Get(&a[0], &a[1], &s), "an empty table misses");
  scores.Put(&a[0], &a[1], -1.0f);
  scores.Put(&a[1], &a[0], 0.0f);
  Check(scores.Get(&a[0], &a[1], &s) && s == -1.0f && scores.Get(&a[1], &a[0], &s) && s == 0.0f,
        "pairs are ordered keys; 0.0 is a value");
  scores.Put(&a[0], &a[1], -2.0f);
  Check(scores.Get(&a[0], &a[1], &s) && s == -2.0f && scores.size() == 2, "a second Put replaces");
  for (int i = 0; i < 2000; ++i) scores.Put(&a[i], &a[(i * 7) % 2000], static_cast<float>(-i));
  bool all = true;
  for (int i = 0; i < 2000; ++i) {
    if (!scores.Get(&a[i], &a[(i * 7) % 2000], &s) || s != static_cast<float>(-i)) all = false;
  }
  Check(all && scores.size() == 2002, "the table grows and keeps every pair");
  scores.Clear();
  Check(scores.size() == 0 && !scores.Get(&a[5], &a[35], &s) && !scores.Get(&a[1], &a[0], &s), "clear forgets all");
  scores.Put(&a[5], &a[35], -5.0f);
  Check(scores.Get(&a[5], &a[35], &s) && s == -5.0f && !scores.Get(&a[6], &a[42], &s), "usable after clear");
}

void TestExpansionScores() {
  typedef nlmserve::ExpansionScores E;
  E scores;
  int h[4] = {0}, o[6] = {0};  // only the addresses are keys: hypotheses and options
  float s = 1.0f;
  Check(!scores.Next(&h[0], &o[0], &s) && scores.Get(&h[0], &o[0], &s) == E::kNotFound && s == 1.0f,
        "no expansions: nothing found");
  for (int i = 0; i < 4; ++i) {
    for (int j = 0; j < 6; ++j) scores.Add(&h[i], &o[j], -static_cast<float>(10 * i + j));
  }
  bool in_order = true;
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 6; ++j) {
      in_order = in_order && scores.Get(&h[i], &o[j], &s) == E::kInOrder && s == -static_cast<float>(10 * i + j);
    }
  }
  Check(in_order, "expansions asked for in the order added come from the cursor");
  // h[2]'s expansions skipped up to o[4] (early discarding): one lookup, then in order again.
  Check(scores.Get(&h[2], &o[4], &s) == E::kLookedUp && s == -24.0f, "a skip is looked up");
  Check(scores.Next(&h[2], &o[5], &s) && s == -25.0f && scores.Get(&h[3], &o[0], &s) == E::kInOrder && s == -30.0f,
        "the cursor resumes after the entry looked up");
  Check(scores.Get(&h[0], &o[3], &s) == E::kLookedUp && s == -3.0f, "an earlier expansion is looked up");
  Check(!scores.Next(&h[3], &o[2], &s) && scores.Get(&h[3], &o[2], &s) == E::kLookedUp && s == -32.0f,
        "Next looks no further than the cursor");
  s = 1.0f;
  Check(scores.Get(&o[0], &h[0], &s) == E::kNotFound && s == 1.0f, "pairs are ordered keys");
  scores.Clear();
  Check(scores.size() == 0 && scores.Get(&h[0], &o[0], &s) == E::kNotFound, "clear forgets all");
  scores.Add(&h[1], &o[1], 0.0f);
  Check(scores.Get(&h[1], &o[1], &s) == E::kInOrder && s == 0.0f, "usable after clear; 0.0 is a score");
  scores.Clear();
  scores.Add(&h[1], &o[1], -1.0f);
  Check(scores.Get(&h[0], &o[0], &s) == E::kNotFound && scores.Get(&h[1], &o[1], &s) == E::kInOrder && s == -1.0f,
        "the lookup table of an earlier prefetch is rebuilt");
  nlmserve::PairMap<uint32_t> index;
  index.Reserve(1000);
  for (uint32_t i = 0; i < 1000; ++i) index.Put(&h[i % 4], &o[i % 6], i);
  uint32_t v = 0;
  Check(index.size() == 12 && index.Get(&h[3], &o[5], &v) && v == 995, "PairMap of indices: the last Put wins");
}

void TestErrorPause() {
  nlmserve::ErrorPause pause;
  Check(!pause.Paused(0), "no pause before a failure");
  Check(pause.Failed(10000) == 1000 && pause.Paused(10999) && !pause.Paused(11000), "first pause 1 s");
  bool doubling = pause.Failed(11000) == 2000 && pause.Failed(13000) == 4000 && pause.Failed(17000) == 8000 &&
                  pause.Failed(25000) == 16000 && pause.Failed(41000) == 32000 && pause.Failed(73000) == 60000 &&
                  pause.Failed(133000) == 60000;
  Check(doubling && pause.Paused(192999) && !pause.Paused(193000), "pauses double up to 60 s");
  pause.Succeeded();
  Check(pause.Failed(200000) == 1000, "an answer resets the doubling");
  nlmserve::PrefetchMark mark;
  int x, y;
  Check(mark.Renew(&x, 1) && !mark.Renew(&x, 1) && mark.Renew(&x, 2) && mark.Renew(&y, 2) && !mark.Renew(&y, 2),
        "a prefetch is renewed for a new key or a new sentence");
}

void TestOrderMismatch() {
  Check(nlmserve::OrderMismatch(5, 5, "127.0.0.1:50051").empty(), "equal orders are accepted");
  Check(nlmserve::OrderMismatch(5, 10, "127.0.0.1:50051") ==
            "order=5 but the model at 127.0.0.1:50051 has order 10: write order=10 "
            "(`nlmserve moses-ini --model MODEL` prints the whole line)",
        "a shorter order is refused, saying the model's");
  Check(!nlmserve::OrderMismatch(6, 5, "h:1").empty(), "a longer order is refused");
}

// A tables file's vocabulary of `words` (ids in order) laid out as the file lays it out: the
// words' bytes, their starts, and a probing table of 16-byte buckets (key, id).
struct HandVocabulary {
  std::string bytes;
  std::vector<uint32_t> starts;
  std::vector<unsigned char> table;
  nlmserve::TablesVocabulary Make(const std::vector<std::string> &words, bool lowercase) {
    const uint32_t buckets = static_cast<uint32_t>(nlmserve::tables_file::BucketCount(words.size()));
    unsigned bits = 0;
    while ((1u << bits) < buckets) ++bits;
    table.assign(std::size_t(buckets) * 16, 0xff);
    for (uint32_t i = 0; i < words.size(); ++i) {
      starts.push_back(static_cast<uint32_t>(bytes.size()));
      bytes += words[i];
      const uint64_t key = nlmserve::TablesFileKey(words[i].data(), words[i].size());
      uint64_t b = (key * 0x9e3779b97f4a7c15ULL) >> (64 - bits);
      uint32_t empty;
      for (;; b = (b + 1) & (buckets - 1)) {
        std::memcpy(&empty, &table[b * 16 + 8], 4);
        if (empty == 0xffffffffu) break;
      }
      std::memcpy(&table[b * 16], &key, 8);
      std::memcpy(&table[b * 16 + 8], &i, 4);
    }
    starts.push_back(static_cast<uint32_t>(bytes.size()));
    return nlmserve::TablesVocabulary(bytes.data(), bytes.size(), starts.data(), static_cast<uint32_t>(words.size()),
                                      table.data(), buckets, lowercase, 0, nullptr);
  }
};

void TestFeatureSources() {
  Check(nlmserve::SourceError("", "/m.nlt", false).empty(), "tables= alone: no server needed");
  Check(nlmserve::SourceError("127.0.0.1:1", "", true).empty(), "path= alone, scoring=server");
  Check(nlmserve::SourceError("127.0.0.1:1", "/m.nlt", false).empty(), "path= and tables=: the file checked");
  Check(nlmserve::SourceError("", "", false).find("needs tables=FILE") == 0, "neither: refused, naming both");
  Check(nlmserve::SourceError("", "/m.nlt", true) == "tables=FILE scores in the decoder: drop scoring=server",
        "tables= with scoring=server: refused");
  nlmserve::TablesFileInfo file;
  file.order = 5;
  file.vocab_size = 100;
  file.bos_id = 4;
  file.eos_id = 5;
  file.unk_id = 3;
  file.lowercase = true;
  file.model_hash = "abc";
  const nlmserve::ModelInfo info = nlmserve::ModelInfoOf(file);
  Check(info.order == 5 && info.vocab_size == 100 && info.bos_id == 4 && info.eos_id == 5 && info.unk_id == 3 &&
            info.lowercase && info.model_hash == "abc" && info.self_normalized,
        "a file's facts are what GetModelInfo gives (a class output: self-normalised)");
  Check(nlmserve::TablesMismatch(file, info, "m.nlt", "h:1").empty(), "the served model of the file: accepted");
  nlmserve::ModelInfo other = info;
  other.model_hash = "def";
  Check(nlmserve::TablesMismatch(file, other, "m.nlt", "h:1") ==
            "tables=m.nlt holds model abc (order 5, 100 words), but h:1 serves model def (order 5, 100 words): "
            "write the file with `nlmserve export-tables --model` of the served model, or drop path= (the file "
            "needs no server)",
        "another hash: refused, naming both models");
  other = info;
  other.order = 4;
  Check(!nlmserve::TablesMismatch(file, other, "m.nlt", "h:1").empty(), "another order: refused");
  HandVocabulary exact, lower;
  const std::vector<std::string> words = {"<unk>", "<s>", "</s>", "paris", "Rome"};
  const nlmserve::TablesVocabulary cased = exact.Make(words, false), lowered = lower.Make(words, true);
  Check(nlmserve::FileWordId(cased, "paris", false) == 3 && nlmserve::FileWordId(cased, "Rome", false) == 4,
        "a word of the file's vocabulary: its id");
  Check(nlmserve::FileWordId(cased, "PARIS", false) == 0 && nlmserve::FileWordId(cased, "Lyon", false) == 0,
        "any other word: <unk>");
  Check(nlmserve::FileWordId(cased, "PARIS", true) == 3 && nlmserve::FileWordId(cased, "Rome", true) == 0,
        "lowercase=: lowercased before the lookup, as the client does");
  Check(nlmserve::FileWordId(lowered, "PARIS", false) == 3, "a lowercased model: lowercased before the lookup");
}


}  // namespace

int main(int argc, char **argv) {
  if (argc >= 2) {
    std::fprintf(stderr, "usage: %s\n", argv[0]);
    return 2;
  }
  TestPhraseRows();
  TestBoundaryRows();
  TestDenseIdMap();
  TestPairScores();
  TestExpansionScores();
  TestErrorPause();
  TestOrderMismatch();
  TestFeatureSources();
  std::printf("decoder: %d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}
