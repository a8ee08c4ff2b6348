// How a client's words become the vocabulary's: Lowercase, the rule the client applies to a
// word before looking it up when the model was trained on lowercased text (or the caller asks
// for it), header only and with no gRPC, so that the client library (nlmserve_client.h) and
// the tables file's vocabulary (nlmserve_tables_file.h) share one owner. The Python owner is
// str.lower; proto/contract/lowercase.tsv has the cases both pass. C++11, like Moses.
#ifndef NLMSERVE_WORDS_H
#define NLMSERVE_WORDS_H

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "nlmserve_lowercase.h"

namespace nlmserve {
namespace lowercase_rule {

// UTF-8 decoding of one code point at text[*i]; invalid bytes decode as themselves
// (returned negative so they are copied unchanged).
inline long DecodeUtf8(const std::string &text, std::size_t *i) {
  unsigned char c = static_cast<unsigned char>(text[*i]);
  int len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 0;
  if (len == 0 || *i + len > text.size()) {
    ++*i;
    return -static_cast<long>(c) - 1;
  }
  long cp = len == 1 ? c : len == 2 ? (c & 0x1f) : len == 3 ? (c & 0x0f) : (c & 0x07);
  for (int k = 1; k < len; ++k) {
    unsigned char d = static_cast<unsigned char>(text[*i + k]);
    if ((d >> 6) != 0x2) {
      ++*i;
      return -static_cast<long>(c) - 1;
    }
    cp = (cp << 6) | (d & 0x3f);
  }
  *i += len;
  return cp;
}

inline void EncodeUtf8(long cp, std::string *out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xc0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xe0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  } else {
    out->push_back(static_cast<char>(0xf0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3f)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  }
}

// Whether cp lies in one of the sorted, disjoint ranges [0, n).
inline bool InRanges(long cp, const lowercase::Range *ranges, std::size_t n) {
  std::size_t lo = 0, hi = n;  // the first range whose last >= cp
  while (lo < hi) {
    const std::size_t mid = (lo + hi) / 2;
    if (static_cast<long>(ranges[mid].last) < cp) lo = mid + 1; else hi = mid;
  }
  return lo < n && static_cast<long>(ranges[lo].first) <= cp;
}

// The simple lowercase mapping of cp (nlmserve_lowercase.h's runs).
inline long LowerCodePoint(long cp) {
  const std::size_t n = sizeof(lowercase::kRuns) / sizeof(lowercase::kRuns[0]);
  std::size_t lo = 0, hi = n;  // the first run whose last >= cp
  while (lo < hi) {
    const std::size_t mid = (lo + hi) / 2;
    if (static_cast<long>(lowercase::kRuns[mid].last) < cp) lo = mid + 1; else hi = mid;
  }
  if (lo == n) return cp;
  const lowercase::Run &run = lowercase::kRuns[lo];
  if (cp < static_cast<long>(run.first) || (cp - static_cast<long>(run.first)) % run.step != 0) return cp;
  return cp + run.delta;
}

inline bool CaseIgnorable(long cp) {
  return cp >= 0 && InRanges(cp, lowercase::kCaseIgnorable,
                             sizeof(lowercase::kCaseIgnorable) / sizeof(lowercase::kCaseIgnorable[0]));
}

inline bool Cased(long cp) {
  return cp >= 0 && InRanges(cp, lowercase::kCased, sizeof(lowercase::kCased) / sizeof(lowercase::kCased[0]));
}

// U+03A3 at cps[i] is final (U+03C2) when a cased code point is before it and none after,
// case-ignorable ones skipped on either side (Unicode's Final_Sigma, as Python's str.lower).
inline bool FinalSigma(const std::vector<long> &cps, std::size_t i) {
  std::size_t j = i;
  while (j > 0 && CaseIgnorable(cps[j - 1])) --j;
  if (j == 0 || !Cased(cps[j - 1])) return false;
  std::size_t k = i + 1;
  while (k < cps.size() && CaseIgnorable(cps[k])) ++k;
  return k == cps.size() || !Cased(cps[k]);
}

}  // namespace lowercase_rule

// Lowercases UTF-8 text as Python's str.lower does, in any locale: the tables of
// nlmserve_lowercase.h (written from Python's str.lower by proto/contract/lowercase_table.py),
// U+0130 to "i" and U+0307, and U+03A3 to the final sigma U+03C2 at the end of a word;
// bytes that are not UTF-8 are copied unchanged (proto/contract/lowercase.tsv has cases).
inline std::string Lowercase(const std::string &text) {
  bool ascii = true;
  for (unsigned char c : text) {
    if (c >= 0x80) {
      ascii = false;
      break;
    }
  }
  std::string out;
  out.reserve(text.size());
  if (ascii) {
    for (char c : text) out.push_back((c >= 'A' && c <= 'Z') ? static_cast<char>(c + 32) : c);
    return out;
  }
  std::vector<long> cps;  // code points; an invalid byte b as -(b + 1)
  for (std::size_t i = 0; i < text.size();) cps.push_back(lowercase_rule::DecodeUtf8(text, &i));
  for (std::size_t i = 0; i < cps.size(); ++i) {
    const long cp = cps[i];
    if (cp < 0) {
      out.push_back(static_cast<char>(-(cp + 1)));
    } else if (cp == 0x130) {  // capital I with dot above: i and a combining dot above
      lowercase_rule::EncodeUtf8('i', &out);
      lowercase_rule::EncodeUtf8(0x307, &out);
    } else if (cp == 0x3a3) {
      lowercase_rule::EncodeUtf8(lowercase_rule::FinalSigma(cps, i) ? 0x3c2 : 0x3c3, &out);
    } else {
      lowercase_rule::EncodeUtf8(lowercase_rule::LowerCodePoint(cp), &out);
    }
  }
  return out;
}

}  // namespace nlmserve

#endif  // NLMSERVE_WORDS_H
