// nlmserve tables file: a model's scoring tables, its vocabulary and the facts a decoder
// needs, in one file that every process of a host maps read-only, as KenLM's binary format
// (lm/binary_format.hh with lm/vocab.hh) keeps a model in one file that needs nothing else.
// `nlmserve export-tables --model M --out FILE [--quantize none|fp16|int8]` writes it; the
// Python owner of the format is nlmserve.lm.tables_file, whose docstring gives the layout
// (version 2: a 4096-byte header, then the sections position, position_scale, output,
// output_scale, rest, words, word_starts, vocab_table); proto/contract/scoring_tables*.nlt
// are files of it.
//
// The contract (C++11, header only, no gRPC or protobuf: CMake target nlmserve::nlmserve_scorer):
//   Map       MapTablesFile(path, &file, &error) maps the file read-only and shared
//             (MAP_SHARED: every process of the host reads the same pages of the page cache)
//             and fills a TablesFile: `info` (TablesFileInfo: what a decoder otherwise asks
//             GetModelInfo for, and the tables' form), `tables` (the ScoringTables that score
//             from the mapped pages, nlmserve_tables.h) and `vocabulary` (TablesVocabulary).
//             It reads the header (one page) and checks it, and copies only a feature
//             model's word classes and a tree's paths: it never reads the tables or the
//             words, and builds no table of strings (the vocabulary's hash table is the
//             file's own, as KenLM's ProbingVocabulary).
//   Errors    false, with *error one line naming the file, when it cannot be opened, is not
//             a tables file, is of version 1 (the line says how to write version 2: `nlmserve
//             export-tables --model MODEL --out FILE`) or a newer version, its header is
//             damaged (its header_check, an FNV-1a 64 of the header, does not match) or does
//             not hold together (sizes, offsets, output, quantisation), the file is cut short,
//             or the tables do not hold together (ScoringTables::SetMapped). The sha256 of the
//             rest is `nlmserve info FILE --verify`'s to check: mapping would read it all.
//   Words     vocabulary.Id(word) is a word's id by the client's rule: lowercased first
//             (nlmserve::Lowercase, Python's str.lower; nlmserve_words.h) when
//             info.lowercase, then looked up in the file's table (its FNV-1a 64 key, then its
//             bytes compared); a word that is not there is info.unk_id (Find says whether
//             it is known: the OOV flag). proto/contract/scoring_words.tsv has the cases both
//             languages pass.
//   Scores    as nlmserve_tables.h states: natural log, canonical rows; from quantised rows
//             within info.error_bound nats of float32's, plus float rounding.
//   Threads   everything is read-only once mapped: any number of threads.
//   Lifetime  the mapping lives as long as `tables`, `vocabulary` or a copy of either.
#ifndef NLMSERVE_TABLES_FILE_H
#define NLMSERVE_TABLES_FILE_H

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#if defined(__unix__)
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#endif

#include "nlmserve_tables.h"
#include "nlmserve_words.h"

namespace nlmserve {

// What a tables file says of its model and tables: the facts GetModelInfo answers (order,
// vocabulary size, the special ids, the lowercase flag, the model's hash), the output and
// its form, and the file's own.
struct TablesFileInfo {
  uint32_t version = 0;
  uint32_t order = 0;
  uint32_t vocab_size = 0;
  uint32_t dim = 0;
  uint32_t bos_id = 1;
  uint32_t eos_id = 2;
  uint32_t unk_id = 0;
  // The model was trained on lowercased text: words are lowercased before the lookup.
  bool lowercase = false;
  // true: a tree output's exact log-probabilities; false: a class output's self-normalised scores.
  bool normalized = false;
  std::string output;      // "class" or "tree"
  std::string activation;  // "none", "tanh" or "relu"
  std::string model_hash;  // the model file's hash (what GetModelInfo reports)
  Quantization quantization = Quantization::kNone;
  // The most a score may differ from the float32 tables' (nats; 0 for kNone), plus float rounding.
  double error_bound = 0.0;
  std::string sha256;  // of every byte after the header, as recorded (`nlmserve info --verify` checks it)
  uint64_t file_bytes = 0;
};

// FNV-1a 64 of a word's bytes: its key in a tables file's vocabulary table (and of the
// header, for its check).
inline uint64_t TablesFileKey(const char *data, std::size_t n) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (std::size_t i = 0; i < n; ++i) {
    h ^= static_cast<unsigned char>(data[i]);
    h *= 0x100000001b3ULL;
  }
  return h;
}

