// The n-gram rules (nlmserve_ngram.h).
#include "nlmserve_ngram.h"

#include <fstream>
#include <sstream>

namespace nlmserve {

const char *NgramErrorKind(NgramError error) {
  switch (error) {
    case NgramError::kEmpty:
      return "empty";
    case NgramError::kTooLong:
      return "too-long";
    case NgramError::kOutOfRange:
      return "out-of-range";
    case NgramError::kBosTarget:
      return "bos-target";
    case NgramError::kNone:
      break;
  }
  return "";
}

NgramError CanonicalRow(const uint32_t *ids, std::size_t n, const ModelInfo &model, uint32_t *out) {
  if (n == 0) return NgramError::kEmpty;
  if (n > model.order) return NgramError::kTooLong;
  for (std::size_t i = 0; i < n; ++i) {
    if (OutOfRange(ids[i], i + 1 < n, model)) return NgramError::kOutOfRange;
  }
  if (ids[n - 1] == model.bos_id) return NgramError::kBosTarget;
  const std::size_t width = model.order - 1;
  CanonicalContext(ids, n - 1, width, model.bos_id, out);
  // The no-word as <s>: everything left of the newer of the two is that one.
  for (std::size_t j = width; j-- > 0;) {
    if (out[j] == model.bos_id || out[j] == model.vocab_size) {
      for (std::size_t i = 0; i < j; ++i) out[i] = out[j];
      break;
    }
  }
  out[model.order - 1] = ids[n - 1];
  return NgramError::kNone;
}

std::size_t FirstBadRow(const uint32_t *rows, std::size_t n, const ModelInfo &model, NgramError *error) {
  const std::size_t width = model.order;
  const uint32_t bos = model.bos_id;
  *error = NgramError::kNone;
  bool bad = false;  // the rows' context ids, then their words
  for (std::size_t i = 0; i < n; ++i) {
    const uint32_t *row = rows + i * width;
    for (std::size_t j = 0; j + 1 < width; ++j) bad |= OutOfRange(row[j], true, model);
    bad |= OutOfRange(row[width - 1], false, model) | (row[width - 1] == bos);
  }
  if (!bad) return n;
  for (std::size_t i = 0; i < n; ++i) {
    const uint32_t *row = rows + i * width;
    for (std::size_t j = 0; j < width; ++j) {
      if (OutOfRange(row[j], j + 1 < width, model)) *error = NgramError::kOutOfRange;
    }
    if (*error == NgramError::kNone && row[width - 1] == bos) *error = NgramError::kBosTarget;
    if (*error != NgramError::kNone) return i;
  }
  return n;
}

bool ReadNgramFile(const std::string &path, std::vector<std::vector<std::string> > *out) {
  std::ifstream in(path);
  if (!in) return false;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream words(line);
    std::vector<std::string> ngram;
    std::string w;
    while (words >> w) ngram.push_back(w);
    if (!ngram.empty()) out->push_back(ngram);
  }
  return true;
}

std::string NgramErrorMessage(NgramError error, const uint32_t *ids, std::size_t n, std::size_t index,
                              const ModelInfo &model) {
  const std::string which = "n-gram " + std::to_string(index);
  switch (error) {
    case NgramError::kEmpty:
    case NgramError::kTooLong:
      return which + " has " + std::to_string(n) + " words; the model takes 1 to " + std::to_string(model.order);
    case NgramError::kOutOfRange:
      for (std::size_t i = 0; i < n; ++i) {
        if (OutOfRange(ids[i], i + 1 < n, model)) {
          return which + " has id " + std::to_string(ids[i]) + " outside the vocabulary of " +
                 std::to_string(model.vocab_size);
        }
      }
      break;
    case NgramError::kBosTarget:
      return which + " predicts <s>, which is never predicted";
    case NgramError::kNone:
      break;
  }
  return which + " is valid";
}

}  // namespace nlmserve
