// Tests of the C++ client's parts that need no server (tests/test_cpp_client.py runs them).
//
//   nlmserve_unit_test
//       the n-gram cache, the n-gram rules, lowercasing and target parsing, the scoring
//       tables (the Moses feature's own parts: moses_plugin/cpp/nlmserve_decoder_test.cpp); prints "unit: N passed, 0 failed" (exit 1 on a failure).
//   nlmserve_unit_test --canonical
//       reads lines "ORDER<TAB>VOCAB_SIZE<TAB>IDS" (IDS space-separated, "-" for none) on
//       stdin and prints, for each, the canonical row CanonicalRow writes or
//       "error:KIND" (the columns of proto/contract/canonical_ngrams.tsv).
//   nlmserve_unit_test --huge-pages
//       fills 32 MB as the client fills the scoring tables (reserved, AdviseHugePages, then
//       written) and prints "huge pages: K kB" from /proc/self/smaps: the huge pages of
//       the mapping that holds them.
#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "ngram_cache.h"
#include "nlmserve_client.h"

namespace {

int g_passed = 0;
int g_failed = 0;

void Check(bool ok, const char *what) {
  if (ok) {
    ++g_passed;
  } else {
    ++g_failed;
    std::fprintf(stderr, "unit FAILED: %s\n", what);
  }
}

typedef std::vector<uint32_t> Row;

nlmserve::ModelInfo Model(uint32_t order, uint32_t vocab_size) {
  nlmserve::ModelInfo m;  // <unk> 0, <s> 1, </s> 2 by default
  m.order = order;
  m.vocab_size = vocab_size;
  return m;
}

int Canonical() {
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream fields(line);
    std::string order, vocab, ids_text;
    if (!std::getline(fields, order, '\t') || !std::getline(fields, vocab, '\t') ||
        !std::getline(fields, ids_text, '\t')) {
      std::cerr << "--canonical: not ORDER<TAB>VOCAB_SIZE<TAB>IDS: " << line << "\n";
      return 2;
    }
    nlmserve::ModelInfo model = Model(static_cast<uint32_t>(std::stoul(order)), static_cast<uint32_t>(std::stoul(vocab)));
    Row ids;
    if (ids_text != "-") {
      std::istringstream words(ids_text);
      unsigned long id;
      while (words >> id) ids.push_back(static_cast<uint32_t>(id));
    }
    Row out(model.order, 0xdeadbeefu);
    nlmserve::NgramError error = nlmserve::CanonicalRow(ids.data(), ids.size(), model, out.data());
    if (error != nlmserve::NgramError::kNone) {
      std::cout << "error:" << nlmserve::NgramErrorKind(error) << "\n";
      continue;
    }
    for (std::size_t i = 0; i < out.size(); ++i) std::cout << (i ? " " : "") << out[i];
    std::cout << "\n";
  }
  return 0;
}

void TestCacheBasics() {
  using nlmserve::NgramCache;
  const Row a = {1, 4, 7}, b = {1, 4, 8}, c = {9, 4, 7};
  {
    NgramCache cache(2, 1, 3);  // two slots: the window covers the whole table, an exact LRU
    float s = -1.0f;
    Check(!cache.Get(a.data(), &s), "empty cache misses");
    cache.Put(a.data(), 0.0f);
    Check(cache.Get(a.data(), &s) && s == 0.0f, "a score of 0.0 is a hit, not a miss");
    cache.Put(b.data(), -1.5f);
    Check(cache.Get(a.data(), &s), "a still present");  // a is now the most recent
    cache.Put(c.data(), -2.0f);                         // evicts b, the least recently used
    Check(!cache.Get(b.data(), &s), "least recently used entry evicted");
    Check(cache.Get(a.data(), &s) && s == 0.0f, "recently used entry kept");
    Check(cache.Get(c.data(), &s) && s == -2.0f, "new entry present");
    Check(cache.Size() == 2, "size bounded by capacity");
    Check(cache.hits() == 4 && cache.misses() == 2, "hit and miss counters");
    cache.Put(c.data(), -3.0f);
    Check(cache.Get(c.data(), &s) && s == -3.0f && cache.Size() == 2, "re-insert refreshes the value");
    cache.ResetCounters();
    Check(cache.hits() == 0 && cache.misses() == 0, "counters reset");
    cache.Clear();
    Check(cache.Size() == 0 && !cache.Get(a.data(), &s), "clear empties");
    cache.Put(b.data(), -4.0f);
    Check(cache.Get(b.data(), &s) && s == -4.0f && cache.Size() == 1, "usable after clear");
  }
  {
    NgramCache cache(0, 4, 3);
    float s;
    cache.Put(a.data(), 1.0f);
    Check(!cache.Get(a.data(), &s) && cache.Size() == 0 && cache.misses() == 1, "capacity 0 disables the cache");
  }
  {
    // Rows that differ in one id only, at either end, are different keys.
    NgramCache cache(64, 2, 5);
    const Row r1 = {1, 1, 1, 5, 6}, r2 = {1, 1, 1, 5, 7}, r3 = {3, 1, 1, 5, 6};
    cache.Put(r1.data(), -1.0f);
    cache.Put(r2.data(), -2.0f);
    cache.Put(r3.data(), -3.0f);
    float s1 = 0, s2 = 0, s3 = 0;
    Check(cache.Get(r1.data(), &s1) && cache.Get(r2.data(), &s2) && cache.Get(r3.data(), &s3) && s1 == -1.0f &&
              s2 == -2.0f && s3 == -3.0f,
          "every id of the row is part of the key");
  }
  {
    // 100 entries over 4 shards, 10,000 distinct rows: the size stays at the capacity,
    // and the row put last is always there.
    NgramCache cache(100, 4, 4);
    bool last_found = true;
    for (uint32_t i = 0; i < 10000; ++i) {
      const Row r = {i % 7, i, i / 3, 5};
      cache.Put(r.data(), static_cast<float>(i));
      float s = -1;
      if (!cache.Get(r.data(), &s) || s != static_cast<float>(i)) last_found = false;
    }
    Check(last_found, "the row put last is found");
    Check(cache.Size() == 100 && cache.capacity() == 100 && cache.shard_count() == 4, "bounded by cache-size entries");
  }
}

