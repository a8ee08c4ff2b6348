// nlmserve scoring tables: a served model's self-normalised score evaluated in the
// caller's process (the Moses feature's scoring=local).
//
// The server exports them (GetScoringTables in proto/nlmserve/v1/lm.proto; the Python
// owner is nlmserve.lm.scoring.ScoringTables); Client::GetScoringTables fetches them. For
// a canonical row w_1 .. w_{n-1} w_n (CanonicalRow's output, n = order):
//
//   r = act(sum_{j=1}^{n-1} position[j-1][w_j])     position: n-1 tables of (V, D)
//   s = r . output[w_n] + bias[w_n]                 natural log
//
// which is what the server answers with allow_unnormalized=true, to float rounding. No
// gRPC or protobuf here: a decoder includes this header next to its own.
#ifndef NLMSERVE_TABLES_H
#define NLMSERVE_TABLES_H

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace nlmserve {

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
  // What one thread reuses between calls: the context vectors of the last few distinct
  // contexts (a decoder's batch asks for many words after one context in a row, or
  // nearly so), direct-mapped by a hash of the context.
  struct Scratch {
    static const std::size_t kSlots = 64;
    std::vector<float> vectors;   // kSlots x dim
    std::vector<uint32_t> keys;   // kSlots x (order-1)
    std::vector<uint8_t> used;    // kSlots
  };

  ScoringTables() {}
  // Takes the wire's array (position, output, bias) and its shape; false when the array
  // has another size than the shape gives.
  bool Set(uint32_t order, uint32_t vocab_size, uint32_t dim, Activation activation, std::string model_hash,
           std::vector<float> data) {
    if (order < 2 || vocab_size == 0 || dim == 0) return false;
    const std::size_t want = static_cast<std::size_t>(order) * vocab_size * dim + vocab_size;
    if (data.size() != want) return false;
    order_ = order;
    vocab_size_ = vocab_size;
    dim_ = dim;
    activation_ = activation;
    model_hash_ = model_hash;
    data_.swap(data);
    output_ = data_.data() + static_cast<std::size_t>(order - 1) * vocab_size * dim;
    bias_ = output_ + static_cast<std::size_t>(vocab_size) * dim;
    return true;
  }

  uint32_t order() const { return order_; }
  uint32_t vocab_size() const { return vocab_size_; }
  uint32_t dim() const { return dim_; }
  Activation activation() const { return activation_; }
  const std::string &model_hash() const { return model_hash_; }
  std::size_t bytes() const { return data_.size() * sizeof(float); }

  // Natural-log scores of n canonical rows (order ids each, ids < vocab_size: the caller
  // has checked them, as for Client::ScoreRows) into out[0, n).
  void Score(const uint32_t *rows, std::size_t n, float *out, Scratch *scratch) const {
    const std::size_t width = order_, context = order_ - 1, dim = dim_;
    if (scratch->used.size() != Scratch::kSlots || scratch->vectors.size() != Scratch::kSlots * dim ||
        scratch->keys.size() != Scratch::kSlots * context) {
      scratch->vectors.assign(Scratch::kSlots * dim, 0.f);
      scratch->keys.assign(Scratch::kSlots * context, 0);
      scratch->used.assign(Scratch::kSlots, 0);
    }
    for (std::size_t i = 0; i < n; ++i) {
      const uint32_t *row = rows + i * width;
      const std::size_t slot = Slot(row, context);
      float *r = scratch->vectors.data() + slot * dim;
      uint32_t *key = scratch->keys.data() + slot * context;
      if (!scratch->used[slot] || !Equal(key, row, context)) {
        Encode(row, r);
        for (std::size_t j = 0; j < context; ++j) key[j] = row[j];
        scratch->used[slot] = 1;
      }
      const uint32_t w = row[context];
      const float *q = output_ + static_cast<std::size_t>(w) * dim;
      out[i] = Dot(r, q, dim) + bias_[w];
    }
  }

 private:
  static std::size_t Slot(const uint32_t *ids, std::size_t n) {
    uint64_t h = 0x9e3779b97f4a7c15ULL;
    for (std::size_t j = 0; j < n; ++j) h = (h ^ ids[j]) * 0xff51afd7ed558ccdULL;
    return static_cast<std::size_t>(h >> 58);  // top 6 bits: kSlots = 64
  }

  // Eight partial sums, so that the compiler can keep them in one vector register
  // (a single running sum is a dependency chain it may not reorder).
  static float Dot(const float *a, const float *b, std::size_t n) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    std::size_t d = 0;
    for (; d + 8 <= n; d += 8) {
      for (std::size_t k = 0; k < 8; ++k) acc[k] += a[d + k] * b[d + k];
    }
    float s = 0.f;
    for (; d < n; ++d) s += a[d] * b[d];
    for (std::size_t k = 0; k < 8; ++k) s += acc[k];
    return s;
  }

  static bool Equal(const uint32_t *a, const uint32_t *b, std::size_t n) {
    for (std::size_t j = 0; j < n; ++j) {
      if (a[j] != b[j]) return false;
    }
    return true;
  }

  // r = act(sum_j position[j][row[j]]).
  void Encode(const uint32_t *row, float *r) const {
    const std::size_t dim = dim_, context = order_ - 1;
    const float *p0 = data_.data() + static_cast<std::size_t>(row[0]) * dim;
    for (std::size_t d = 0; d < dim; ++d) r[d] = p0[d];
    for (std::size_t j = 1; j < context; ++j) {
      const float *p = data_.data() + (j * vocab_size_ + row[j]) * dim;
      for (std::size_t d = 0; d < dim; ++d) r[d] += p[d];
    }
    if (activation_ == Activation::kTanh) {
      for (std::size_t d = 0; d < dim; ++d) r[d] = std::tanh(r[d]);
    } else if (activation_ == Activation::kRelu) {
      for (std::size_t d = 0; d < dim; ++d) r[d] = r[d] > 0.f ? r[d] : 0.f;
    }
  }

  uint32_t order_ = 0;
  uint32_t vocab_size_ = 0;
  uint32_t dim_ = 0;
  Activation activation_ = Activation::kNone;
  std::string model_hash_;
  std::vector<float> data_;
  const float *output_ = nullptr;
  const float *bias_ = nullptr;
};

}  // namespace nlmserve

#endif  // NLMSERVE_TABLES_H
