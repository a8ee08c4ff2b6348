// nlmserve scoring tables: a served model's self-normalised score evaluated in the
// caller's process (the Moses feature's scoring=local).
//
// The server exports them (GetScoringTables in proto/nlmserve/v1/lm.proto; the Python
// owner is nlmserve.lm.scoring.ScoringTables); Client::GetScoringTables fetches them. For
// a canonical row w_1 .. w_{n-1} w_n (CanonicalRow's output, n = order):
//
//   r = act(sum_{j=1}^{n-1} position[j-1][w_j])     position: n-1 tables of (V, D)
//   s = r . output[w_n] + bias[w_n]                 natural log
//     [+ sum_l ngram_class[slot(h_l, class[w_n])] + sum_l ngram_word[slot(h_l, w_n)]]
//
// which is what the server answers with allow_unnormalized=true, to float rounding. The
// bracketed sums are a model's direct n-gram features (Features below): the hashes of
// the context's newest suffixes and their slots as the wire contract gives them (the
// Python owner is nlmserve.lm.outputs.class_factored.context_hashes and ngram_feature_index).
//
// A tree-output model's tables (Tree below) give its exact log-probability instead: output
// and bias are the tree's node vectors and biases, and
//
//   s = log sum_{codes c of w_n} prod_{(node, bit) on c} sigmoid(+-(r . output[node] + bias[node]))
//
// (+ where the code goes left, bit 1), about log2 V dot products per row.
//
// The local scorer's contract (the CMake target nlmserve::nlmserve_scorer, header only; the
// client library builds on it, the Moses feature's scoring=local scores with it):
//   Returns   ScoringTables::Score writes one float per row, in NATURAL LOG (Moses' own base:
//             the feature converts nothing): a class output's self-normalised score, which is
//             not an exact log-probability, or a tree output's exact log-probability;
//             normalized() says which. A caller that wants log10 multiplies by log10(e).
//   Rows      canonical rows (CanonicalRow's output: order ids, <s> padding, ids below
//             vocab_size); Score checks nothing, the caller has (as for Client::ScoreRows).
//   Errors    Set returns false when the arrays do not hold together (see Set); Score never
//             fails and never allocates once a Scratch has been sized for the tables.
//   Threads   a ScoringTables is read-only once Set, shared by any number of threads; each
//             thread passes its own Scratch (one thread at a time per Scratch).
//   Forms     the position and output rows are float32, or fp16 or int8 when mapped from a
//             quantised tables file; Score reads them as floats, within the file's error bound
//             (nlmserve_quantize.h states the forms and the bound).
//   Memory    bytes(): the tables, one block ((order-1)*V*D + V*(D+1) floats for a class
//             output, plus the features' tables; fewer bytes per value when quantised):
//             fetched (Client::GetScoringTables), a copy of the process's own on huge pages
//             where the kernel gives them (AdviseHugePages); mapped from a tables file
//             (MapTablesFile), the page cache's pages, one copy for every process of the
//             host. Each Scratch is a few MB more (2^17 remembered rows of a few dozen
//             bytes, 512 context vectors of D floats).
// No gRPC or protobuf here: a decoder includes this header next to its own. The scorer's
// parts are headers of their own, included here: the rows' forms (nlmserve_quantize.h), the
// direct features' hash (nlmserve_features.h), a tree's paths (nlmserve_tree.h), a
// thread's scratch (nlmserve_scratch.h) and where its entries go (nlmserve_scratch_keys.h).
// The tables file (its reader MapTablesFile, its vocabulary and facts) is
// nlmserve_tables_file.h's, which includes this header.
#ifndef NLMSERVE_TABLES_H
#define NLMSERVE_TABLES_H

#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#if defined(__unix__)
#include <sys/mman.h>
#endif

#include "nlmserve_features.h"
#include "nlmserve_quantize.h"
#include "nlmserve_scratch.h"
#include "nlmserve_scratch_keys.h"
#include "nlmserve_tree.h"