void TestCacheCollisions() {
  // kWindow + 1 rows with one home slot in a table larger than the window: the window
  // fills, then the next row replaces the window's least recently used entry.
  using nlmserve::NgramCache;
  NgramCache cache(64, 1, 5);
  std::vector<Row> same;
  std::pair<std::size_t, std::size_t> home(0, 0);
  for (uint32_t x = 0; same.size() < NgramCache::kWindow + 1 && x < 1000000; ++x) {
    Row r = {1, 1, x, x + 1, 7};
    if (same.empty()) home = cache.Place(r.data());
    if (cache.Place(r.data()) == home) same.push_back(r);
  }
  Check(same.size() == NgramCache::kWindow + 1, "found rows sharing a home slot");
  if (same.size() != NgramCache::kWindow + 1) return;
  for (std::size_t i = 0; i < NgramCache::kWindow; ++i) cache.Put(same[i].data(), -static_cast<float>(i));
  bool all = true;
  float s = 0;
  for (std::size_t i = 0; i < NgramCache::kWindow; ++i) {
    if (!cache.Get(same[i].data(), &s) || s != -static_cast<float>(i)) all = false;
  }
  Check(all && cache.Size() == NgramCache::kWindow, "colliding rows share the window");
  // Use order is now 0, 1, ..., 7; touching 0 again makes 1 the least recently used.
  cache.Get(same[0].data(), &s);
  cache.Put(same[NgramCache::kWindow].data(), -100.0f);
  Check(!cache.Get(same[1].data(), &s), "the least recently used row of the window is evicted");
  bool rest = cache.Get(same[0].data(), &s) && s == 0.0f;
  for (std::size_t i = 2; i <= NgramCache::kWindow; ++i) rest = rest && cache.Get(same[i].data(), &s);
  Check(rest && s == -100.0f && cache.Size() == NgramCache::kWindow, "the other rows stay");
}

void TestCacheThreads() {
  // Eight threads on a small sharded cache: every hit returns the value written for its
  // own key, the size stays bounded, every lookup is counted.
  nlmserve::NgramCache cache(64, 8, 5);
  std::atomic<int> bad(0);
  std::vector<std::thread> threads;
  const int kLookups = 20000;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&cache, &bad, t]() {
      for (int i = 0; i < kLookups; ++i) {
        const uint32_t k = static_cast<uint32_t>((i * 7 + t) % 200);
        const Row r = {1, k, k + 3, 2 * k, 9};
        float s;
        if (cache.Get(r.data(), &s)) {
          if (s != static_cast<float>(k)) bad.fetch_add(1);
        } else {
          cache.Put(r.data(), static_cast<float>(k));
        }
      }
    });
  }
  for (std::size_t t = 0; t < threads.size(); ++t) threads[t].join();
  Check(bad.load() == 0, "concurrent readers see the value written for their key");
  Check(cache.Size() <= 64, "concurrent size bounded");
  Check(cache.hits() + cache.misses() == 8u * kLookups && cache.hits() > 0, "concurrent lookups all counted");

  // The same with batches: each thread looks 50 rows up at once and puts its misses
  // (shards held by another thread are passed over and done later).
  nlmserve::NgramCache batched(64, 8, 5);
  std::vector<std::thread> batchers;
  const int kBatches = 400, kRows = 50;
  for (int t = 0; t < 4; ++t) {
    batchers.emplace_back([&batched, &bad, t, kBatches, kRows]() {
      nlmserve::NgramCache::Scratch scratch;
      Row rows(kRows * 5), missed;
      std::vector<float> scores(kRows), put;
      std::vector<uint8_t> found(kRows);
      for (int b = 0; b < kBatches; ++b) {
        for (int i = 0; i < kRows; ++i) {
          const uint32_t k = static_cast<uint32_t>((b * 31 + i * 7 + t) % 300);
          const Row r = {1, k, k + 3, 2 * k, 9};
          std::copy(r.begin(), r.end(), rows.begin() + i * 5);
        }
        batched.GetMany(rows.data(), kRows, scores.data(), found.data(), scratch);
        missed.clear();
        put.clear();
        for (int i = 0; i < kRows; ++i) {
          if (found[i] && scores[i] != static_cast<float>(rows[i * 5 + 1])) bad.fetch_add(1);
          if (!found[i]) {
            missed.insert(missed.end(), rows.begin() + i * 5, rows.begin() + (i + 1) * 5);
            put.push_back(static_cast<float>(rows[i * 5 + 1]));
          }
        }
        batched.PutMany(missed.data(), put.size(), put.data(), scratch);
      }
    });
  }
  for (std::size_t t = 0; t < batchers.size(); ++t) batchers[t].join();
  Check(bad.load() == 0 && batched.Size() <= 64, "concurrent batches see the value written for their key");
  Check(batched.hits() + batched.misses() == 4u * kBatches * kRows && batched.hits() > 0,
        "concurrent batched lookups all counted");
}

void TestCacheBatches() {
  // GetMany and PutMany against Get and Put one row at a time on a twin cache: the same
  // answers, counters and entries, with duplicates inside a batch, rows of every shard,
  // windows that overflow (evictions), and a disabled cache.
  using nlmserve::NgramCache;
  const std::size_t kWidth = 4;
  std::mt19937 rng(7);
  const std::size_t capacities[] = {0, 40, 300, 5000};
  const std::size_t shard_counts[] = {1, 7, 16};
  bool same_answers = true, same_state = true, many_shards = false, duplicates = false;
  for (std::size_t c = 0; c < sizeof(capacities) / sizeof(capacities[0]); ++c) {
    for (std::size_t sh = 0; sh < sizeof(shard_counts) / sizeof(shard_counts[0]); ++sh) {
      NgramCache one(capacities[c], shard_counts[sh], kWidth), batched(capacities[c], shard_counts[sh], kWidth);
      NgramCache::Scratch scratch;
      for (int round = 0; round < 30; ++round) {
        // Rows from a small id range, so that batches repeat rows and rounds repeat batches.
        const std::size_t n = 1 + rng() % 200;
        Row rows(n * kWidth);
        for (std::size_t k = 0; k < rows.size(); ++k) rows[k] = rng() % 6;
        std::vector<float> want(n, 7.0f), got(n, 7.0f);
        std::vector<uint8_t> found(n, 2);
        std::vector<uint8_t> want_found(n);
        std::vector<bool> shards_hit(shard_counts[sh], false);
        for (std::size_t i = 0; i < n; ++i) {
          want_found[i] = one.Get(&rows[i * kWidth], &want[i]) ? 1 : 0;
          shards_hit[one.Place(&rows[i * kWidth]).first] = true;
          for (std::size_t j = 0; j < i && !duplicates; ++j) {
            duplicates = std::equal(rows.begin() + i * kWidth, rows.begin() + (i + 1) * kWidth, rows.begin() + j * kWidth);
          }
        }
        const std::size_t hits = batched.GetMany(rows.data(), n, got.data(), found.data(), scratch);
        std::size_t want_hits = 0;
        for (std::size_t i = 0; i < n; ++i) {
          want_hits += want_found[i];
          if (found[i] != want_found[i] || got[i] != want[i]) same_answers = false;
        }
        if (hits != want_hits) same_answers = false;
        many_shards = many_shards || std::count(shards_hit.begin(), shards_hit.end(), true) == int(shard_counts[sh]);
        // Put every row (duplicates included, with different scores: the last one wins).
        std::vector<float> put(n);
        for (std::size_t i = 0; i < n; ++i) put[i] = -static_cast<float>(rng() % 1000) / 8.0f;
        for (std::size_t i = 0; i < n; ++i) one.Put(&rows[i * kWidth], put[i]);
        batched.PutMany(rows.data(), n, put.data(), scratch);
        if (one.Size() != batched.Size() || one.hits() != batched.hits() || one.misses() != batched.misses()) {
          same_state = false;
        }
      }
      // Every possible row: present in both or neither, with the same score.
      Row r(kWidth);
      for (uint32_t x = 0; x < 6 * 6 * 6 * 6; ++x) {
        for (std::size_t k = 0, y = x; k < kWidth; ++k, y /= 6) r[k] = static_cast<uint32_t>(y % 6);
        float a = 1.0f, b = 2.0f;
        const bool in_one = one.Get(r.data(), &a), in_batched = batched.Get(r.data(), &b);
        if (in_one != in_batched || (in_one && a != b)) same_state = false;
      }
    }
  }
  Check(same_answers, "GetMany answers as Get row by row");
  Check(same_state, "GetMany and PutMany leave the cache as Get and Put row by row");
  Check(many_shards && duplicates, "the batches had duplicates and rows of every shard");
  NgramCache cache(64, 4, kWidth);
  NgramCache::Scratch scratch;
  Check(cache.GetMany(nullptr, 0, nullptr, nullptr, scratch) == 0, "an empty batch");
  const Row rows = {1, 2, 3, 4, 5, 6, 7, 8};
  const float scores[] = {0.0f, -1.5f};
  std::vector<uint64_t> hashes = {nlmserve::HashRow(&rows[0], kWidth), nlmserve::HashRow(&rows[4], kWidth)};
  cache.PutMany(rows.data(), 2, scores, scratch, hashes.data());
  float got[2] = {9.0f, 9.0f};
  uint8_t found[2] = {0, 0};
  Check(cache.GetMany(rows.data(), 2, got, found, scratch, hashes.data()) == 2 && found[0] && found[1] &&
            got[0] == 0.0f && got[1] == -1.5f,
        "given hashes; 0.0 is a hit");
}

