// nlmserve tree output: a tree-output model's words as codes, paths of (node, bit) steps
// through a binary tree (Mnih & Hinton's hierarchical log-bilinear model; a word may have
// several codes), and the exact log-probability the paths give.
//
// The contract (the wire's tree_nodes, tree_codes, tree_steps and the paths' arrays,
// ScoringTablesChunk in proto/nlmserve/v1/lm.proto; the Python owner is
// nlmserve.lm.scoring.ScoringTables): code_start (V+1 entries) gives each word's codes,
// step_start (codes+1) each code's steps, a step is node * 2 + bit (bit 1: the code goes
// left); TreePathsHold checks them, TreeLogProb sums them:
//
//   log P(w) = log sum_{codes c of w} prod_{(node, bit) on c} sigmoid(+-x_node)
//
// (+ where the code goes left), with x_node = r . output[node] + bias[node]. The local scorer
// (nlmserve_tables.h) gives TreeLogProb the log-sigmoids of each node. Header only, C++11.
#ifndef NLMSERVE_TREE_H
#define NLMSERVE_TREE_H

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace nlmserve {

// A tree output's sizes (the wire's tree_nodes, tree_codes, tree_steps; nodes 0: the
// tables are a class output's). ScoringTables::Tree.
struct TreeShape {
  TreeShape() : nodes(0), codes(0), steps(0) {}
  uint32_t nodes;
  uint32_t codes;
  uint64_t steps;
};

// paths = code_start (V+1), step_start (codes+1), steps hold together: both starts run from 0
// up to the next array's size, every code is a path of one node at least, and every step is a
// node of the tree.
inline bool TreePathsHold(const std::vector<uint32_t> &paths, uint32_t vocab_size, const TreeShape &tree) {
  const uint32_t *code_start = paths.data(), *step_start = code_start + vocab_size + 1,
                 *steps = step_start + tree.codes + 1;
  if (code_start[0] != 0 || code_start[vocab_size] != tree.codes) return false;
  for (uint32_t w = 0; w < vocab_size; ++w) {
    if (code_start[w] > code_start[w + 1]) return false;
  }
  if (step_start[0] != 0 || step_start[tree.codes] != tree.steps) return false;
  for (uint32_t c = 0; c < tree.codes; ++c) {
    if (step_start[c] >= step_start[c + 1]) return false;
  }
  for (uint64_t k = 0; k < tree.steps; ++k) {
    if ((steps[k] >> 1) >= tree.nodes) return false;
  }
  return true;
}

// log sum_c prod sigmoid(+-x) over w's codes: each code's sum of log-sigmoids, then the
// codes' log-sum-exp (-inf for a word without a code). node_pair(node) gives an object whose
// `left` is log sigmoid(x_node) and `right` log sigmoid(-x_node).
template <class NodePair>
inline float TreeLogProb(const uint32_t *code_start, const uint32_t *step_start, const uint32_t *steps, uint32_t w,
                         NodePair node_pair) {
  const uint32_t first = code_start[w], last = code_start[w + 1];
  double best = -INFINITY, codes[2];
  std::vector<double> more;  // a word with more than two codes (Mnih & Hinton's adaptive trees)
  for (uint32_t c = first; c < last; ++c) {
    double lp = 0.0;
    for (uint32_t k = step_start[c]; k < step_start[c + 1]; ++k) {
      const auto &e = node_pair(steps[k] >> 1);
      lp += steps[k] & 1 ? e.left : e.right;
    }
    if (c - first < 2) {
      codes[c - first] = lp;
    } else {
      more.push_back(lp);
    }
    if (lp > best) best = lp;
  }
  if (last - first <= 1) return static_cast<float>(best);  // one code (or none: -inf)
  double sum = std::exp(codes[0] - best) + std::exp(codes[1] - best);
  for (double lp : more) sum += std::exp(lp - best);
  return static_cast<float>(best + std::log(sum));
}

}  // namespace nlmserve

#endif  // NLMSERVE_TREE_H