// A tables file's vocabulary, read in place: word -> id through the file's probing table,
// id -> word from its words. Empty (size() 0, every word unknown) until MapTablesFile fills it.
class TablesVocabulary {
 public:
  TablesVocabulary() {}
  // The parts of a mapped file (MapTablesFile's, which has checked their sizes): the words'
  // bytes and their starts (size + 1), the table of `buckets` (a power of two) 16-byte
  // buckets, kept alive by `mapping`.
  TablesVocabulary(const char *words, std::size_t words_bytes, const uint32_t *starts, uint32_t size,
                   const unsigned char *table, uint32_t buckets, bool lowercase, uint32_t unk_id,
                   std::shared_ptr<const void> mapping)
      : words_(words), words_bytes_(words_bytes), starts_(starts), size_(size), table_(table), buckets_(buckets),
        bits_(0), lowercase_(lowercase), unk_id_(unk_id), mapping_(mapping) {
    while ((uint64_t(1) << bits_) < buckets) ++bits_;
  }

  uint32_t size() const { return size_; }
  bool lowercase() const { return lowercase_; }
  uint32_t unk_id() const { return unk_id_; }

  // Whether `word`, as a client gives it (lowercased first when the model lowercases), is a
  // word of the vocabulary; *id its id when it is.
  bool Find(const std::string &word, uint32_t *id) const {
    if (lowercase_) {
      const std::string lower = Lowercase(word);
      return FindExact(lower.data(), lower.size(), id);
    }
    return FindExact(word.data(), word.size(), id);
  }

  // The id of `word` as a client gives it; unk_id() when it is not a word of the vocabulary.
  uint32_t Id(const std::string &word) const {
    uint32_t id = unk_id_;
    return Find(word, &id) ? id : unk_id_;
  }

  // The same for bytes exactly as the vocabulary stores them (no lowercasing).
  bool FindExact(const char *data, std::size_t n, uint32_t *id) const {
    if (buckets_ == 0) return false;
    const uint64_t key = TablesFileKey(data, n);
    const uint64_t mask = buckets_ - 1;
    uint64_t b = (key * 0x9e3779b97f4a7c15ULL) >> (64 - bits_);
    for (uint32_t probes = 0; probes < buckets_; ++probes, b = (b + 1) & mask) {
      uint64_t stored;
      uint32_t i;
      std::memcpy(&stored, table_ + b * 16, 8);
      std::memcpy(&i, table_ + b * 16 + 8, 4);
      if (i == kEmpty) return false;
      if (stored != key || i >= size_) continue;
      const uint32_t from = starts_[i], to = starts_[i + 1];
      if (from <= to && to <= words_bytes_ && to - from == n && std::memcmp(words_ + from, data, n) == 0) {
        *id = i;
        return true;
      }
    }
    return false;
  }

  // The word of `id` as stored ("" for an id outside the vocabulary or damaged starts).
  std::string Word(uint32_t id) const {
    if (id >= size_) return std::string();
    const uint32_t from = starts_[id], to = starts_[id + 1];
    if (from > to || to > words_bytes_) return std::string();
    return std::string(words_ + from, to - from);
  }

 private:
  static const uint32_t kEmpty = 0xffffffffu;
  const char *words_ = nullptr;
  std::size_t words_bytes_ = 0;
  const uint32_t *starts_ = nullptr;
  uint32_t size_ = 0;
  const unsigned char *table_ = nullptr;
  uint32_t buckets_ = 0;
  unsigned bits_ = 0;
  bool lowercase_ = false;
  uint32_t unk_id_ = 0;
  std::shared_ptr<const void> mapping_;
};