void TestRules() {
  nlmserve::ModelInfo m = Model(4, 20);
  Row out(4);
  const Row reset = {5, 1, 6, 7};
  Check(nlmserve::CanonicalRow(reset.data(), reset.size(), m, out.data()) == nlmserve::NgramError::kNone &&
            out == Row({1, 1, 6, 7}),
        "a <s> in the context resets what is left of it");
  m.bos_id = 3;  // the special ids come from the model
  Check(nlmserve::CanonicalRow(reset.data(), 1, m, out.data()) == nlmserve::NgramError::kNone && out == Row({3, 3, 3, 5}),
        "padding uses the model's <s>");
  const Row bos_last = {5, 3};
  Check(nlmserve::CanonicalRow(bos_last.data(), 2, m, out.data()) == nlmserve::NgramError::kBosTarget,
        "the model's <s> is never predicted");
  Check(nlmserve::NgramErrorMessage(nlmserve::NgramError::kTooLong, reset.data(), 5, 7, m) ==
            "n-gram 7 has 5 words; the model takes 1 to 4",
        "error messages name the n-gram");
  // Rows checked as a batch: the first that breaks a rule, and which rule.
  const nlmserve::ModelInfo v = Model(3, 20);
  nlmserve::NgramError error = nlmserve::NgramError::kEmpty;
  const Row fine = {20, 20, 5, 1, 1, 19};  // the no-word in a context; the last word
  Check(nlmserve::FirstBadRow(fine.data(), 2, v, &error) == 2 && error == nlmserve::NgramError::kNone,
        "valid rows: none is bad");
  const Row word_v = {1, 1, 5, 1, 1, 20, 21, 1, 5};  // the no-word predicted, then 21 in a context
  Check(nlmserve::FirstBadRow(word_v.data(), 3, v, &error) == 1 && error == nlmserve::NgramError::kOutOfRange,
        "the no-word is never predicted; the first bad row is named");
  Check(nlmserve::FirstBadRow(word_v.data() + 6, 1, v, &error) == 0 && error == nlmserve::NgramError::kOutOfRange,
        "an id above the no-word in a context");
  const Row bos_word = {1, 5, 6, 5, 6, 1};
  Check(nlmserve::FirstBadRow(bos_word.data(), 2, v, &error) == 1 && error == nlmserve::NgramError::kBosTarget,
        "<s> predicted");
  Check(nlmserve::FirstBadRow(bos_word.data(), 0, v, &error) == 0 && error == nlmserve::NgramError::kNone,
        "no rows");
  // The context rule on other types: the decoder's state of word pointers.
  const char *w[] = {"x", "<s>", "y", "z"};
  const char *bos = w[1];
  const char *ctx[3];
  nlmserve::CanonicalContext(w, 4, 3, bos, ctx);
  Check(ctx[0] == bos && ctx[1] == w[2] && ctx[2] == w[3], "CanonicalContext keeps the last words");
  nlmserve::CanonicalContext(w, 1, 3, bos, ctx);
  Check(ctx[0] == bos && ctx[1] == bos && ctx[2] == w[0], "CanonicalContext pads");
  nlmserve::CanonicalContext(w + 2, 1, 0, bos, ctx);  // width 0 writes nothing
  Check(ctx[2] == w[0], "width 0");
  // Rows of a 3-gram request merged into a 5-gram batch: contexts padded with <s> (1); a
  // sentence start inside a context clears what is left of it.
  const Row narrow = {7, 8, 9, 1, 8, 9};
  Row wide(10, 0);
  nlmserve::WidenRows(narrow.data(), 2, 3, 5, 1, wide.data());
  Check(wide == Row({1, 1, 7, 8, 9, 1, 1, 1, 8, 9}), "WidenRows pads each context with <s>");
  nlmserve::WidenRows(narrow.data(), 2, 3, 3, 1, wide.data());
  Check(Row(wide.begin(), wide.begin() + 6) == narrow, "WidenRows to the same width copies");
}

void TestTextAndTargets() {
  Check(nlmserve::Lowercase("The CAT") == "the cat", "ASCII lowercase");
  Check(nlmserve::Lowercase("\xc3\x89T\xc3\x89") == "\xc3\xa9t\xc3\xa9", "Latin-1 lowercase (ETE)");
  Check(nlmserve::Lowercase("\xff" "A") == "\xff" "a", "invalid UTF-8 bytes pass through");
  nlmserve::Endpoint one = nlmserve::ParseTarget("127.0.0.1:50051");
  Check(one.target == "127.0.0.1:50051" && !one.replicated && one.host_name == "127.0.0.1",
        "one address: pick_first, unchanged");
  nlmserve::Endpoint two = nlmserve::ParseTarget(" 127.0.0.1:1 , 127.0.0.2:2 ");
  Check(two.target == "ipv4:127.0.0.1:1,127.0.0.2:2" && two.replicated && two.replicas.size() == 2 &&
            two.host_name.empty(),
        "address list: static ipv4 target");
  nlmserve::Endpoint v6 = nlmserve::ParseTarget("[::1]:1,[::1]:2");
  Check(v6.target == "ipv6:[::1]:1,[::1]:2" && v6.host_name == "::1", "IPv6 list");
  nlmserve::Endpoint dns = nlmserve::ParseTarget("dns:///lm.example.org:50051");
  Check(dns.target == "dns:///lm.example.org:50051" && dns.replicated && dns.replicas.empty(),
        "dns:/// target: resolved by gRPC");
  bool mixed = false, bad = false;
  try {
    nlmserve::ParseTarget("127.0.0.1:1,[::1]:2");
  } catch (const nlmserve::ClientError &) {
    mixed = true;
  }
  try {
    nlmserve::ParseTarget("127.0.0.1:1,127.0.0.1");
  } catch (const nlmserve::ClientError &) {
    bad = true;
  }
  Check(mixed && bad, "mixed families and an address without port are errors");
  nlmserve::ClientError e(14, "unavailable");
  Check(e.code() == 14 && std::string(e.what()) == "unavailable", "ClientError carries the code");
}

}  // namespace

