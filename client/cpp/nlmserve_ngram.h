// nlmserve n-gram rules: the row the wire carries for an n-gram, and why one cannot be scored.
//
// The contract (proto/nlmserve/v1/lm.proto; the golden file proto/contract/canonical_ngrams.tsv,
// whose Python owner is nlmserve.wire.ngrams.canonical_rows):
// - an n-gram lists ids oldest first, the predicted word last;
// - a context shorter than order-1 is left-padded with <s>, and everything left of the newest
//   <s> in a context is <s> too; the id vocab_size in a context is a word that is not known
//   (NoWordId), and everything left of it is too; <s> is never predicted;
// - CanonicalRow below is the one C++ owner of these rules: the client's requests, the load
//   generator, the native front end and the Moses feature all call it.
// Needs no server (a ModelInfo with order and vocab_size set will do) and no gRPC; C++11.
#ifndef NLMSERVE_NGRAM_H
#define NLMSERVE_NGRAM_H

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace nlmserve {

// Model facts fetched once from GetModelInfo.
struct ModelInfo {
  uint32_t order = 0;
  uint32_t vocab_size = 0;
  uint32_t bos_id = 1;
  uint32_t eos_id = 2;
  uint32_t unk_id = 0;
  std::string model_hash;
  std::string objective;
  std::string device;
  bool self_normalized = false;
  bool lowercase = false;
  uint64_t max_ngrams_per_request = 0;
};

// Why an n-gram cannot be scored; kNone: it can. The order of the checks is the order
// of the values: an n-gram that breaks several rules reports the first.
enum class NgramError {
  kNone = 0,
  kEmpty,       // no ids at all
  kTooLong,     // more ids than the model's order
  kOutOfRange,  // an id outside [0, vocab_size)
  kBosTarget,   // <s> as the predicted word (it is never predicted)
};

// "empty", "too-long", "out-of-range", "bos-target" ("" for kNone): the error kinds of
// proto/contract/canonical_ngrams.tsv and of the Python owner's InvalidRequestError.
const char *NgramErrorKind(NgramError error);

// The canonical context: the last `width` of words[0, n), left-padded with `bos`, and
// every item left of the newest `bos` set to `bos` (a sentence start resets the
// history). Ids, or anything else compared with == (a decoder's word pointers for its
// LM state). `out` holds `width` items and does not overlap `words`.
template <class T>
inline void CanonicalContext(const T *words, std::size_t n, std::size_t width, const T &bos, T *out) {
  const std::size_t keep = n < width ? n : width;
  const std::size_t pad = width - keep;
  for (std::size_t i = 0; i < pad; ++i) out[i] = bos;
  for (std::size_t i = 0; i < keep; ++i) out[pad + i] = words[n - keep + i];
  for (std::size_t j = width; j-- > pad;) {
    if (out[j] == bos) {
      for (std::size_t i = pad; i < j; ++i) out[i] = bos;
      break;
    }
  }
}

// Rows of k ids (a context of k-1, then the predicted word) made `width` (>= k) wide: each
// context as CanonicalContext makes it width-1 wide, the predicted word last. The native
// front end merges packed requests of different orders into one batch with it. `out` holds
// n * width ids and does not overlap `rows`.
inline void WidenRows(const uint32_t *rows, std::size_t n, std::size_t k, std::size_t width, uint32_t bos,
                      uint32_t *out) {
  for (std::size_t r = 0; r < n; ++r, rows += k, out += width) {
    CanonicalContext(rows, k - 1, width - 1, bos, out);
    out[width - 1] = rows[k - 1];
  }
}

// The id that stands, in a context, for a word that is not known (the words before a phrase
// scored on its own): model.vocab_size. It adds nothing to the score (no position row, no
// feature of a suffix that holds it), and everything left of it is the no-word too, as for
// <s>; it is never predicted.
inline uint32_t NoWordId(const ModelInfo &model) { return model.vocab_size; }

// Whether `id` is outside what a row may hold: the vocabulary, and the no-word in a context.
inline bool OutOfRange(uint32_t id, bool in_context, const ModelInfo &model) {
  return id > model.vocab_size || (id == model.vocab_size && !in_context);
}

// The row the wire carries for the n-gram ids[0, n) (oldest first, the predicted word
// last) of `model` (its order, vocab_size and bos_id are used): `order` ids, the
// context as CanonicalContext makes it (width order-1), then the predicted word.
// Checks the n-gram first; returns the rule it breaks (out is then unspecified) or
// NgramError::kNone. Needs no server: a ModelInfo with order and vocab_size set will do.
NgramError CanonicalRow(const uint32_t *ids, std::size_t n, const ModelInfo &model, uint32_t *out);

// The first of the rows[0, n) (model.order ids each) that a server would refuse: an id
// OutOfRange, or <s> predicted; n when there is none (*error is then kNone). Checks all
// rows in one pass with no branch per id, so that it costs little beside scoring them.
std::size_t FirstBadRow(const uint32_t *rows, std::size_t n, const ModelInfo &model, NgramError *error);

// The message a ClientError (code 3) carries for n-gram number `index` that breaks `error`.
std::string NgramErrorMessage(NgramError error, const uint32_t *ids, std::size_t n, std::size_t index,
                              const ModelInfo &model);

// Reads a file of n-grams as words (nlmserve_load's and the client test's input): one
// n-gram per line, its words separated by white space, blank lines skipped. Appends them to
// `out`; false when the file cannot be opened.
bool ReadNgramFile(const std::string &path, std::vector<std::vector<std::string> > *out);

}  // namespace nlmserve

#endif  // NLMSERVE_NGRAM_H
