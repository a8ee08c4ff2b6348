// nlmserve C++ client: scores n-grams against an nlmserve server over gRPC.
//
// This header has no gRPC or protobuf includes (the implementation is behind a
// pointer), so a Moses feature can include it next to Moses' own headers.
//
// Conventions (proto/nlmserve/v1/lm.proto):
// - an n-gram lists ids oldest first, the predicted word last;
// - a context shorter than order-1 is left-padded with <s>, and everything left of
//   the newest <s> in a context is <s> too; the id vocab_size in a context is a word that
//   is not known (NoWordId), and everything left of it is too (CanonicalRow below is the
//   one C++ owner of these rules);
// - scores are log10 unless a method says otherwise.
//
// Thread safety: every public method may be called from many threads at once.
#ifndef NLMSERVE_CLIENT_H
#define NLMSERVE_CLIENT_H

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "nlmserve_tables.h"
#include "nlmserve_words.h"

namespace nlmserve {

// Options of a Client. Every field has a usable default.
struct ClientOptions {
  // Deadline of one RPC, milliseconds.
  int deadline_ms = 10000;
  // How long a (re)connection may wait for the channel to become ready, milliseconds.
  int connect_timeout_ms = 5000;
  // Further attempts after an RPC that failed with a status Retryable takes (each on a
  // fresh channel, or on the same one for replicas). 0: no retry.
  int retries = 2;
  // Entries of the n-gram -> score cache across all shards. 0 disables the cache.
  std::size_t cache_size = 1 << 20;
  // Number of independently locked cache shards.
  std::size_t cache_shards = 16;
  // Lowercase words before the vocabulary lookup (also done when the model says so).
  bool lowercase = false;
  // true: exactly normalised log-probabilities; false: the model's unnormalised
  // (self-normalised) score where the server offers one.
  bool normalized = true;
  // TLS: PEM file of the CA that signed the servers' certificates. Any TLS field set
  // makes the connection TLS (an empty tls_ca then means the system's root certificates).
  std::string tls_ca;
  // Mutual TLS: this client's certificate chain and private key (PEM files, both or neither).
  std::string tls_cert;
  std::string tls_key;
  // Check the servers' certificates against this name instead of the target's host
  // (replicas on different hosts whose certificates share one name).
  std::string tls_server_name;
  // File whose first token (ReadTokenFile: blank and '#' lines skipped) is sent on every
  // call as `authorization: Bearer <token>`. Empty: no token.
  std::string token_file;
};

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

// Any failure to get a score: unreachable or restarting server, deadline, invalid
// request, or a model that changed under the client. Never a process exit.
class ClientError : public std::runtime_error {
 public:
  // code: the gRPC status code (numeric value of grpc::StatusCode), or -1 for a
  // client-side error.
  ClientError(int code, const std::string &message)
      : std::runtime_error(message), code_(code) {}
  int code() const { return code_; }

 private:
  int code_;
};

// Counters since construction (or the last ResetStats).
struct ClientStats {
  uint64_t cache_hits = 0;
  uint64_t cache_misses = 0;
  uint64_t round_trips = 0;     // ScoreNgrams RPCs that returned OK
  uint64_t failed_calls = 0;    // RPC attempts that failed
  uint64_t reconnects = 0;      // fresh channels made after a failure
  uint64_t ngrams_sent = 0;     // n-grams sent to the server
};

// What ScoreRows calls did, added up by the calls that are given it (a decoder keeps
// one per thread and sentence).
struct BatchCounts {
  uint64_t cache_hits = 0;
  uint64_t cache_misses = 0;  // distinct rows of a batch not in the cache
  uint64_t ngrams_sent = 0;
  uint64_t round_trips = 0;
};

// Where a Client's channel connects (see ParseTarget).
struct Endpoint {
  std::string target;              // the gRPC target given to the channel
  std::vector<std::string> replicas;  // the addresses as given (empty for dns:///)
  bool replicated = false;         // round_robin over health-checked replicas
  std::string host_name;           // the one host all static replicas share ("" if they differ)
};

// The channel target for `HOST:PORT`, a comma-separated list of replica addresses
// (`a:1,b:2`, host names resolved once, here: `ipv4:A:1,B:2` or `ipv6:[A]:1,[B]:2`),
// or a resolver target (`dns:///name:port`, `ipv4:...`, `ipv6:...`) passed unchanged.
// Throws ClientError (code -1) for an address that is not HOST:PORT or does not resolve.
Endpoint ParseTarget(const std::string &target);

class Client {
 public:
  // Connects to `target` (anything ParseTarget takes), fetches the model info and the
  // vocabulary. Several replicas (a list or a dns:/// name) share one channel that
  // balances with gRPC's round_robin policy and skips replicas whose grpc.health.v1
  // status for nlmserve.v1.LanguageModel is not SERVING. Every listed replica reachable
  // at construction must serve the model of the first answer, and every later answer
  // must carry its hash (ClientError code 9 otherwise). Failed calls on a replicated
  // target are retried on the same channel, where round_robin skips the dead replica.
  // Throws ClientError when the server cannot be reached within the deadlines, when a
  // TLS or token file cannot be read, or when replicas serve different models.
  explicit Client(const std::string &target, const ClientOptions &options = ClientOptions());
  ~Client();
  Client(const Client &) = delete;
  Client &operator=(const Client &) = delete;