void TestScoringTables() {
  // Order 2, V = 3, D = 2: position[0][w] = (w, 1); output[w] = (1, w); bias[w] = w / 10.
  // Row (x, w): r = act((x, 1)), s = r . (1, w) + w / 10.
  std::vector<float> data = {0, 1, 1, 1, 2, 1, /* output */ 1, 0, 1, 1, 1, 2, /* bias */ 0.f, 0.1f, 0.2f};
  nlmserve::ScoringTables none, tanh_, relu;
  Check(!none.Set(2, 3, 2, nlmserve::Activation::kNone, "h", std::vector<float>(data.begin(), data.end() - 1)), "scoring tables 1");
  Check(!none.Set(1, 3, 2, nlmserve::Activation::kNone, "h", data), "scoring tables 2");
  Check(none.Set(2, 3, 2, nlmserve::Activation::kNone, "h", data), "scoring tables 3");
  Check(tanh_.Set(2, 3, 2, nlmserve::Activation::kTanh, "h", data), "scoring tables 4");
  std::vector<float> negative = data;
  negative[4] = -2;  // position[0][2] = (-2, 1)
  Check(relu.Set(2, 3, 2, nlmserve::Activation::kRelu, "h", negative), "scoring tables 5");
  nlmserve::Activation a;
  Check(nlmserve::ParseActivation("tanh", &a) && a == nlmserve::Activation::kTanh, "scoring tables 6");
  Check(!nlmserve::ParseActivation("sigmoid", &a), "scoring tables 7");
  const uint32_t rows[] = {2, 1, 1, 2, 2, 2, 0, 0};
  float out[4];
  nlmserve::ScoringTables::Scratch scratch;
  none.Score(rows, 4, out, &scratch);
  // (2, 1): r = (2, 1), s = 2 + 1 + 0.1; (1, 2): r = (1, 1), s = 1 + 2 + 0.2;
  // (2, 2): r = (2, 1), s = 2 + 2 + 0.2 (the context vector kept from the first row); (0, 0): 1
  Check(std::fabs(out[0] - 3.1f) < 1e-6 && std::fabs(out[1] - 3.2f) < 1e-6, "scoring tables 8");
  Check(std::fabs(out[2] - 4.2f) < 1e-6 && std::fabs(out[3] - 0.f) < 1e-6, "scoring tables 9");
  nlmserve::ScoringTables::Scratch other;  // a scratch sized for another model is resized
  tanh_.Score(rows, 1, out, &other);
  Check(std::fabs(out[0] - (std::tanh(2.f) + std::tanh(1.f) + 0.1f)) < 1e-6, "scoring tables 10");
  relu.Score(rows, 1, out, &scratch);
  Check(std::fabs(out[0] - (0.f + 1.f + 0.1f)) < 1e-6, "scoring tables 11");  // r = relu(-2, 1) = (0, 1)
  // The no-word (id V = 3) as the context adds no row: r = act((0, 0)); (3, 2): s = 0.2,
  // and after (2, 2), whose context vector the scratch keeps, still 0.2.
  const uint32_t unknown[] = {2, 2, 3, 2, 3, 1};
  none.Score(unknown, 3, out, &scratch);
  Check(std::fabs(out[0] - 4.2f) < 1e-6 && out[1] == 0.2f && out[2] == 0.1f, "scoring tables: the no-word adds nothing");
  tanh_.Score(unknown + 2, 1, out, &scratch);
  Check(out[0] == 0.2f, "scoring tables: the no-word, tanh(0) = 0");
}

// Order 2, V = 4, D = 2, the tree ((0, 2), 3) of tests/test_trees.py's golden case: the
// root (node 0) goes left to node 1 and right to word 3, node 1 left to word 0 and right
// to word 2; <s> (word 1) has no code. q_0 = (0.5, -0.25), b_0 = 0.1; q_1 = (0.2, 0.3),
// b_1 = -0.4. position[0][0] = (1, 2), every other row 0. After context 0: r = (1, 2),
// x_0 = 0.1, x_1 = 0.4; after context 2: r = 0, x_0 = 0.1, x_1 = -0.4.
std::vector<float> GoldenTree(nlmserve::ScoringTables::Tree *tree) {
  const float position[] = {1, 2, 0, 0, 0, 0, 0, 0};
  const float nodes[] = {0.5f, -0.25f, 0.2f, 0.3f, /* biases */ 0.1f, -0.4f};
  // code_start (V+1), step_start (codes+1), steps (2 * node + bit, bit 1 left).
  const float paths[] = {0, 1, 1, 2, 3, /* */ 0, 2, 4, 5, /* */ 1, 3, 1, 2, 0};
  std::vector<float> data(position, position + 8);
  data.insert(data.end(), nodes, nodes + 6);
  data.insert(data.end(), paths, paths + 14);
  tree->nodes = 2;
  tree->codes = 3;
  tree->steps = 5;
  return data;
}

