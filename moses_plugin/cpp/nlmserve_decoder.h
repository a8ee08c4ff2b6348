// The parts of a decoder's language-model feature that need no decoder: the model's facts from
// a tables file and the words' ids (its options, and where it finds its model, are
// nlmserve_moses_ini.h's), the n-gram rows of a phrase
// and of a phrase boundary (built on CanonicalRow, the one owner of the n-gram rules), a
// word-id table filled once per word and read without a lock, the boundary scores of a batch
// of expansions, and the on-error=floor pause.
//
// The Moses feature NeuralLMServer (NeuralLMServer.cpp, NeuralLMServerPrefetch.cpp) is written
// on these, and lives beside them: add_to_moses.py copies this header into moses/LM/ with the
// feature (the client library does not install it). The test executable nlmserve_decoder_test (nlmserve_decoder_test.cpp,
// built by client/cpp's CMake project from this folder) checks them without Moses or a server.
// Includes only what the client library installs; C++11, like Moses.
#ifndef NLMSERVE_DECODER_H
#define NLMSERVE_DECODER_H

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "nlmserve_client.h"
#include "nlmserve_tables_file.h"

namespace nlmserve {

// Stands for a non-terminal among the ids given to PhraseRows: the context starts again
// after it.
const uint32_t kNonTerminal = 0xffffffffu;

// Appends to `rows` the canonical rows (model.order ids each) of the n-grams of a phrase,
// ids[0, n), as Moses' LanguageModelImplementation::CalcScore walks them: each word is
// predicted from the up to order-1 words before it in the phrase; kNonTerminal resets the
// context and is not predicted; <s> (model.bos_id) at position 0 is context only. For each
// row appended, `complete` (when given) gets 1 when its n-gram has order words, else 0;
// `unknown` (when given) counts the rows that predict <unk>. Returns NgramError::kNone, or
// the first error and its position in *position (<s> after position 0: kBosTarget); rows
// appended before it stay.
inline NgramError PhraseRows(const ModelInfo &model, const uint32_t *ids, std::size_t n, std::vector<uint32_t> *rows,
                             std::vector<uint8_t> *complete, std::size_t *unknown, std::size_t *position) {
  const std::size_t order = model.order;
  std::size_t from = 0;  // first word of the current context
  for (std::size_t pos = 0; pos < n; ++pos) {
    if (ids[pos] == kNonTerminal) {
      from = pos + 1;
      continue;
    }
    if (pos == 0 && ids[pos] == model.bos_id) continue;
    const std::size_t start = pos + 1 - from > order ? pos + 1 - order : from;
    const std::size_t at = rows->size();
    rows->resize(at + order);
    const NgramError error = CanonicalRow(ids + start, pos + 1 - start, model, rows->data() + at);
    if (error != NgramError::kNone) {
      rows->resize(at);
      *position = pos;
      return error;
    }
    // A row whose context the phrase does not hold whole (and which does not start at <s>)
    // is an estimate: the words before the phrase are unknown, not <s>.
    if (pos + 1 - start < order && ids[from] != model.bos_id) {
      for (std::size_t j = 0; j < order - (pos + 1 - start); ++j) (*rows)[at + j] = NoWordId(model);
    }
    if (complete) complete->push_back(pos + 1 - start == order ? 1 : 0);
    if (unknown && ids[pos] == model.unk_id) ++*unknown;
  }
  return NgramError::kNone;
}

// Whether every id of ids[0, n) is a plain word: in the vocabulary and not <s> (so neither
// out of range nor the no-word, and nothing that resets a context). A row of plain words,
// order of them, is its own canonical row.
inline bool PlainWords(const uint32_t *ids, std::size_t n, const ModelInfo &model) {
  bool plain = true;
  for (std::size_t i = 0; i < n; ++i) plain &= (ids[i] < model.vocab_size) & (ids[i] != model.bos_id);
  return plain;
}

// Appends to `rows` the canonical rows of the n-grams that a phrase adds across its left
// boundary: words[0, context) are the words before it (only the last order-1 count; fewer
// mean the sentence starts there), words[context, n) the phrase. The first min(order-1,
// phrase length) words of the phrase are predicted (the later ones have their whole context
// inside the phrase), then, when `completes`, </s> (model.eos_id) after the last order-1
// words. An empty phrase adds nothing (the feature scores no n-gram for it). Returns the
// first error (words are checked as CanonicalRow checks them) or kNone.
// A full context (order-1 words) of plain words takes the window path: CanonicalRow would
// return each row as it stands (nothing to pad, no <s> or no-word to spread), so each row is
// the window of `order` words that ends at the predicted one (the decoder's hot path, one
// check of the words instead of one CanonicalRow per row).
inline NgramError BoundaryRows(const ModelInfo &model, const uint32_t *words, std::size_t context, std::size_t n,
                               bool completes, std::vector<uint32_t> *rows) {
  if (n <= context) return NgramError::kNone;
  const std::size_t order = model.order;
  const std::size_t predicted = std::min<std::size_t>(order - 1, n - context);
  const bool windows = context == order - 1 && PlainWords(words, n, model);
  for (std::size_t pos = context; pos < context + predicted; ++pos) {
    if (windows) {
      rows->insert(rows->end(), words + pos + 1 - order, words + pos + 1);
      continue;
    }
    const std::size_t start = pos + 1 > order ? pos + 1 - order : 0;
    const std::size_t at = rows->size();
    rows->resize(at + order);
    const NgramError error = CanonicalRow(words + start, pos + 1 - start, model, rows->data() + at);
    if (error != NgramError::kNone) {
      rows->resize(at);
      return error;
    }
  }
  if (completes) {
    const std::size_t at = rows->size();
    rows->resize(at + order);
    CanonicalContext(words, n, order - 1, model.bos_id, rows->data() + at);
    (*rows)[at + order - 1] = model.eos_id;
  }
  return NgramError::kNone;
}

// Scores summed in the order given: the one summation of a hypothesis' boundary score,
// so that a prefetched sum and one computed later are the same float.
inline float SumScores(const float *scores, std::size_t n) {
  float sum = 0;
  for (std::size_t i = 0; i < n; ++i) sum += scores[i];
  return sum;
}

// The feature's order= against the served model's order: "" when they agree, else why the
// decoder must stop. A shorter order would send short n-grams, which the server reads as
// sentence starts (left-padded with <s>), and a longer one n-grams the model refuses, so the
// orders must be equal; `nlmserve moses-ini` prints the line with the model's order.
inline std::string OrderMismatch(std::size_t feature_order, uint32_t model_order, const std::string &where) {
  if (feature_order == model_order) return std::string();
  return "order=" + std::to_string(feature_order) + " but the model at " + where + " has order " +
         std::to_string(model_order) + ": write order=" + std::to_string(model_order) +
         " (`nlmserve moses-ini --model MODEL` prints the whole line)";
}

// The facts a decoder would ask GetModelInfo for, from a tables file: its order, vocabulary
// size, special ids, lowercase flag and model hash (a class output's scores are the model's
// self-normalised ones; objective, device and the request limit are the server's, left empty).
inline ModelInfo ModelInfoOf(const TablesFileInfo &file) {
  ModelInfo info;
  info.order = file.order;
  info.vocab_size = file.vocab_size;
  info.bos_id = file.bos_id;
  info.eos_id = file.eos_id;
  info.unk_id = file.unk_id;
  info.model_hash = file.model_hash;
  info.lowercase = file.lowercase;
  info.self_normalized = !file.normalized;
  return info;
}

// With both path= and tables=: "" when the file at `tables` holds the model that `target`
// serves (the same hash, order and vocabulary), else why the decoder must stop.
inline std::string TablesMismatch(const TablesFileInfo &file, const ModelInfo &served, const std::string &tables,
                                  const std::string &target) {
  if (file.model_hash == served.model_hash && file.order == served.order && file.vocab_size == served.vocab_size) {
    return std::string();
  }
  return "tables=" + tables + " holds model " + file.model_hash + " (order " + std::to_string(file.order) + ", " +
         std::to_string(file.vocab_size) + " words), but " + target + " serves model " + served.model_hash +
         " (order " + std::to_string(served.order) + ", " + std::to_string(served.vocab_size) +
         " words): write the file with `nlmserve export-tables --model` of the served model, or drop path= (the "
         "file needs no server)";
}

// A word's id in a tables file's vocabulary by the rule Client::WordId applies: lowercased
// first when the model was trained lowercased (the vocabulary does that itself) or the
// feature asks for it (`lowercase`, its lowercase= option); a word that is not there is <unk>.
inline uint32_t FileWordId(const TablesVocabulary &vocabulary, const std::string &word, bool lowercase) {
  return vocabulary.Id(lowercase && !vocabulary.lowercase() ? Lowercase(word) : word);
}

// Vocabulary ids of a decoder's dense word keys (Moses' Factor::GetId()), each computed
// once and then read without a lock: chunks of kChunkSize ids allocated on first use and
// published with a compare-and-swap. Keys beyond kChunks * kChunkSize are computed on
// every call.
class DenseIdMap {
 public:
  static const std::size_t kChunkBits = 12;
  static const std::size_t kChunkSize = std::size_t(1) << kChunkBits;
  static const std::size_t kChunks = std::size_t(1) << 14;