  const ModelInfo &info() const;
  const ClientOptions &options() const;
  const std::string &target() const;

  // Word -> id; unknown words map to <unk>. Lowercases first when configured.
  uint32_t WordId(const std::string &word) const;
  // True when the word (after lowercasing when configured) is in the vocabulary.
  bool Known(const std::string &word) const;
  // Id -> word (empty string when out of range).
  std::string Word(uint32_t id) const;

  // Scores canonical rows (CanonicalRow's output): row i is rows[i*width, (i+1)*width),
  // width the model's order; its log10 score goes to out[i]. Cache hits are answered
  // locally; the distinct misses of the batch go to the server in as few requests as the
  // server's per-request limit allows, and into the cache. Allocates nothing per row (the
  // buffers are the calling thread's). Adds what it did to *counts when given. Throws
  // ClientError (code 3 for a width other than the order, an id outside the vocabulary
  // or <s> predicted; the server's failure after the retries).
  void ScoreRows(const uint32_t *rows, std::size_t n_rows, std::size_t width, float *out,
                 BatchCounts *counts = nullptr);

  // Scores n-grams given as ids: one log10 value per n-gram, in order. Canonicalises
  // each n-gram, then ScoreRows. Throws ClientError (invalid id, <s> predicted, empty or
  // too long n-gram, server failure after the retries).
  std::vector<float> ScoreBatch(const std::vector<std::vector<uint32_t> > &ngrams);

  // CanonicalRow (the free function) for the served model: writes info().order ids to
  // `out`. For callers that build their own requests. Throws ClientError (code 3) as
  // ScoreBatch does for the same n-gram; its message names `index`.
  void CanonicalRow(const uint32_t *ids, std::size_t n, uint32_t *out, std::size_t index = 0) const;
  std::vector<uint32_t> CanonicalRow(const std::vector<uint32_t> &ngram, std::size_t index = 0) const;

  // The same for n-grams given as words (mapped with WordId).
  std::vector<float> ScoreStrings(const std::vector<std::vector<std::string> > &ngrams);

  // One n-gram.
  float Score(const std::vector<uint32_t> &ngram);

  ClientStats stats() const;
  void ResetStats();
  void ClearCache();
  // Number of entries in the cache.
  std::size_t CacheEntries() const;

  // The served model's self-normalised score, or a tree-output model's exact
  // log-probability, as tables (nlmserve_tables.h), for scoring n-grams in this process:
  // one streamed GetScoringTables call (with a deadline of its own, `deadline_ms` at least,
  // as the tables run to hundreds of MB). Throws ClientError: code 9 (FAILED_PRECONDITION)
  // with the server's reason when the model has none (not self-normalised, not a diagonal
  // class- or tree-output model), 9 when they come from another model than info()'s, the
  // transport's code otherwise.
  std::shared_ptr<const ScoringTables> GetScoringTables(int deadline_ms = 600000);

  // Successful ScoreNgrams RPCs made by the calling thread (all clients). A decoder
  // that handles one sentence per thread can take differences of this value to count
  // round trips per sentence (ScoreRows' BatchCounts count them per caller).
  static uint64_t ThreadRoundTrips();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Lowercase (the rule before a vocabulary lookup) is nlmserve_words.h's, included above.

// The tokens of a token file's bytes `text` (proto/contract/token_files.tsv; the Python
// owner is nlmserve.common.tokens): lines split at '\n', each stripped of ASCII white space;
// empty lines and lines starting with '#' skipped; any other line is one token of bytes
// 0x21-0x7E (printable ASCII without white space). Returns 0 with the tokens in
// `tokens`; the number (from 1) of the first line that is not a token; or -1 when the
// file holds no token (`tokens` empty then).
int ParseTokens(const std::string &text, std::vector<std::string> *tokens);

// The first token of the file `path` (what a client sends); ClientError naming the file
// (and the line) when it cannot be read or breaks ParseTokens' rule.
std::string ReadTokenFile(const std::string &path);

// Whether a call that failed with the gRPC status `code` and `message` is tried again
// (proto/contract/retry_codes.tsv; the Python owner is nlmserve.client.core.RetryPolicy):
// UNAVAILABLE, CANCELLED (a stopping server's), and RESOURCE_EXHAUSTED from overload but
// not a message over the size limit. Never DEADLINE_EXCEEDED: the deadline is the
// caller's budget for the call.
bool Retryable(int code, const std::string &message);

}  // namespace nlmserve

#endif  // NLMSERVE_CLIENT_H