void TestScoringTablesTree() {
  nlmserve::ScoringTables::Tree tree;
  const std::vector<float> data = GoldenTree(&tree);
  nlmserve::ScoringTables tables;
  Check(tables.Set(2, 4, 2, nlmserve::Activation::kNone, "h", data, nlmserve::ScoringTables::Features(), tree),
        "tree tables are taken");
  Check(tables.normalized() && tables.tree().nodes == 2, "tree tables give normalised scores");
  const uint32_t rows[] = {0, 0, 0, 2, 0, 3, 2, 3, 2, 0, 0, 1};
  float out[6];
  nlmserve::ScoringTables::Scratch scratch;
  tables.Score(rows, 6, out, &scratch);
  auto sig = [](double x) { return 1.0 / (1.0 + std::exp(-x)); };
  Check(std::fabs(out[0] - std::log(sig(0.1) * sig(0.4))) < 1e-6 && std::fabs(out[1] - std::log(sig(0.1) * sig(-0.4))) < 1e-6 &&
            std::fabs(out[2] - std::log(sig(-0.1))) < 1e-6,
        "tree scores by hand after context 0");
  Check(std::fabs(out[3] - std::log(sig(-0.1))) < 1e-6 && std::fabs(out[4] - std::log(sig(0.1) * sig(-0.4))) < 1e-6,
        "tree scores by hand after context 2");
  Check(std::isinf(out[5]) && out[5] < 0, "<s> has no code: -inf");
  double sum = 0;
  for (int i = 0; i < 3; ++i) sum += std::exp(out[i]);
  Check(std::fabs(sum - 1.0) < 1e-6, "the tree's words sum to one");
  // The nodes kept for a context change no score: each row alone, from a fresh scratch,
  // gives the same floats; the batch computed each (context, node) pair once: context 0
  // meets nodes 0 and 1, context 2 nodes 0 and 1 again (5 rows, 4 pairs).
  Check(scratch.nodes_computed == 4, "each (context, node) pair computed once");
  for (int i = 0; i < 6; ++i) {
    nlmserve::ScoringTables::Scratch fresh;
    float alone;
    tables.Score(rows + 2 * i, 1, &alone, &fresh);
    Check(alone == out[i] || (std::isinf(alone) && std::isinf(out[i])), "a tree score does not depend on the scratch");
  }
  // Word 3 given a second code (it then also sits at node 1's right, in place of word 2's
  // only code moving to word 3): code_start 0, 1, 1, 1, 3, so p(3) = sigmoid(x_0) sigmoid(-x_1) + sigmoid(-x_0).
  std::vector<float> two = data;
  two[14 + 3] = 1;
  Check(tables.Set(2, 4, 2, nlmserve::Activation::kNone, "h", two, nlmserve::ScoringTables::Features(), tree),
        "a word with two codes is taken");
  tables.Score(rows + 4, 1, out, &scratch);
  Check(std::fabs(out[0] - std::log(sig(0.1) * sig(-0.4) + sig(-0.1))) < 1e-6, "a word's codes are summed");
  // Refused: one float short; a step at node 2 of a two-node tree; a code with no step;
  // code_start not reaching the codes; a fraction; a tree with features.
  nlmserve::ScoringTables refused;
  Check(!refused.Set(2, 4, 2, nlmserve::Activation::kNone, "h", std::vector<float>(data.begin(), data.end() - 1),
                     nlmserve::ScoringTables::Features(), tree),
        "tree tables one float short are refused");
  std::vector<float> bad = data;
  bad[27] = 4;  // 2 * node 2 + 0
  Check(!refused.Set(2, 4, 2, nlmserve::Activation::kNone, "h", bad, nlmserve::ScoringTables::Features(), tree),
        "a step outside the tree is refused");
  bad = data;
  bad[14 + 5 + 2] = 2;  // step_start 0, 2, 2, 5: the second code has no step
  Check(!refused.Set(2, 4, 2, nlmserve::Activation::kNone, "h", bad, nlmserve::ScoringTables::Features(), tree),
        "a code without a step is refused");
  bad = data;
  bad[14 + 4] = 2;  // code_start ends at 2 of 3 codes
  Check(!refused.Set(2, 4, 2, nlmserve::Activation::kNone, "h", bad, nlmserve::ScoringTables::Features(), tree),
        "codes that do not add up are refused");
  bad = data;
  bad[24] = 1.5f;
  Check(!refused.Set(2, 4, 2, nlmserve::Activation::kNone, "h", bad, nlmserve::ScoringTables::Features(), tree),
        "a fractional step is refused");
  nlmserve::ScoringTables::Features features;
  features.order = 1;
  features.word_table = 1;
  bad = data;
  bad.insert(bad.begin() + 14, 5, 0.f);  // room for word classes (V) and one word slot
  Check(!refused.Set(2, 4, 2, nlmserve::Activation::kNone, "h", bad, features, tree), "a tree with features is refused");
  Check(refused.order() == 0, "refused tables stay empty");
}