  DenseIdMap() : chunks_(new std::atomic<std::atomic<uint32_t> *>[kChunks]) {
    for (std::size_t i = 0; i < kChunks; ++i) chunks_[i].store(nullptr, std::memory_order_relaxed);
  }
  ~DenseIdMap() {
    for (std::size_t i = 0; i < kChunks; ++i) delete[] chunks_[i].load(std::memory_order_relaxed);
  }
  DenseIdMap(const DenseIdMap &) = delete;
  DenseIdMap &operator=(const DenseIdMap &) = delete;

  // The id of `key`, from `compute(key)` the first time. Threads asking for a new key at
  // once may each compute it: compute must give every caller the same id.
  template <class F>
  uint32_t Get(std::size_t key, F compute) {
    std::atomic<uint32_t> *chunk = Chunk(key);
    if (chunk == nullptr) return compute(key);
    std::atomic<uint32_t> &slot = chunk[key & (kChunkSize - 1)];
    const uint32_t stored = slot.load(std::memory_order_relaxed);  // id + 1; 0: not yet
    if (stored != 0) return stored - 1;
    const uint32_t id = compute(key);
    slot.store(id + 1, std::memory_order_relaxed);
    return id;
  }

  // Fixes the id of `key` (the decoder's own <s> and </s>).
  void Set(std::size_t key, uint32_t id) {
    std::atomic<uint32_t> *chunk = Chunk(key);
    if (chunk != nullptr) chunk[key & (kChunkSize - 1)].store(id + 1, std::memory_order_relaxed);
  }

