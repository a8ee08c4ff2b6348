// nlmserve scorer scratch: what one thread of the local scorer (nlmserve_tables.h) reuses
// between calls of ScoringTables::Score, so that scoring allocates nothing per row.
//
// The contract: a ScoringScratch (ScoringTables::Scratch) belongs to one thread at a time;
// it may be passed to any tables, and is resized and emptied when the tables it is given are
// not the ones that used it last; what it remembers never changes a score (a remembered value
// is the float computed the first time). Its counters (rows_added, nodes_computed,
// rows_remembered) are for reports. Header only, C++11, no gRPC or protobuf.
#ifndef NLMSERVE_SCRATCH_H
#define NLMSERVE_SCRATCH_H

#include <cstddef>
#include <cstdint>
#include <vector>

namespace nlmserve {

// What one thread reuses between calls: the sums of the position rows of recent context
// prefixes. A decoder's rows come in groups that share their oldest context words (the
// expansions of one hypothesis: its last words, shifted by the first t words of each
// phrase), so a row whose first m context words were summed before adds only its other
// order-1-m rows, to the same floats as summing them all. Entries are direct-mapped by a
// hash of the prefix; an entry of a whole context holds the vector after the activation.
// With features, the table slots of the row being scored and of the next kAhead rows. A
// scratch belongs to the tables that last used it (Set makes them new tables).
//
// With a tree, the log-sigmoids of recent (context, node) pairs: the expansions of one
// hypothesis share their context, and the words they predict share the upper nodes of
// their paths. An entry names its context by the generation of the context's entry (a
// number given each time an entry is written, never reused), so it can only ever hold
// that context's values; entries are direct-mapped by a hash of (generation, node).
//
// The scores of recent rows, direct-mapped by a hash of the row and checked against its
// ids: a decoder asks for the same n-gram again and again (two thirds of its rows are
// other hypotheses ending in the same words), and a row costs more than one probe (a
// tree's dot products and log-sigmoids; a class output's dot product of an output row that
// is seldom in cache, and its features' weights). An entry is [hash (two words), score,
// the row's ids], one probe of memory (a 5-gram's 32 bytes never straddle two cache
// lines), prefetched kProbeAhead rows before the row is scored (the entries are too many
// for the processor's caches, and a remembered row is answered in far less time than a
// miss to memory takes: kProbeAhead and kAhead below decoded faster than 3 and 2, and
// than 32 and 10; experiments/results.md, experiments/moses-decoder.md). A
// remembered score is the float computed the first time, which is what computing it
// again gives. They stand in for the client's NgramCache
// (ngram_cache.h), which scoring=local turns off: one thread's, so no lock and no LRU
// window, and their hash extends the prefix hashes Context needs anyway (RowHashes),
// where the cache's HashRow would hash the row again.
struct ScoringScratch {
  static const unsigned kPrefixBits = 9;
  static const std::size_t kPrefixes = std::size_t(1) << kPrefixBits;
  static const unsigned kNodeBits = 13;
  static const unsigned kRowBits = 17;
  static const std::size_t kAhead = 6;        // rows whose feature slots are prefetched ahead
  static const std::size_t kProbeAhead = 16;  // rows whose entries in `rows` are prefetched ahead
  struct Node {
    uint64_t generation;  // 0: empty
    uint32_t node;
    float left, right;  // log sigmoid(x), log sigmoid(-x)
  };
  std::vector<float> vectors;        // kPrefixes x dim
  std::vector<uint32_t> keys;        // kPrefixes x (order-1): the prefix's words
  std::vector<uint64_t> hashes;      // kPrefixes: the prefix's hash
  std::vector<uint32_t> lengths;     // kPrefixes: the prefix's length (0: empty)
  std::vector<uint64_t> generations; // kPrefixes: when the entry was written
  std::vector<uint64_t> row_hashes;  // kProbeAhead + 1 rows x order: a row's PrefixHashes, its RowHash
  std::vector<uint32_t> slots;       // kAhead + 1 rows x 2 tables x feature order
  std::vector<Node> nodes;           // with a tree: 2^kNodeBits (context, node) entries
  std::vector<uint32_t> rows;        // 2^kRowBits scored rows (RowStride words each)
  uint64_t tables = 0;               // the serial of the tables the entries belong to
  uint64_t generation = 0;           // the last generation given
  uint64_t rows_added = 0;           // position rows summed, a count for reports
  uint64_t nodes_computed = 0;       // tree nodes' dot products computed, a count for reports
  uint64_t rows_remembered = 0;      // rows whose score came from `rows`, a count for reports
};

}  // namespace nlmserve

#endif  // NLMSERVE_SCRATCH_H