void TestScoringTablesFeatures() {
  // Order 3, V = 12, D = 1, every LBL weight 0 (r = 0, s = the features alone); word w is
  // in class w % 3. The context "5 7" has the suffix hashes h_0 = 1000003,
  // h_1 = (h_0 * 1299709 + 7 + 1) mod (2^31 - 1) = 485292700 and
  // h_2 = (h_1 * 1299709 + 5 + 1) mod (2^31 - 1) = 1867863936 (by hand, as the Python
  // test of the same numbers). Word 9 (class 0): word slots 96, 16, 77 of 101, class
  // slots 3, 5, 6 of 7 (((h * 1640531527 + y * 805306457) mod (2^31 - 1)) mod size).
  Check(nlmserve::FeatureSlot(1000003, 9, 101) == 96 && nlmserve::FeatureSlot(485292700, 9, 101) == 16 &&
            nlmserve::FeatureSlot(1867863936, 9, 101) == 77 && nlmserve::FeatureSlot(1867863936, 0, 7) == 6,
        "feature slots by hand");
  const uint32_t V = 12, kClass = 7, kWord = 101;
  std::vector<float> data(3 * V * 1 + V, 0.f);
  for (uint32_t w = 0; w < V; ++w) data.push_back(static_cast<float>(w % 3));  // word classes
  const std::size_t class_at = data.size();
  data.resize(class_at + kClass + kWord, 0.f);
  const std::size_t word_at = class_at + kClass;
  data[class_at + 3] = 10.f;
  data[class_at + 5] = 20.f;
  data[class_at + 6] = 40.f;
  data[word_at + 96] = 0.25f;
  data[word_at + 16] = 0.5f;
  data[word_at + 77] = 0.75f;
  nlmserve::ScoringTables::Features full;
  full.order = 3;
  full.class_table = kClass;
  full.word_table = kWord;
  nlmserve::ScoringTables tables, bigrams, no_class;
  Check(tables.Set(3, V, 1, nlmserve::Activation::kNone, "h", data, full), "feature tables set");
  nlmserve::ScoringTables::Features two = full;
  two.order = 2;  // the suffixes "" and "7" only
  Check(bigrams.Set(3, V, 1, nlmserve::Activation::kNone, "h", data, two), "feature tables set, order 2");
  const uint32_t rows[] = {5, 7, 9, 6, 7, 9, 5, 7, 9};
  float out[3];
  nlmserve::ScoringTables::Scratch scratch;
  tables.Score(rows, 3, out, &scratch);
  // "5 7 9": 10 + 20 + 40 + 0.25 + 0.5 + 0.75 (and the third row again, its slots computed
  // while the first was scored); "6 7 9": h_2 = 1867863937, whose class slot is 3 again
  // (10) and word slot 85 (0): 10 + 20 + 10 + 0.25 + 0.5.
  Check(std::fabs(out[0] - 71.5f) < 1e-5 && std::fabs(out[2] - 71.5f) < 1e-5, "features by hand, order 3");
  Check(std::fabs(out[1] - 40.75f) < 1e-5, "a changed oldest word changes the trigram features");
  Check(scratch.rows_remembered == 1, "tables with features remember the third row, the first again");
  // A batch of distinct rows (a fresh scratch, so that none is remembered): each row keeps
  // its own slots (the last two rows by hand below).
  const uint32_t longer[] = {5, 7, 9, 6, 7, 9, V, 7, 9, V, V, 9};
  float got[4];
  nlmserve::ScoringTables::Scratch ring;
  tables.Score(longer, 4, got, &ring);
  Check(ring.rows_remembered == 0 && std::fabs(got[0] - 71.5f) < 1e-5 && std::fabs(got[1] - 40.75f) < 1e-5 &&
            got[2] == 30.75f && got[3] == 10.25f,
        "feature slots prefetched rows ahead stay with their rows");
  // Rows repeated one to four rows on: each remembered, with its own score.
  const uint32_t repeated[] = {5, 7, 9, 6, 7, 9, 5, 7, 9, 5, 7, 9, V, 7, 9, 6, 7, 9, V, V, 9, V, 7, 9};
  const float want[] = {71.5f, 40.75f, 71.5f, 71.5f, 30.75f, 40.75f, 10.25f, 30.75f};
  float each[8];
  nlmserve::ScoringTables::Scratch again;
  tables.Score(repeated, 8, each, &again);
  bool all = again.rows_remembered == 4;
  for (int i = 0; i < 8; ++i) all = all && std::fabs(each[i] - want[i]) < 1e-5;
  Check(all, "rows repeated one to four rows on are remembered with their own scores");
  // A row remembered when its slots were due (so they were not computed), whose entry a row
  // between took: its slots are computed when it is scored. x and y share an entry.
  std::vector<uint32_t> x, y;
  for (uint32_t k = 0; k < V * V * V && y.empty(); ++k) {
    const uint32_t row[] = {k / (V * V), k / V % V, k % V};
    for (uint32_t l = 0; l < k && y.empty(); ++l) {
      const uint32_t other[] = {l / (V * V), l / V % V, l % V};
      if (tables.RowEntryOf(row) == tables.RowEntryOf(other)) {
        x.assign(other, other + 3);
        y.assign(row, row + 3);
      }
    }
  }
  Check(!y.empty(), "two rows that share an entry");
  float alone[3], taken[3];
  nlmserve::ScoringTables::Scratch fresh_x, fresh_y, fresh_z, shared;
  tables.Score(x.data(), 1, alone, &fresh_x);
  tables.Score(y.data(), 1, alone + 1, &fresh_y);
  tables.Score(longer, 1, alone + 2, &fresh_z);
  tables.Score(x.data(), 1, taken, &shared);
  std::vector<uint32_t> batch = y;  // y takes x's entry; then "5 7 9"; then x
  batch.insert(batch.end(), longer, longer + 3);
  batch.insert(batch.end(), x.begin(), x.end());
  tables.Score(batch.data(), 3, taken, &shared);
  Check(shared.rows_remembered == 0 && taken[0] == alone[1] && taken[1] == alone[2] && taken[2] == alone[0] &&
            alone[0] != alone[1],
        "a row whose entry was taken gets its slots");
  // A batch several read-ahead distances long, so that every place of the rings of hashes
  // and slots is used and reused, with rows repeated 1 to 2 * kProbeAhead rows on and the
  // no-word: each score is the float of its row scored alone.
  typedef nlmserve::ScoringTables::Scratch Scratch;
  std::vector<float> varied = data;
  for (std::size_t k = 0; k < kClass + kWord; ++k) varied[class_at + k] = 0.125f * static_cast<float>(k % 13);
  nlmserve::ScoringTables busy;
  Check(busy.Set(3, V, 1, nlmserve::Activation::kNone, "h", varied, full), "varied feature tables set");
  const std::size_t many = 4 * (Scratch::kProbeAhead + Scratch::kAhead + 1);
  std::vector<uint32_t> long_batch;
  std::mt19937 rng(7);
  auto next = [&rng](uint32_t below) { return static_cast<uint32_t>(rng() % below); };
  for (std::size_t i = 0; i < many; ++i) {
    if (i > 0 && i % 3 == 0) {  // a row of 1 .. 2 * kProbeAhead rows before
      const std::size_t back = 1 + next(static_cast<uint32_t>(std::min<std::size_t>(i, 2 * Scratch::kProbeAhead)));
      const std::vector<uint32_t> earlier(long_batch.end() - 3 * back, long_batch.end() - 3 * (back - 1));
      long_batch.insert(long_batch.end(), earlier.begin(), earlier.end());
      continue;
    }
    const uint32_t unknown_words = next(4) == 0 ? 1 + next(2) : 0;  // no-words: the oldest context words
    for (uint32_t j = 0; j < 2; ++j) long_batch.push_back(j < unknown_words ? V : next(V));
    long_batch.push_back(next(V));
  }
  std::vector<float> batch_out(many);
  Scratch long_scratch;
  busy.Score(long_batch.data(), many, batch_out.data(), &long_scratch);
  bool each_alone = long_scratch.rows_remembered >= many / 3;
  for (std::size_t i = 0; i < many; ++i) {
    Scratch fresh_row;
    float one;
    busy.Score(long_batch.data() + 3 * i, 1, &one, &fresh_row);
    each_alone = each_alone && one == batch_out[i];
  }
  Check(each_alone, "a batch longer than the read-ahead: every row's score as if scored alone");
  // The no-word (id V = 12) has no feature, nor has any longer suffix: "? 7 9" has the
  // suffixes "" and "7" (10 + 20 + 0.25 + 0.5), "? ? 9" the empty one (10 + 0.25).
  const uint32_t unknown[] = {V, 7, 9, V, V, 9};
  tables.Score(unknown, 2, out, &scratch);
  Check(out[0] == 30.75f && out[1] == 10.25f, "features: none for a suffix that holds the no-word");
  bigrams.Score(rows, 1, out, &scratch);  // scratch of the other model: its slots are resized
  Check(std::fabs(out[0] - 30.75f) < 1e-5, "features by hand, order 2");
  // Tables whose sizes are powers of two (the recipe's): the slot is the low bits. For
  // "5 7 9", (h * 1640531527 + 9 * 805306457) mod (2^31 - 1) = 1481514455, 1021317874,
  // 1837456919, whose low 7 bits are word slots 87, 114, 23 of 128; class 0 takes slots
  // 3, 6, 3 of 8 (the same suffix sums twice into slot 3).
  Check(nlmserve::FeatureSlot(1000003, 9, 128, 127) == 87 && nlmserve::FeatureSlot(485292700, 9, 128, 127) == 114 &&
            nlmserve::FeatureSlot(1867863936, 9, 128, 127) == 23 && nlmserve::FeatureSlot(1867863936, 0, 8, 7) == 3 &&
            nlmserve::FeatureSlot(1867863936, 9, 101, 0) == 77,
        "feature slots of power-of-two tables by hand");
  std::vector<float> pow2(data.begin(), data.begin() + class_at);
  pow2.resize(class_at + 8 + 128, 0.f);
  pow2[class_at + 3] = 10.f;
  pow2[class_at + 6] = 20.f;
  pow2[class_at + 8 + 87] = 0.25f;
  pow2[class_at + 8 + 114] = 0.5f;
  pow2[class_at + 8 + 23] = 0.75f;
  nlmserve::ScoringTables::Features sized = full;
  sized.class_table = 8;
  sized.word_table = 128;
  Check(no_class.Set(3, V, 1, nlmserve::Activation::kNone, "h", pow2, sized), "power-of-two feature tables set");
  no_class.Score(rows, 1, out, &scratch);
  Check(std::fabs(out[0] - 41.5f) < 1e-5, "power-of-two features by hand");  // 10 + 20 + 10 + 1.5
  // Refused: a class id that is not a whole number, a feature order above the model's,
  // a missing float, features with both tables empty.
  std::vector<float> bad = data;
  bad[4 * V + 4] = 1.5f;  // the class of word 4
  Check(!no_class.Set(3, V, 1, nlmserve::Activation::kNone, "h", bad, full), "fractional class id refused");
  nlmserve::ScoringTables::Features too_long = full;
  too_long.order = 4;
  Check(!no_class.Set(3, V, 1, nlmserve::Activation::kNone, "h", data, too_long), "feature order above the model's");
  Check(!no_class.Set(3, V, 1, nlmserve::Activation::kNone, "h", std::vector<float>(data.begin(), data.end() - 1), full),
        "a missing float refused");
  nlmserve::ScoringTables::Features empty;
  empty.order = 3;
  Check(!no_class.Set(3, V, 1, nlmserve::Activation::kNone, "h", data, empty), "features without tables refused");
  // Without the class table (the array without its 7 floats): only the word weights.
  std::vector<float> word_only(data.begin(), data.begin() + class_at);
  word_only.insert(word_only.end(), data.begin() + word_at, data.end());
  nlmserve::ScoringTables::Features words = full;
  words.class_table = 0;
  Check(no_class.Set(3, V, 1, nlmserve::Activation::kNone, "h", word_only, words), "word features alone");
  no_class.Score(rows, 1, out, &scratch);
  Check(std::fabs(out[0] - 1.5f) < 1e-6, "word features by hand");
  Check(tables.bytes() == data.size() * sizeof(float) + V * sizeof(uint32_t), "feature tables bytes");
}