// A mapped tables file (MapTablesFile): its facts, its tables, its vocabulary.
struct TablesFile {
  TablesFileInfo info;
  std::shared_ptr<const ScoringTables> tables;
  TablesVocabulary vocabulary;
};

namespace tables_file {

const char kMagic[] = "NLMTABLE";
const uint32_t kVersion = 2;
const std::size_t kHeaderBytes = 4096;
const std::size_t kAlign = 64;
const std::size_t kCheckAt = 248;
const std::size_t kSectionsAt = 256;
const std::size_t kBucketBytes = 16;
enum Section { kPosition, kPositionScale, kOutput, kOutputScale, kRest, kWords, kWordStarts, kVocabTable, kSections };
const char *const kSectionNames[kSections] = {"position", "position_scale", "output", "output_scale",
                                              "rest",     "words",          "word_starts", "vocab_table"};

inline uint32_t U32(const unsigned char *head, std::size_t at) {
  uint32_t v;
  std::memcpy(&v, head + at, 4);
  return v;
}

inline uint64_t U64(const unsigned char *head, std::size_t at) {
  uint64_t v;
  std::memcpy(&v, head + at, 8);
  return v;
}

inline std::string Text(const unsigned char *head, std::size_t at, std::size_t n) {
  const char *p = reinterpret_cast<const char *>(head + at);
  return std::string(p, strnlen(p, n));
}

// The vocabulary table's buckets for V words: the least power of two of at least 1.5 V (and 4).
inline uint64_t BucketCount(uint64_t vocab_size) {
  const uint64_t want = vocab_size + (vocab_size + 1) / 2;
  uint64_t buckets = 4;
  while (buckets < want) buckets <<= 1;
  return buckets;
}

// a * b into *out; false when it would pass 2^62 (no section is that large).
inline bool Times(uint64_t a, uint64_t b, uint64_t *out) {
  const uint64_t limit = uint64_t(1) << 62;
  if (a != 0 && b > limit / a) return false;
  *out = a * b;
  return true;
}

inline std::string Rewrite(const std::string &path) {
  return "write it again with `nlmserve export-tables --model MODEL --out " + path + "`";
}

// What in a header (its check passed) does not hold together, or "" when it all does; the
// sections' offsets and sizes into `sections`.
inline std::string HeaderProblem(const unsigned char *head, const TablesFileInfo &info,
                                 uint64_t sections[kSections][2]) {
  const uint32_t feature_order = U32(head, 24), class_table = U32(head, 28), word_table = U32(head, 32);
  const uint32_t tree_nodes = U32(head, 36), tree_codes = U32(head, 40);
  const uint64_t tree_steps = U64(head, 48);
  if (U32(head, 244) != kSections) return "the number of sections";
  if (U32(head, 68) > 2) return "an unknown quantisation";
  if ((info.output != "class" && info.output != "tree") || (info.output == "tree") != (tree_nodes > 0)) {
    return "output '" + info.output + "'";
  }
  if (info.order < 2 || info.vocab_size < 3 || info.dim < 1) return "order, vocabulary or width";
  if (U32(head, 240) != BucketCount(info.vocab_size)) return "the vocabulary table's size";
  const uint64_t V = info.vocab_size, outputs = tree_nodes ? tree_nodes : V;
  const uint64_t value = info.quantization == Quantization::kFp16 ? 2 : info.quantization == Quantization::kInt8 ? 1 : 4;
  const bool scaled = info.quantization == Quantization::kInt8;
  uint64_t positions, position_bytes, output_bytes;
  if (!Times(info.order - 1, V, &positions) || !Times(positions, info.dim, &position_bytes) ||
      !Times(position_bytes, value, &position_bytes) || !Times(outputs * value, info.dim, &output_bytes)) {
    return "sizes too large";
  }
  const uint64_t rest = outputs + (feature_order ? V + class_table + word_table : 0) +
                        (tree_nodes ? V + 1 + uint64_t(tree_codes) + 1 + tree_steps : 0);
  const uint64_t want[kSections] = {position_bytes, scaled ? 4 * positions : 0, output_bytes, scaled ? 4 * outputs : 0,
                                    4 * rest, U64(head, kSectionsAt + kWords * 16 + 8), 4 * (V + 1),
                                    kBucketBytes * BucketCount(V)};
  uint64_t at = kHeaderBytes;
  for (int i = 0; i < kSections; ++i) {
    const uint64_t offset = U64(head, kSectionsAt + i * 16), bytes = U64(head, kSectionsAt + i * 16 + 8);
    if (bytes != want[i]) {
      return std::string("the ") + kSectionNames[i] + " section holds " + std::to_string(bytes) + " bytes, not " +
             std::to_string(want[i]);
    }
    if (offset % kAlign != 0 || offset < at || offset > (uint64_t(1) << 62)) {
      return std::string("the ") + kSectionNames[i] + " section's offset " + std::to_string(offset);
    }
    sections[i][0] = offset;
    sections[i][1] = bytes;
    at = offset + bytes;
  }
  return "";
}

}  // namespace tables_file

