// What one thread keeps for one NeuralLMServer feature (NeuralLMServer.h), shared by the
// feature's two files: NeuralLMServer.cpp (loading, the scores Moses asks for, the hypothesis
// state) and NeuralLMServerPrefetch.cpp (the n-grams scored ahead of Moses' asking, in batches).
//
// Contract:
//   Local(feature)    the calling thread's NeuralLMServerThread of that feature, made empty on
//                     first use and kept for the thread's life; only that thread touches it, so
//                     nothing in it is locked.
//   SentenceSerial()  the calling thread's count of sentences started (InitializeForInput adds
//                     one): a prefetch is renewed per sentence by it, so that the pointers of an
//                     earlier sentence that a later one reuses are never mistaken for its own.
//   SteadyMs()        a monotonic clock in milliseconds (the on-error=floor pause, timings).
// Needs the client library's headers (nlmserve_decoder.h): included by the feature's .cpp
// files only, never by NeuralLMServer.h, which moses/FF/Factory.cpp compiles without them.
#ifndef moses_NeuralLMServerThread_h
#define moses_NeuralLMServerThread_h

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "nlmserve_decoder.h"

namespace Moses {

class Factor;

// What one thread keeps for one NeuralLMServer feature: the last prefetch, and buffers
// that grow to the largest batch and are reused, so that building and scoring n-grams
// allocates nothing per n-gram.
struct NeuralLMServerThread {
  // A predecessor hypothesis, a translation option that expands it, and the end of the
  // expansion's boundary rows in `rows`.
  struct Expansion {
    const void *prev;
    const void *option;
    size_t end;
  };

  // The hypothesis (prefetch=hypothesis) or stack (prefetch=stack) prefetched last.
  nlmserve::PrefetchMark prefetched;
  // The boundary score of every expansion prefetched last, in the order Moses evaluates
  // them: EvaluateWhenApplied reads it instead of asking the client's cache n-gram by n-gram.
  nlmserve::ExpansionScores boundary;
  std::vector<Expansion> expansions;
  std::vector<uint32_t> words;     // word ids of the phrase or window at hand
  std::vector<uint32_t> rows;      // canonical rows, order ids each
  std::vector<float> scores;       // one per row
  std::vector<uint8_t> complete;   // CalcScore: which rows have a full context
  std::vector<const Factor *> factors;  // the words of a state
  // Round trips, n-grams sent and cache hits of the thread's current sentence.
  nlmserve::BatchCounts sentence;
  // EvaluateWhenApplied in the current sentence: boundary scores found at the cursor of
  // `boundary`, found by lookup, and scored alone (not prefetched, or prefetch=false).
  uint64_t inOrder = 0;
  uint64_t lookedUp = 0;
  uint64_t scoredAlone = 0;
  // scoring=local: the thread's context prefixes, the n-grams it scored in the current
  // sentence, the position rows it summed for their contexts and, with a tree, the dot
  // products of nodes it computed.
  nlmserve::ScoringTables::Scratch tables;
  uint64_t scoredLocally = 0;
  uint64_t rowsSummed = 0;
  uint64_t nodesComputed = 0;
  uint64_t rowsRemembered = 0;
};

// Sentences this thread started (a count, so that pointers of an earlier sentence that
// a later one reuses are never mistaken for its own).
inline uint64_t &SentenceSerial() {
  thread_local uint64_t sentences = 0;
  return sentences;
}

inline int64_t SteadyMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline NeuralLMServerThread &Local(const void *feature) {
  // The feature asked for last is answered without a map lookup.
  thread_local const void *lastFeature = NULL;
  thread_local NeuralLMServerThread *last = NULL;
  if (feature != lastFeature || last == NULL) {
    thread_local std::unordered_map<const void *, NeuralLMServerThread> states;
    last = &states[feature];
    lastFeature = feature;
  }
  return *last;
}

}  // namespace Moses

#endif  // moses_NeuralLMServerThread_h