void TestScoringTablesRemembered() {
  // Tables keep recent rows' scores: a row scored again costs no node (with a tree), gives
  // the same float, and rows differing in any id are not taken for each other.
  nlmserve::ScoringTables::Tree tree;
  nlmserve::ScoringTables tables;
  Check(tables.Set(2, 4, 2, nlmserve::Activation::kNone, "h", GoldenTree(&tree), nlmserve::ScoringTables::Features(),
                   tree),
        "tree tables set");
  // (0, 0) computes nodes 0 and 1 for context 0, (0, 2) finds both, (2, 3) computes node 0
  // for context 2; the third and fifth rows are the first two again.
  const uint32_t rows[] = {0, 0, 0, 2, 0, 0, 2, 3, 0, 2};
  float out[5], again[5], fresh_out[5];
  nlmserve::ScoringTables::Scratch scratch, fresh;
  tables.Score(rows, 5, out, &scratch);
  Check(scratch.rows_remembered == 2 && scratch.nodes_computed == 3, "repeated rows remembered, nodes computed once");
  Check(out[2] == out[0] && out[4] == out[1] && out[0] != out[1], "a remembered row has its own score");
  tables.Score(rows, 5, again, &scratch);
  Check(scratch.rows_remembered == 7 && scratch.nodes_computed == 3, "a second batch is remembered whole");
  for (int i = 0; i < 5; ++i) tables.Score(rows + 2 * i, 1, fresh_out + i, &fresh);
  bool same = true;
  for (int i = 0; i < 5; ++i) same = same && again[i] == out[i] && fresh_out[i] == out[i];
  Check(same, "remembered scores are the floats computed");
  // New tables (a changed bias) make the scratch's rows stale: nothing is remembered (the
  // count, a report's, goes on from 7).
  std::vector<float> moved = GoldenTree(&tree);
  moved[12] = 0.6f;  // b_0 = 0.6
  Check(tables.Set(2, 4, 2, nlmserve::Activation::kNone, "h", moved, nlmserve::ScoringTables::Features(), tree),
        "changed tree tables are taken");
  tables.Score(rows, 1, again, &scratch);
  auto sig = [](double x) { return 1.0 / (1.0 + std::exp(-x)); };
  Check(scratch.rows_remembered == 7 && std::fabs(again[0] - std::log(sig(0.6) * sig(0.4))) < 1e-6,
        "new tables forget the old tables' rows");
  // A class output's tables remember rows too; rows that share a context and differ in the
  // word are told apart (a scratch of their own, whose count starts at 0).
  std::vector<float> plain = {0, 1, 1, 1, 2, 1, /* output */ 1, 0, 1, 1, 1, 2, /* bias */ 0.f, 0.1f, 0.2f};
  nlmserve::ScoringTables lbl;
  Check(lbl.Set(2, 3, 2, nlmserve::Activation::kNone, "h", plain), "plain class tables set");
  const uint32_t twice[] = {2, 1, 2, 1, 2, 0};
  nlmserve::ScoringTables::Scratch own;
  lbl.Score(twice, 3, out, &own);
  // context 2: (2, 1); word 1: 2 * 1 + 1 * 1 + 0.1, word 0: 2 * 1 + 1 * 0 + 0.
  Check(own.rows_remembered == 1 && std::fabs(out[0] - 3.1f) < 1e-6 && out[1] == out[0] &&
            std::fabs(out[2] - 2.0f) < 1e-6,
        "plain class tables remember rows");
}

void TestScoringTablesPrefixes() {
  // Order 4, V = 8, D = 2. position[j][w] = (a, b) with values whose sum depends on the
  // order of the additions: (1e8 + 1) - 1e8 is 0 in floats, 1 + (1e8 - 1e8) is 1.
  const uint32_t V = 8, D = 2;
  std::vector<float> data(4 * V * D + V, 0.f);
  for (uint32_t j = 0; j < 3; ++j) {
    for (uint32_t w = 0; w < V; ++w) {
      data[(j * V + w) * D] = 0.25f * static_cast<float>(j + 1) + 0.125f * static_cast<float>(w);
      data[(j * V + w) * D + 1] = 0.5f - 0.0625f * static_cast<float>(w * (j + 2));
    }
  }
  data[(0 * V + 1) * D] = 1e8f;   // position[0][1]
  data[(1 * V + 2) * D] = 1.f;    // position[1][2]
  data[(2 * V + 3) * D] = -1e8f;  // position[2][3]
  for (uint32_t w = 0; w < V; ++w) {
    data[3 * V * D + w * D] = 1.f;  // output[w] = (1, w / 4)
    data[3 * V * D + w * D + 1] = 0.25f * static_cast<float>(w);
  }
  nlmserve::ScoringTables none, tanh_;
  Check(none.Set(4, V, D, nlmserve::Activation::kNone, "h", data), "prefix tables set");
  Check(tanh_.Set(4, V, D, nlmserve::Activation::kTanh, "h", data), "prefix tanh tables set");
  // Rows sharing their oldest words as a decoder's expansions do: the second shares
  // "1 2", the third "1", the fourth the whole context of the first, the fifth nothing.
  const uint32_t rows[] = {1, 2, 3, 0, 1, 2, 4, 5, 1, 5, 6, 7, 1, 2, 3, 6, 7, 2, 3, 0};
  const std::size_t n = 5;
  float out[n], alone[n];
  for (int a = 0; a < 2; ++a) {
    const nlmserve::ScoringTables &t = a == 0 ? none : tanh_;
    nlmserve::ScoringTables::Scratch batch;
    t.Score(rows, n, out, &batch);
    bool same = true;
    for (std::size_t i = 0; i < n; ++i) {
      nlmserve::ScoringTables::Scratch fresh;  // every row summed from its first word
      t.Score(rows + 4 * i, 1, alone + i, &fresh);
      same = same && out[i] == alone[i];
    }
    Check(same, a == 0 ? "prefix sums: the floats of summing every row alone"
                       : "prefix sums with tanh: the floats of summing every row alone");
    // 3 rows summed for the first, 1 for the second (after "1 2"), 2 for the third (after
    // "1"), none for the fourth, 3 for the fifth.
    Check(batch.rows_added == 9, "prefix sums: the rows summed");
    // "1 2 3 0": r = ((1e8 + 1) + -1e8, b) in that order: (0, 0.375 + 0.125 - 0.25) =
    // (0, 0.25); s = 0 + 0.25 * 0 = 0.
    if (a == 0) Check(out[0] == 0.f, "prefix sums: added in order, oldest word first");
  }
  // A scratch follows its tables: other tables of the same shape, or the same object
  // set again, do not see its entries.
  nlmserve::ScoringTables::Scratch scratch;
  none.Score(rows, 1, out, &scratch);
  std::vector<float> other = data;
  other[(2 * V + 3) * D] = 0.f;  // position[2][3] = (0, b): r = (1e8, b), s = 1e8
  nlmserve::ScoringTables changed;
  Check(changed.Set(4, V, D, nlmserve::Activation::kNone, "h", other), "prefix tables set, other");
  changed.Score(rows, 1, out + 1, &scratch);
  Check(out[1] == 1e8f && scratch.rows_added == 6, "a scratch of other tables starts empty");
  Check(none.Set(4, V, D, nlmserve::Activation::kNone, "h", other), "prefix tables set again");
  none.Score(rows, 1, out + 2, &scratch);
  Check(out[2] == 1e8f && scratch.rows_added == 9, "tables set again start their scratch empty");
}