// Maps the tables file `path` (the contract at the top of this header) into *out; false,
// with *error one line naming the file, when it cannot.
inline bool MapTablesFile(const std::string &path, TablesFile *out, std::string *error) {
#if defined(__unix__) && defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  using namespace tables_file;
  struct Mapping {
    void *addr;
    std::size_t bytes;
    ~Mapping() { munmap(addr, bytes); }
  };
  const std::string not_one = path + ": not an nlmserve export-tables file (write one with `nlmserve export-tables`)";
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    *error = path + ": " + std::strerror(errno);
    return false;
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    *error = path + ": not a regular file";
    close(fd);
    return false;
  }
  unsigned char head[kHeaderBytes];
  std::size_t got = 0;
  while (got < kHeaderBytes) {
    const ssize_t n = pread(fd, head + got, kHeaderBytes - got, static_cast<off_t>(got));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<std::size_t>(n);
  }
  if (got < 12 || std::memcmp(head, kMagic, 8) != 0) {
    *error = not_one;
    close(fd);
    return false;
  }
  TablesFileInfo info;
  info.version = U32(head, 8);
  if (info.version == 1) {
    *error = path + ": a tables file of version 1, which holds no vocabulary and is read no more: " + Rewrite(path);
    close(fd);
    return false;
  }
  if (info.version != kVersion) {
    *error = path + ": tables file version " + std::to_string(info.version) + "; this nlmserve reads version " +
             std::to_string(kVersion);
    close(fd);
    return false;
  }
  const uint64_t file_bytes = static_cast<uint64_t>(st.st_size);
  if (got < kHeaderBytes) {
    *error = path + ": cut short (" + std::to_string(file_bytes) + " bytes, less than its header)";
    close(fd);
    return false;
  }
  unsigned char checked[kHeaderBytes];
  std::memcpy(checked, head, kHeaderBytes);
  std::memset(checked + kCheckAt, 0, 8);
  if (TablesFileKey(reinterpret_cast<const char *>(checked), kHeaderBytes) != U64(head, kCheckAt)) {
    *error = path + ": its header is damaged (its check does not match): " + Rewrite(path);
    close(fd);
    return false;
  }
  info.order = U32(head, 12);
  info.vocab_size = U32(head, 16);
  info.dim = U32(head, 20);
  info.lowercase = (U32(head, 44) & 1u) != 0;
  info.bos_id = U32(head, 56);
  info.eos_id = U32(head, 60);
  info.unk_id = U32(head, 64);
  const uint32_t quantization = U32(head, 68);
  info.quantization = quantization == 1 ? Quantization::kFp16 : quantization == 2 ? Quantization::kInt8
                                                                                   : Quantization::kNone;
  std::memcpy(&info.error_bound, head + 72, 8);
  info.output = Text(head, 80, 16);
  info.activation = Text(head, 96, 16);
  info.model_hash = Text(head, 112, 64);
  info.sha256 = Text(head, 176, 64);
  info.normalized = info.output == "tree";
  info.file_bytes = file_bytes;
  uint64_t sections[kSections][2];
  const std::string problem = HeaderProblem(head, info, sections);
  if (!problem.empty()) {
    *error = path + ": its header does not hold together (" + problem + "): " + Rewrite(path);
    close(fd);
    return false;
  }
  const uint64_t end = sections[kSections - 1][0] + sections[kSections - 1][1];
  if (file_bytes < end) {
    *error = path + ": cut short (" + std::to_string(file_bytes) + " bytes; its header says " + std::to_string(end) +
             ")";
    close(fd);
    return false;
  }
  Activation activation;
  if (!ParseActivation(info.activation, &activation)) {
    *error = path + ": unknown activation '" + info.activation + "'";
    close(fd);
    return false;
  }
  void *addr = mmap(nullptr, static_cast<std::size_t>(file_bytes), PROT_READ, MAP_SHARED, fd, 0);
  close(fd);
  if (addr == MAP_FAILED) {
    *error = path + ": mmap: " + std::strerror(errno);
    return false;
  }
  std::shared_ptr<Mapping> mapping(new Mapping());
  mapping->addr = addr;
  mapping->bytes = static_cast<std::size_t>(file_bytes);
  const unsigned char *base = static_cast<const unsigned char *>(addr);
  ScoringTables::Arrays arrays;
  arrays.quantization = info.quantization;
  arrays.position = base + sections[kPosition][0];
  arrays.output = base + sections[kOutput][0];
  if (info.quantization == Quantization::kInt8) {
    arrays.position_scale = reinterpret_cast<const float *>(base + sections[kPositionScale][0]);
    arrays.output_scale = reinterpret_cast<const float *>(base + sections[kOutputScale][0]);
  }
  arrays.rest = reinterpret_cast<const float *>(base + sections[kRest][0]);
  arrays.rest_floats = static_cast<std::size_t>(sections[kRest][1] / sizeof(float));
  ScoringTables::Features features;
  features.order = U32(head, 24);
  features.class_table = U32(head, 28);
  features.word_table = U32(head, 32);
  ScoringTables::Tree tree;
  tree.nodes = U32(head, 36);
  tree.codes = U32(head, 40);
  tree.steps = U64(head, 48);
  std::shared_ptr<ScoringTables> tables(new ScoringTables());
  if (!tables->SetMapped(info.order, info.vocab_size, info.dim, activation, info.model_hash, arrays, mapping, features,
                         tree)) {
    *error = path + ": its tables do not hold together with its header (order, vocabulary, width, features or tree): " +
             Rewrite(path);
    return false;
  }
  out->info = info;
  out->tables = tables;
  out->vocabulary = TablesVocabulary(reinterpret_cast<const char *>(base + sections[kWords][0]),
                                     static_cast<std::size_t>(sections[kWords][1]),
                                     reinterpret_cast<const uint32_t *>(base + sections[kWordStarts][0]),
                                     info.vocab_size, base + sections[kVocabTable][0],
                                     static_cast<uint32_t>(sections[kVocabTable][1] / kBucketBytes), info.lowercase,
                                     info.unk_id, mapping);
  return true;
#else
  *error = path + ": mapping a tables file needs a little-endian POSIX system";
  (void)out;
  return false;
#endif
}

// The tables of the tables file `path` alone (MapTablesFile above, its vocabulary and facts
// left aside).
inline bool MapTablesFile(const std::string &path, std::shared_ptr<const ScoringTables> *out, std::string *error) {
  TablesFile file;
  if (!MapTablesFile(path, &file, error)) return false;
  *out = file.tables;
  return true;
}

}  // namespace nlmserve

#endif  // NLMSERVE_TABLES_FILE_H