namespace nlmserve {

// Asks the kernel to back [p, p + bytes) with huge pages where it can (Linux's transparent
// huge pages in their default "madvise" mode; nothing elsewhere): the 2 MB-aligned part of
// the range, before its pages are first written. The tables are read at random rows, and
// with 4 KB pages nearly every row read also misses the TLB. Only advice: a kernel that
// refuses leaves the memory as it was.
inline void AdviseHugePages(void *p, std::size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const std::size_t huge = std::size_t(2) << 20;
  const std::size_t from = (reinterpret_cast<std::size_t>(p) + huge - 1) & ~(huge - 1);
  const std::size_t to = (reinterpret_cast<std::size_t>(p) + bytes) & ~(huge - 1);
  if (to > from) madvise(reinterpret_cast<void *>(from), to - from, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
#endif
}

enum class Activation { kNone, kTanh, kRelu };

// "none", "tanh", "relu" -> the activation; false for any other name.
inline bool ParseActivation(const std::string &name, Activation *out) {
  if (name == "none" || name.empty()) {
    *out = Activation::kNone;
  } else if (name == "tanh") {
    *out = Activation::kTanh;
  } else if (name == "relu") {
    *out = Activation::kRelu;
  } else {
    return false;
  }
  return true;
}

class ScoringTables {
 public:
  // A model's direct n-gram features: the longest n-gram with a feature (0: none, else
  // 1 .. order) and the sizes of the two hashed tables (0: that table is absent).
  struct Features {
    Features() : order(0), class_table(0), word_table(0) {}
    uint32_t order;
    uint32_t class_table;
    uint32_t word_table;
  };

  // What one thread reuses between calls (nlmserve_scratch.h).
  typedef ScoringScratch Scratch;

  // A tree output's sizes (nlmserve_tree.h).
  typedef TreeShape Tree;

  // Where the tables' values lie: the position rows ((order-1)*V rows of dim values, position
  // j's row of word w being row j*V + w) and the output rows (V rows, or a tree's nodes), in
  // `quantization`'s type (float; kFp16: IEEE half as uint16_t; kInt8: int8_t, with a float
  // scale per row in position_scale and output_scale); then `rest`, the rest_floats floats
  // after them in the wire's array (bias, then with features the word classes and the two
  // tables, with a tree its paths).
  struct Arrays {
    Arrays()
        : quantization(Quantization::kNone), position(nullptr), position_scale(nullptr), output(nullptr),
          output_scale(nullptr), rest(nullptr), rest_floats(0) {}
    Quantization quantization;
    const void *position;
    const float *position_scale;
    const void *output;
    const float *output_scale;
    const float *rest;
    std::size_t rest_floats;
  };

  ScoringTables() {}
  // Takes the wire's array (position, output, bias, and with features word classes,
  // ngram_class, ngram_word; with a tree its node vectors and biases as output and bias,
  // then code_start, step_start and steps) and its shape; false when the array has another
  // size than the shape gives, the features do not fit the model (an order above the
  // model's, a vocabulary of 2^24 words or more, a class id that is not a whole number
  // below 2^24), a tree comes with features, or the tree's paths are not whole numbers that
  // hold together (each word's codes and each code's steps in order, every node below
  // tree.nodes, at most 2^24 of anything).
  bool Set(uint32_t order, uint32_t vocab_size, uint32_t dim, Activation activation, std::string model_hash,
           std::vector<float> data, Features features = Features(), Tree tree = Tree()) {
    std::size_t kept = 0;
    Arrays arrays;
    if (!WireArrays(order, vocab_size, dim, data.data(), data.size(), tree, &arrays) ||
        !Adopt(order, vocab_size, dim, activation, model_hash, arrays, features, tree, &kept)) {
      return false;
    }
    data.resize(kept);  // a tree's paths are kept as integers; shrinking keeps the buffer
    data_.swap(data);   // and so does swapping: the pointers Adopt took stay valid
    mapping_.reset();
    return true;
  }

  // The same from n floats that stay where they are, kept alive by `mapping` (a tables
  // file mapped read-only, MapTablesFile): nothing is copied but the word classes and a
  // tree's paths.
  bool SetMapped(uint32_t order, uint32_t vocab_size, uint32_t dim, Activation activation, std::string model_hash,
                 const float *data, std::size_t n, std::shared_ptr<const void> mapping, Features features = Features(),
                 Tree tree = Tree()) {
    Arrays arrays;
    if (!WireArrays(order, vocab_size, dim, data, n, tree, &arrays)) return false;
    return SetMapped(order, vocab_size, dim, activation, model_hash, arrays, mapping, features, tree);
  }

  // The same from arrays that stay where they are (a tables file's sections, which may be
  // quantised), kept alive by `mapping`; false as for Set, or when the int8 scales are missing.
  bool SetMapped(uint32_t order, uint32_t vocab_size, uint32_t dim, Activation activation, std::string model_hash,
                 const Arrays &arrays, std::shared_ptr<const void> mapping, Features features = Features(),
                 Tree tree = Tree()) {
    std::size_t kept = 0;
    if (!Adopt(order, vocab_size, dim, activation, model_hash, arrays, features, tree, &kept)) return false;
    std::vector<float>().swap(data_);
    mapping_ = mapping;
    return true;
  }

  uint32_t order() const { return order_; }
  uint32_t vocab_size() const { return vocab_size_; }
  uint32_t dim() const { return dim_; }
  Activation activation() const { return activation_; }
  const std::string &model_hash() const { return model_hash_; }
  const Features &features() const { return features_; }
  const Tree &tree() const { return tree_; }
  Quantization quantization() const { return quantization_; }
  // True for a tree output's tables: Score gives log-probabilities, normalised exactly;
  // false for a class output's self-normalised scores.
  bool normalized() const { return tree_.nodes > 0; }
  // The tables' size; for mapped tables (mapped()) most of it is the file's pages, which
  // every process that maps the file shares.
  std::size_t bytes() const { return bytes_ + (word_class_.size() + paths_.size()) * sizeof(uint32_t); }
  bool mapped() const { return mapping_ != nullptr; }

  // The entry of Scratch::rows that keeps a row's score (rows that share one take it from
  // each other).
  std::size_t RowEntryOf(const uint32_t *row) const {
    std::vector<uint64_t> hash(order_ - 1);
    return RowEntry(RowHashes(row, hash.data()));
  }

  // Natural-log scores of n canonical rows (order ids each, ids < vocab_size: the caller
  // has checked them, as for Client::ScoreRows) into out[0, n). Rows are read ahead of the
  // one being scored, so that their cache misses overlap the work of the rows in between:
  // Scratch::kProbeAhead rows on, a row's entry in Scratch::rows is prefetched; kAhead rows
  // on, with features, its table slots are computed and prefetched unless that entry holds
  // its score already (the tables are tens of MB).
  void Score(const uint32_t *rows, std::size_t n, float *out, Scratch *scratch) const {
    switch (quantization_) {
      case Quantization::kFp16:
        ScoreWith<HalfRows>(rows, n, out, scratch);
        break;
      case Quantization::kInt8:
        ScoreWith<Int8Rows>(rows, n, out, scratch);
        break;
      default:
        ScoreWith<FloatRows>(rows, n, out, scratch);
    }
  }

 private:
  // Output row k (a word, or a tree's node) and its scale.
  template <class R>
  const typename R::Value *OutputRow(std::size_t k) const {
    return static_cast<const typename R::Value *>(output_) + k * dim_;
  }
  float OutputScale(std::size_t k) const { return output_scale_ ? output_scale_[k] : 1.f; }

  template <class R>
  void ScoreWith(const uint32_t *rows, std::size_t n, float *out, Scratch *scratch) const {
    const std::size_t width = order_, context = order_ - 1, dim = dim_, per_row = 2 * features_.order;
    const std::size_t memo = tree_.nodes ? std::size_t(1) << Scratch::kNodeBits : 0;
    const std::size_t stride = RowStride(width);
    const std::size_t row_words = (std::size_t(1) << Scratch::kRowBits) * stride + kCacheLine / sizeof(uint32_t);
    const std::size_t ring = Scratch::kAhead + 1;       // rows of slots kept
    const std::size_t lead = Scratch::kProbeAhead + 1;  // rows of hashes kept
    if (scratch->tables != serial_ || scratch->vectors.size() != Scratch::kPrefixes * dim ||
        scratch->keys.size() != Scratch::kPrefixes * context || scratch->slots.size() != ring * per_row ||
        scratch->nodes.size() != memo || scratch->rows.size() != row_words) {
      scratch->vectors.assign(Scratch::kPrefixes * dim, 0.f);
      scratch->keys.assign(Scratch::kPrefixes * context, 0);
      scratch->hashes.assign(Scratch::kPrefixes, 0);
      scratch->lengths.assign(Scratch::kPrefixes, 0);
      scratch->generations.assign(Scratch::kPrefixes, 0);
      scratch->row_hashes.assign(lead * (context + 1), 0);
      scratch->slots.assign(ring * per_row, 0);
      Scratch::Node empty = {0, 0, 0.f, 0.f};
      scratch->nodes.assign(memo, empty);
      scratch->rows.assign(row_words, 0);
      scratch->tables = serial_;
    }
    if (n == 0) return;
    uint32_t *const kept = LineAligned(scratch->rows.data());
    bool slotted[Scratch::kAhead + 1] = {};  // whether a row's slots were computed ahead
    for (std::size_t j = 0; j < Scratch::kProbeAhead && j < n; ++j) ReadAhead(rows, j, kept, scratch);
    for (std::size_t j = 0; j < Scratch::kAhead && j < n; ++j) {
      slotted[j] = per_row > 0;
      if (per_row) RowSlots(rows + j * width, scratch->slots.data() + j * per_row);
    }
    for (std::size_t i = 0; i < n; ++i) {
      const uint32_t *row = rows + i * width;
      if (i + Scratch::kProbeAhead < n) ReadAhead(rows, i + Scratch::kProbeAhead, kept, scratch);
      if (per_row && i + Scratch::kAhead < n) {
        const std::size_t j = i + Scratch::kAhead;
        const uint64_t *ahead = scratch->row_hashes.data() + (j % lead) * (context + 1);
        slotted[j % ring] =
            !RowHolds(kept + RowEntry(ahead[context]) * stride, ahead[context], rows + j * width, width);
        if (slotted[j % ring]) RowSlots(rows + j * width, scratch->slots.data() + (j % ring) * per_row);
      }
      const uint64_t *hash = scratch->row_hashes.data() + (i % lead) * (context + 1);
      const uint64_t h = hash[context];
      uint32_t *const entry = kept + RowEntry(h) * stride;
      if (RowHolds(entry, h, row, width)) {
        std::memcpy(out + i, entry + 2, sizeof(float));
        ++scratch->rows_remembered;
        continue;
      }
      const uint32_t w = row[context];
      uint64_t generation = 0;
      const float *r = Context<R>(row, hash, scratch, &generation);
      float s;
      if (tree_.nodes) {
        s = TreeScore<R>(r, generation, w, scratch);
      } else {
        s = R::Dot(r, OutputRow<R>(w), OutputScale(w), dim) + bias_[w];
        if (per_row) {
          uint32_t *slots = scratch->slots.data() + (i % ring) * per_row;
          // Remembered when its slots were due, but its entry was taken since by a row
          // between (two rows of one entry).
          if (!slotted[i % ring]) RowSlots(row, slots);
          s += FeatureSum(slots);
        }
      }
      entry[0] = static_cast<uint32_t>(h);
      entry[1] = static_cast<uint32_t>(h >> 32);
      std::memcpy(entry + 2, &s, sizeof(float));
      for (std::size_t j = 0; j < width; ++j) entry[3 + j] = row[j];
      out[i] = s;
    }
  }

  // The wire's array data[0, n) as Arrays: position, output, then the rest; false when n is
  // too small for the position and output rows of this shape.
  static bool WireArrays(uint32_t order, uint32_t vocab_size, uint32_t dim, const float *data, std::size_t n,
                         const Tree &tree, Arrays *arrays) {
    const std::size_t outputs = tree.nodes ? tree.nodes : vocab_size;
    const std::size_t position = static_cast<std::size_t>(order > 0 ? order - 1 : 0) * vocab_size * dim;
    const std::size_t rows = position + outputs * dim;
    if (n < rows) return false;
    arrays->quantization = Quantization::kNone;
    arrays->position = data;
    arrays->output = data + position;
    arrays->rest = data + rows;
    arrays->rest_floats = n - rows;
    return true;
  }

  // Set's checks and pointers over the arrays: false, changing nothing, when they fail; else
  // *kept is how many floats of a wire array the tables read (a tree's paths, after them,
  // are copied).
  bool Adopt(uint32_t order, uint32_t vocab_size, uint32_t dim, Activation activation, const std::string &model_hash,
             const Arrays &arrays, Features features, Tree tree, std::size_t *kept) {
    if (order < 2 || vocab_size == 0 || dim == 0) return false;
    const bool featured = features.order > 0, treed = tree.nodes > 0;
    if (featured && (treed || features.order > order || vocab_size >= (1u << 24) ||
                     (features.class_table == 0 && features.word_table == 0))) {
      return false;
    }
    if (!featured) features = Features();
    if (!treed) tree = Tree();
    const bool scaled = arrays.quantization == Quantization::kInt8;
    if (arrays.position == nullptr || arrays.output == nullptr || arrays.rest == nullptr ||
        (scaled && (arrays.position_scale == nullptr || arrays.output_scale == nullptr))) {
      return false;
    }
    const std::size_t outputs = treed ? tree.nodes : vocab_size;
    const std::size_t positions = static_cast<std::size_t>(order - 1) * vocab_size;
    const std::size_t want =
        outputs + (featured ? static_cast<std::size_t>(vocab_size) + features.class_table + features.word_table : 0) +
        (treed ? static_cast<std::size_t>(vocab_size) + 1 + tree.codes + 1 + tree.steps : 0);
    if (arrays.rest_floats != want) return false;
    const float *rest = arrays.rest;
    std::vector<uint32_t> word_class, paths;
    if (featured) {
      word_class.resize(vocab_size);
      for (std::size_t w = 0; w < vocab_size; ++w) {
        if (!WholeNumber(rest[outputs + w], &word_class[w])) return false;
      }
    }
    if (treed) {
      paths.resize(want - outputs);
      for (std::size_t i = 0; i < paths.size(); ++i) {
        if (!WholeNumber(rest[outputs + i], &paths[i])) return false;
      }
      if (!TreePathsHold(paths, vocab_size, tree)) return false;
    }
    const std::size_t value = arrays.quantization == Quantization::kFp16   ? sizeof(uint16_t)
                              : arrays.quantization == Quantization::kInt8 ? sizeof(int8_t)
                                                                           : sizeof(float);
    order_ = order;
    vocab_size_ = vocab_size;
    dim_ = dim;
    activation_ = activation;
    model_hash_ = model_hash;
    features_ = features;
    class_mask_ = PowerOfTwoMask(features.class_table);
    word_mask_ = PowerOfTwoMask(features.word_table);
    tree_ = tree;
    word_class_.swap(word_class);
    paths_.swap(paths);
    code_start_ = paths_.data();
    step_start_ = code_start_ + (treed ? vocab_size + 1 : 0);
    steps_ = step_start_ + (treed ? tree.codes + 1 : 0);
    quantization_ = arrays.quantization;
    position_ = arrays.position;
    position_scale_ = scaled ? arrays.position_scale : nullptr;
    output_ = arrays.output;
    output_scale_ = scaled ? arrays.output_scale : nullptr;
    const std::size_t rest_kept = treed ? outputs : arrays.rest_floats;
    bytes_ = (positions + outputs) * dim * value + (scaled ? (positions + outputs) * sizeof(float) : 0) +
             rest_kept * sizeof(float);
    *kept = (positions + outputs) * dim + rest_kept;
    bias_ = rest;
    ngram_class_ = bias_ + 2 * static_cast<std::size_t>(vocab_size);
    ngram_word_ = ngram_class_ + features.class_table;
    serial_ = NextSerial();
    return true;
  }

  static uint64_t NextSerial() {
    static std::atomic<uint64_t> next(0);
    return ++next;
  }

  // A row's PrefixHashes into hash[0, order-1), and its RowHash: where a row goes in
  // Scratch::rows (RowEntry) and how its entry is checked (Holds).
  uint64_t RowHashes(const uint32_t *row, uint64_t *hash) const {
    PrefixHashes(row, order_, hash);
    return RowHash(hash[order_ - 2], row[order_ - 1]);
  }

  // Row j's PrefixHashes and RowHash into its place in Scratch::row_hashes (order words:
  // the prefixes', then the row's), and its entry prefetched.
  void ReadAhead(const uint32_t *rows, std::size_t j, const uint32_t *kept, Scratch *scratch) const {
    const std::size_t context = order_ - 1;
    const uint32_t *row = rows + j * order_;
    uint64_t *hash = scratch->row_hashes.data() + (j % (Scratch::kProbeAhead + 1)) * (context + 1);
    hash[context] = RowHashes(row, hash);
    Prefetch(kept + RowEntry(hash[context]) * RowStride(order_));
  }

  // r = act(sum_j position[j][row[j]]) for the row's context, from the longest of its
  // prefixes in the scratch; the prefixes it sums are put there. The sum runs over j in
  // order, whatever prefix it starts from, so the floats do not depend on the entries.
  // hash: the row's PrefixHashes. *generation: the generation of the context's entry.
  template <class R>
  const float *Context(const uint32_t *row, const uint64_t *hash, Scratch *scratch, uint64_t *generation) const {
    const std::size_t context = order_ - 1, dim = dim_;
    std::size_t m = context, at = 0;
    for (; m > 0; --m) {
      at = PrefixSlot(hash[m - 1]);
      if (scratch->lengths[at] == m && scratch->hashes[at] == hash[m - 1] &&
          SameIds(scratch->keys.data() + at * context, row, m)) {
        break;
      }
    }
    const float *sum = m > 0 ? scratch->vectors.data() + at * dim : nullptr;
    if (m == context) {
      *generation = scratch->generations[at];
      return sum;
    }
    float *to = nullptr;
    for (std::size_t j = m; j < context; ++j) {
      const std::size_t slot = PrefixSlot(hash[j]);
      to = scratch->vectors.data() + slot * dim;  // may be sum's own entry: d by d, in place
      if (row[j] == vocab_size_) {  // no word: adds nothing
        if (sum == nullptr) {
          for (std::size_t d = 0; d < dim; ++d) to[d] = 0.f;
        } else if (to != sum) {
          for (std::size_t d = 0; d < dim; ++d) to[d] = sum[d];
        }
      } else {
        const std::size_t at = j * vocab_size_ + row[j];
        const typename R::Value *p = static_cast<const typename R::Value *>(position_) + at * dim;
        const float scale = position_scale_ ? position_scale_[at] : 1.f;
        if (sum == nullptr) {
          R::Copy(to, p, scale, dim);
        } else {
          R::Add(to, sum, p, scale, dim);
        }
      }
      uint32_t *key = scratch->keys.data() + slot * context;
      for (std::size_t k = 0; k <= j; ++k) key[k] = row[k];
      scratch->hashes[slot] = hash[j];
      scratch->lengths[slot] = static_cast<uint32_t>(j + 1);
      *generation = scratch->generations[slot] = ++scratch->generation;
      sum = to;
    }
    scratch->rows_added += context - m;
    if (activation_ == Activation::kTanh) {
      for (std::size_t d = 0; d < dim; ++d) to[d] = std::tanh(to[d]);
    } else if (activation_ == Activation::kRelu) {
      for (std::size_t d = 0; d < dim; ++d) to[d] = to[d] > 0.f ? to[d] : 0.f;
    }
    return to;
  }

  // TreeLogProb for the context r of the given generation: a node's pair of log-sigmoids
  // comes from the scratch when this context has met the node recently.
  template <class R>
  float TreeScore(const float *r, uint64_t generation, uint32_t w, Scratch *scratch) const {
    return TreeLogProb(code_start_, step_start_, steps_, w, [&](uint32_t node) -> const Scratch::Node & {
      Scratch::Node &e = scratch->nodes[NodeSlot(generation, node)];
      if (e.generation != generation || e.node != node) {
        const double x = R::Dot(r, OutputRow<R>(node), OutputScale(node), dim_) + bias_[node];
        const double left = -(std::log1p(std::exp(-std::fabs(x))) + (x < 0 ? -x : 0.0));  // log sigmoid(x)
        e.generation = generation;
        e.node = node;
        e.left = static_cast<float>(left);
        e.right = static_cast<float>(left - x);  // log sigmoid(-x) = log sigmoid(x) - x
        ++scratch->nodes_computed;
      }
      return e;
    });
  }

  // A float of the wire's integer fields: a whole number in [0, 2^24).
  static bool WholeNumber(float f, uint32_t *out) {
    if (!(f >= 0.f && f < 16777216.f) || f != std::floor(f)) return false;
    *out = static_cast<uint32_t>(f);
    return true;
  }

  // The row's feature slots into slots[0, 2 * features_.order): the class table's for
  // the context suffixes of length l = 0 .. order-1 (h_l as the wire gives it), then the
  // word table's; each slot's weight is prefetched. A table that is absent gets slots of 0
  // that FeatureSum skips.
  void RowSlots(const uint32_t *row, uint32_t *slots) const {
    const std::size_t context = order_ - 1, m = features_.order;
    const uint32_t w = row[context], c = word_class_[w];
    uint64_t h = kHashSeed;
    for (std::size_t l = 0; l < m; ++l) {
      if (l > 0 && row[context - l] == vocab_size_) {  // no word: no longer suffix either
        for (; l < m; ++l) slots[l] = slots[m + l] = kNoSlot;
        break;
      }
      if (l > 0) h = NextSuffixHash(h, row[context - l]);
      if (features_.class_table) {
        slots[l] = FeatureSlot(h, c, features_.class_table, class_mask_);
        Prefetch(ngram_class_ + slots[l]);
      }
      if (features_.word_table) {
        slots[m + l] = FeatureSlot(h, w, features_.word_table, word_mask_);
        Prefetch(ngram_word_ + slots[m + l]);
      }
    }
  }

  static void Prefetch(const void *p) {
#if defined(__GNUC__)
    __builtin_prefetch(p);
#else
    (void)p;
#endif
  }

  // The features' weights at the row's slots, summed as the model sums them: each table
  // over the suffixes, then the two.
  float FeatureSum(const uint32_t *slots) const {
    const std::size_t m = features_.order;
    float by_class = 0.f, by_word = 0.f;
    if (features_.class_table) {
      for (std::size_t l = 0; l < m && slots[l] != kNoSlot; ++l) by_class += ngram_class_[slots[l]];
    }
    if (features_.word_table) {
      for (std::size_t l = 0; l < m && slots[m + l] != kNoSlot; ++l) by_word += ngram_word_[slots[m + l]];
    }
    return by_class + by_word;
  }

  static const uint32_t kNoSlot = 0xffffffffu;  // RowSlots: a suffix that holds no word

  uint32_t order_ = 0;
  uint32_t vocab_size_ = 0;
  uint32_t dim_ = 0;
  Activation activation_ = Activation::kNone;
  std::string model_hash_;
  Features features_;
  uint32_t class_mask_ = 0;  // PowerOfTwoMask of each table's size
  uint32_t word_mask_ = 0;
  std::vector<uint32_t> word_class_;  // with features: each word's class
  Tree tree_;
  std::vector<uint32_t> paths_;  // with a tree: code_start, step_start, steps
  const uint32_t *code_start_ = nullptr;
  const uint32_t *step_start_ = nullptr;
  const uint32_t *steps_ = nullptr;
  std::vector<float> data_;                // the floats when they were given (Set)
  std::shared_ptr<const void> mapping_;    // or what keeps them mapped (SetMapped)
  Quantization quantization_ = Quantization::kNone;
  const void *position_ = nullptr;         // Arrays::position, of the quantisation's type
  const float *position_scale_ = nullptr;  // kInt8: a scale per position row
  const void *output_ = nullptr;           // Arrays::output
  const float *output_scale_ = nullptr;    // kInt8: a scale per output row
  std::size_t bytes_ = 0;                  // of the rows, their scales and the floats read
  const float *bias_ = nullptr;            // Arrays::rest
  const float *ngram_class_ = nullptr;  // with features: the hashed tables after the bias and classes
  const float *ngram_word_ = nullptr;
  uint64_t serial_ = 0;  // NextSerial() of the last Set: which scratch entries are this table's
};

}  // namespace nlmserve

#endif  // NLMSERVE_TABLES_H
