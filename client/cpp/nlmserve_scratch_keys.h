// nlmserve scorer scratch keys: where the local scorer (nlmserve_tables.h) puts and finds an
// entry of a thread's ScoringScratch (nlmserve_scratch.h): the hashes of a row's context
// prefixes and of the whole row, the slot each goes to, and the layout of a remembered row.
//
// The contract: every function is pure (the same arguments give the same answer in every
// process and thread) and allocates nothing. A hash only picks the slot an entry is
// direct-mapped to; an entry is used only once its ids are compared (RowHolds, SameIds) or,
// for a tree node, its context's generation, so two rows that share a hash cost a miss,
// never a wrong score. The slots index the scratch's arrays of 2^kPrefixBits, 2^kRowBits and
// 2^kNodeBits entries. Header only, C++11, no gRPC or protobuf.
#ifndef NLMSERVE_SCRATCH_KEYS_H
#define NLMSERVE_SCRATCH_KEYS_H

#include <cstddef>
#include <cstdint>

#include "nlmserve_scratch.h"

namespace nlmserve {

// hash[j]: a hash of the row's first j + 1 words, j = 0 .. order-2.
inline void PrefixHashes(const uint32_t *row, std::size_t order, uint64_t *hash) {
  uint64_t h = 0x9e3779b97f4a7c15ULL;
  for (std::size_t j = 0; j + 1 < order; ++j) {
    h = (h ^ row[j]) * 0xff51afd7ed558ccdULL;
    hash[j] = h;
  }
}

// A hash of a whole row from its context's (PrefixHashes) and its word; never 0, the
// hash of an empty entry.
inline uint64_t RowHash(uint64_t context, uint32_t w) {
  uint64_t h = (context ^ (w + 0x9e3779b97f4a7c15ULL)) * 0xc4ceb9fe1a85ec53ULL;
  return (h ^ (h >> 29)) | 1;
}

// Whether the n ids at a and at b are the same.
inline bool SameIds(const uint32_t *a, const uint32_t *b, std::size_t n) {
  for (std::size_t j = 0; j < n; ++j) {
    if (a[j] != b[j]) return false;
  }
  return true;
}

// Words per remembered row of `width` ids in ScoringScratch::rows: its hash (two), its score,
// its ids.
inline std::size_t RowStride(std::size_t width) { return 3 + width; }

// The first cache-line boundary at or after p (ScoringScratch::rows has a line to spare), so
// that an entry of a 5-gram, 32 bytes, never straddles two lines.
const std::size_t kCacheLine = 64;
inline uint32_t *LineAligned(uint32_t *p) {
  const std::size_t at = reinterpret_cast<std::size_t>(p);
  return reinterpret_cast<uint32_t *>((at + kCacheLine - 1) & ~(kCacheLine - 1));
}

// The entry of ScoringScratch::rows a row of this RowHash goes to.
inline std::size_t RowEntry(uint64_t hash) {
  return static_cast<std::size_t>(hash >> (64 - ScoringScratch::kRowBits));
}

// Whether a remembered row's entry holds the row of this RowHash.
inline bool RowHolds(const uint32_t *entry, uint64_t hash, const uint32_t *row, std::size_t width) {
  return entry[0] == static_cast<uint32_t>(hash) && entry[1] == static_cast<uint32_t>(hash >> 32) &&
         SameIds(entry + 3, row, width);
}

// The entry of ScoringScratch's prefix arrays a context prefix of this hash goes to.
inline std::size_t PrefixSlot(uint64_t hash) {
  return static_cast<std::size_t>(hash >> (64 - ScoringScratch::kPrefixBits));
}

// The entry of ScoringScratch::nodes a tree node goes to for the context of this generation.
inline std::size_t NodeSlot(uint64_t generation, uint32_t node) {
  return static_cast<std::size_t>(((generation * 0x9e3779b97f4a7c15ULL) ^ (node * 0xff51afd7ed558ccdULL)) >>
                                  (64 - ScoringScratch::kNodeBits));
}

}  // namespace nlmserve

#endif  // NLMSERVE_SCRATCH_KEYS_H