 private:
  std::atomic<uint32_t> *Chunk(std::size_t key) {
    const std::size_t c = key >> kChunkBits;
    if (c >= kChunks) return nullptr;
    std::atomic<uint32_t> *chunk = chunks_[c].load(std::memory_order_acquire);
    if (chunk != nullptr) return chunk;
    std::atomic<uint32_t> *fresh = new std::atomic<uint32_t>[kChunkSize];
    for (std::size_t i = 0; i < kChunkSize; ++i) fresh[i].store(0, std::memory_order_relaxed);
    if (chunks_[c].compare_exchange_strong(chunk, fresh, std::memory_order_acq_rel, std::memory_order_acquire)) {
      return fresh;
    }
    delete[] fresh;  // another thread published its chunk first: `chunk` now holds it
    return chunk;
  }

  std::unique_ptr<std::atomic<std::atomic<uint32_t> *>[]> chunks_;
};

// Values of (hypothesis, translation option) pairs (for the expansions of one prefetch):
// an open-addressing table that keeps its memory, and that Clear empties in O(1) by
// starting a new generation. For one thread.
template <class V>
class PairMap {
 public:
  PairMap() : used_(0), generation_(1) {}

  void Clear() {
    used_ = 0;
    if (++generation_ == 0) {  // after 2^32 clears: forget every stamp
      for (std::size_t i = 0; i < slots_.size(); ++i) slots_[i].generation = 0;
      generation_ = 1;
    }
  }