// The AnonHugePages of the /proc/self/smaps mapping that holds p (-1: no such mapping).
long HugePagesKb(const void *p) {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool inside = false;
  const unsigned long at = reinterpret_cast<unsigned long>(p);
  while (std::getline(smaps, line)) {
    unsigned long from = 0, to = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &from, &to) == 2 && line.find(':') > line.find(' ')) {
      inside = from <= at && at < to;
      continue;
    }
    long kb = 0;
    if (inside && std::sscanf(line.c_str(), "AnonHugePages: %ld kB", &kb) == 1) return kb;
  }
  return -1;
}

int HugePages() {
  std::vector<float> data;
  const std::size_t floats = std::size_t(8) << 20;  // 32 MB
  data.reserve(floats);
  nlmserve::AdviseHugePages(data.data(), data.capacity() * sizeof(float));
  data.resize(floats, 1.f);
  std::printf("huge pages: %ld kB\n", HugePagesKb(data.data() + floats / 2));
  return 0;
}

// The AVX2 kernels make the portable loops' floats, bit for bit (nlmserve_quantize.h): a
// score must not depend on the CPU. Widths around the 8-value step, values of mixed signs
// and magnitudes (where another summation order or a fused multiply-add would show), in each
// form, against the header's portable loop (PortableDot) and the plain sums.
bool SameFloats(const float *a, const float *b, std::size_t n) { return std::memcmp(a, b, n * sizeof(float)) == 0; }

void TestFloatKernels() {
#ifdef NLMSERVE_AVX2_KERNELS
  if (!nlmserve::HasAvx2()) {
    std::printf("unit: no AVX2 and F16C on this CPU; the portable loops alone are used\n");
    return;
  }
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> value(-1.f, 1.f);
  int differ[3] = {0, 0, 0};  // float, fp16, int8
  for (std::size_t n : {1, 7, 8, 9, 15, 16, 17, 64, 255, 256, 257, 768}) {
    for (int trial = 0; trial < 50; ++trial) {
      std::vector<float> a(n), b(n), sum(n), x(n), y(n);
      std::vector<uint16_t> half(n);
      std::vector<int8_t> q(n);
      for (std::size_t i = 0; i < n; ++i) {
        a[i] = value(rng) * std::ldexp(1.f, static_cast<int>(rng() % 20) - 10);
        b[i] = value(rng) * std::ldexp(1.f, static_cast<int>(rng() % 20) - 10);
        sum[i] = value(rng);
        // a normal half of either sign (exponent 1..30), or zero
        half[i] = rng() % 9 == 0 ? 0 : static_cast<uint16_t>((rng() % 2) << 15 | (1 + rng() % 30) << 10 | rng() % 1024);
        q[i] = static_cast<int8_t>(static_cast<int>(rng() % 255) - 127);
      }
      const float scale = value(rng) * 0.01f;
      float got = nlmserve::FloatRows::Dot(a.data(), b.data(), 1.f, n);
      float want = nlmserve::PortableDot(a.data(), b.data(), n, nlmserve::SameFloat);
      differ[0] += !SameFloats(&got, &want, 1);
      got = nlmserve::HalfRows::Dot(a.data(), half.data(), 1.f, n);
      want = nlmserve::PortableDot(a.data(), half.data(), n, nlmserve::HalfToFloat);
      differ[1] += !SameFloats(&got, &want, 1);
      got = nlmserve::Int8Rows::Dot(a.data(), q.data(), scale, n);
      want = nlmserve::PortableDot(a.data(), q.data(), n, nlmserve::Int8Rows::ToFloat) * scale;
      differ[2] += !SameFloats(&got, &want, 1);
      for (std::size_t d = 0; d < n; ++d) x[d] = sum[d] + b[d];
      nlmserve::FloatRows::Add(y.data(), sum.data(), b.data(), 1.f, n);
      differ[0] += !SameFloats(x.data(), y.data(), n);
      for (std::size_t d = 0; d < n; ++d) x[d] = sum[d] + nlmserve::HalfToFloat(half[d]);
      nlmserve::HalfRows::Add(y.data(), sum.data(), half.data(), 1.f, n);
      differ[1] += !SameFloats(x.data(), y.data(), n);
      for (std::size_t d = 0; d < n; ++d) x[d] = sum[d] + scale * static_cast<float>(q[d]);
      y = sum;
      nlmserve::Int8Rows::Add(y.data(), y.data(), q.data(), scale, n);  // in place
      differ[2] += !SameFloats(x.data(), y.data(), n);
    }
  }
  Check(differ[0] == 0, "AVX2 float32 dot product and sum: the portable loops' floats");
  Check(differ[1] == 0, "AVX2 fp16 dot product and sum: the portable loops' floats");
  Check(differ[2] == 0, "AVX2 int8 dot product and sum (in place): the portable loops' floats");
#endif
}

int main(int argc, char **argv) {
  if (argc >= 2 && std::string(argv[1]) == "--canonical") return Canonical();
  if (argc >= 2 && std::string(argv[1]) == "--huge-pages") return HugePages();
  if (argc >= 2) {
    std::fprintf(stderr, "usage: %s [--canonical | --huge-pages]\n", argv[0]);
    return 2;
  }
  TestCacheBasics();
  TestCacheCollisions();
  TestCacheThreads();
  TestCacheBatches();
  TestRules();
  TestTextAndTargets();
  TestScoringTables();
  TestScoringTablesTree();
  TestScoringTablesFeatures();
  TestScoringTablesRemembered();
  TestScoringTablesPrefixes();
  TestFloatKernels();
  std::printf("unit: %d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}
