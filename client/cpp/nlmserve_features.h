// nlmserve direct n-gram features: the hash of a context's newest suffixes and the slot of a
// feature's weight in a hashed table, as a model with direct features (maxent-style weights
// added to each score) computes them.
//
// The contract (the golden file proto/contract/feature_hashes.tsv; the Python owner is
// nlmserve.lm.outputs.class_factored: HASH_*, context_hashes, ngram_feature_index; the wire gives the tables'
// sizes, ScoringTablesChunk in proto/nlmserve/v1/lm.proto): the constants and functions below,
// in 64-bit unsigned arithmetic. The local scorer (nlmserve_tables.h) sums one weight per
// suffix from each of the two tables. Header only, C++11, no gRPC or protobuf.
#ifndef NLMSERVE_FEATURES_H
#define NLMSERVE_FEATURES_H

#include <cstddef>
#include <cstdint>

namespace nlmserve {

// The direct n-gram features' hash (proto/nlmserve/v1/lm.proto, ScoringTablesChunk):
// h_0 = kHashSeed, h_l = (h_{l-1} * kHashCtx + w_{-l} + 1) mod kHashMod over the context's
// newest words; a feature's slot is ((h * kHashKey + y * kHashOut) mod kHashMod) mod size.
// Every product stays below 2^63 (hashes < 2^31, ids < 2^24).
const uint64_t kHashMod = (1ULL << 31) - 1;
const uint64_t kHashSeed = 1000003ULL;
const uint64_t kHashCtx = 1299709ULL;
const uint64_t kHashKey = 1640531527ULL;
const uint64_t kHashOut = 805306457ULL;

// h_l from h_{l-1} and the context's l-th newest word w_{-l}
// (proto/contract/feature_hashes.tsv has cases).
inline uint64_t NextSuffixHash(uint64_t h, uint32_t word) { return (h * kHashCtx + word + 1) % kHashMod; }

inline std::size_t FeatureSlot(uint64_t h, uint32_t y, std::size_t size) {
  return static_cast<std::size_t>(((h * kHashKey + static_cast<uint64_t>(y) * kHashOut) % kHashMod) % size);
}

// FeatureSlot for a table of `size` slots with mask = size - 1 when size is a power of two
// (the recipe's sizes; x & (size - 1) == x mod size then), else 0: no 64-bit division.
inline uint32_t FeatureSlot(uint64_t h, uint32_t y, uint32_t size, uint32_t mask) {
  const uint64_t x = (h * kHashKey + static_cast<uint64_t>(y) * kHashOut) % kHashMod;
  return static_cast<uint32_t>(mask ? (x & mask) : (x % size));
}

// The mask FeatureSlot takes for a table of `size` slots: size - 1 for a power of two, else 0.
inline uint32_t PowerOfTwoMask(uint32_t size) { return size > 1 && (size & (size - 1)) == 0 ? size - 1 : 0; }

}  // namespace nlmserve

#endif  // NLMSERVE_FEATURES_H