  // Makes room for `n` pairs at once, so that filling the table rehashes nothing.
  void Reserve(std::size_t n) {
    while (2 * n > slots_.size()) Grow();
  }

  // Sets the value of (a, b), replacing an earlier one.
  void Put(const void *a, const void *b, V value) {
    if (2 * (used_ + 1) > slots_.size()) Grow();
    Slot *s = Find(a, b);
    if (s->generation != generation_) {
      s->a = a;
      s->b = b;
      s->generation = generation_;
      ++used_;
    }
    s->value = value;
  }

  bool Get(const void *a, const void *b, V *value) const {
    if (slots_.empty()) return false;
    const Slot *s = const_cast<PairMap *>(this)->Find(a, b);
    if (s->generation != generation_) return false;
    *value = s->value;
    return true;
  }

  std::size_t size() const { return used_; }

 private:
  struct Slot {
    const void *a;
    const void *b;
    V value;
    uint32_t generation;  // live when equal to the table's
  };

  static uint64_t Hash(const void *a, const void *b) {
    uint64_t h = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(a)) * 0x9e3779b97f4a7c15ULL;
    h ^= static_cast<uint64_t>(reinterpret_cast<uintptr_t>(b)) * 0xc2b2ae3d27d4eb4fULL;
    h ^= h >> 32;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 29;
    return h;
  }

  // The slot of (a, b), or the free slot where it would go.
  Slot *Find(const void *a, const void *b) {
    const std::size_t mask = slots_.size() - 1;
    for (std::size_t i = static_cast<std::size_t>(Hash(a, b)) & mask;; i = (i + 1) & mask) {
      Slot &s = slots_[i];
      if (s.generation != generation_ || (s.a == a && s.b == b)) return &s;
    }
  }

  void Grow() {
    std::vector<Slot> old;
    old.swap(slots_);
    Slot empty = {nullptr, nullptr, V(), 0};
    slots_.assign(old.empty() ? 64 : 2 * old.size(), empty);
    const uint32_t live = generation_;
    generation_ = 1;
    used_ = 0;
    for (std::size_t i = 0; i < old.size(); ++i) {
      if (old[i].generation == live) Put(old[i].a, old[i].b, old[i].value);
    }
  }

  std::vector<Slot> slots_;
  std::size_t used_;
  uint32_t generation_;
};

typedef PairMap<float> PairScores;

// The boundary scores of one prefetch's expansions, kept in the order the prefetch
// enumerated them, which is the order in which the decoder then builds and evaluates
// them (Moses' SearchNormal: the stack's hypotheses in turn, for each its spans by start
// and end, each span's options in list order). Get compares the pair asked for with the
// entry at a cursor, a sequential read; only a pair out of that order is looked up in a
// hash table (random reads of a table that, for a stack of many expansions, is larger
// than the processor's caches), which is built the first time it is needed. A lookup
// moves the cursor after the entry found, so the decoder skipping expansions (early
// discarding) costs one lookup per skip, not one per later expansion. For one thread.
class ExpansionScores {
 public:
  enum Found { kNotFound = 0, kInOrder, kLookedUp };

  ExpansionScores() : cursor_(0), indexed_(false) {}

  // Forgets the entries (a new prefetch); keeps the memory.
  void Clear() {
    entries_.clear();
    cursor_ = 0;
    indexed_ = false;
  }

  // Appends the expansion (a, b) with its score, in enumeration order.
  void Add(const void *a, const void *b, float score) {
    const Entry e = {a, b, score};
    entries_.push_back(e);
    indexed_ = false;  // a table built before does not hold it
  }

  // True, with its score, when (a, b) is the entry at the cursor (which then moves on);
  // never looks further.
  bool Next(const void *a, const void *b, float *score) {
    if (cursor_ >= entries_.size()) return false;
    const Entry &e = entries_[cursor_];
    if (e.a != a || e.b != b) return false;
    ++cursor_;
    *score = e.score;
    return true;
  }

  // The score of (a, b): kInOrder when it is the entry at the cursor, kLookedUp when
  // found elsewhere, kNotFound (score untouched) when it was not prefetched. (A decoder
  // makes each expansion once, so a pair is added once; were one added twice, the cursor
  // would give the entry it is at, the lookup the last one.)
  Found Get(const void *a, const void *b, float *score) {
    if (Next(a, b, score)) return kInOrder;
    if (!indexed_) Index();
    uint32_t i;
    if (!index_.Get(a, b, &i)) return kNotFound;
    *score = entries_[i].score;
    cursor_ = i + 1;
    return kLookedUp;
  }

  std::size_t size() const { return entries_.size(); }

 private:
  struct Entry {
    const void *a;
    const void *b;
    float score;
  };

  void Index() {
    index_.Clear();
    index_.Reserve(entries_.size());
    for (std::size_t i = 0; i < entries_.size(); ++i) {
      index_.Put(entries_[i].a, entries_[i].b, static_cast<uint32_t>(i));
    }
    indexed_ = true;
  }

  std::vector<Entry> entries_;
  std::size_t cursor_;
  bool indexed_;
  PairMap<uint32_t> index_;  // (a, b) -> its last entry; built on the first lookup
};

// on-error=floor: after a failed request the server is left alone for a pause of 1 s,
// doubled by each further failure up to 60 s; an answered request resets the doubling.
// Shared by a feature's threads; times are milliseconds of a steady clock.
class ErrorPause {
 public:
  static const int64_t kFirstMs = 1000;
  static const int64_t kLongestMs = 60000;

  // True while a pause lasts: the server is not to be asked.
  bool Paused(int64_t now_ms) const { return now_ms < until_ms_.load(); }
  // A request failed at now_ms: starts the next pause and returns its length.
  int64_t Failed(int64_t now_ms) {
    const int64_t doubled = 2 * pause_ms_.load();
    const int64_t pause = doubled < kFirstMs ? kFirstMs : doubled > kLongestMs ? kLongestMs : doubled;
    pause_ms_.store(pause);
    until_ms_.store(now_ms + pause);
    return pause;
  }
  // A request was answered (written only after failures: threads share this line).
  void Succeeded() {
    if (pause_ms_.load(std::memory_order_relaxed) != 0) pause_ms_.store(0);
  }

 private:
  std::atomic<int64_t> pause_ms_{0};
  std::atomic<int64_t> until_ms_{0};
};

// Which expansions a thread prefetched last: a key (a hypothesis or a stack) and the
// number of the thread's sentence, so that an address a later sentence reuses is not
// taken for the earlier one's.
struct PrefetchMark {
  const void *key = nullptr;
  uint64_t sentence = 0;
  // True, and remembers them, when (key, sentence) differ from the last ones.
  bool Renew(const void *k, uint64_t s) {
    if (k == key && s == sentence) return false;
    key = k;
    sentence = s;
    return true;
  }
};

}  // namespace nlmserve

#endif  // NLMSERVE_DECODER_H
