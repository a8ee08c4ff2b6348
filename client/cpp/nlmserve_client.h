// nlmserve C++ client: scores n-grams against an nlmserve server over gRPC.
//
// This header has no gRPC or protobuf includes (the implementation is behind a
// pointer), so a Moses feature can include it next to Moses' own headers.
//
// Conventions (proto/nlmserve/v1/lm.proto):
// - an n-gram lists ids oldest first, the predicted word last;
// - a context shorter than order-1 is left-padded with <s>, and everything left of
//   the newest <s> in a context is <s> too; the id vocab_size in a context is a word that
//   is not known (NoWordId), and everything left of it is too (CanonicalRow, in
//   nlmserve_ngram.h, is the one C++ owner of these rules);
// - scores are log10 unless a method says otherwise.
//
// The client's other rules, each a header of its own that this one includes (so that a
// caller includes this header alone): the n-gram rules (nlmserve_ngram.h), ClientError
// (nlmserve_error.h), the server targets (nlmserve_target.h), token files
// (nlmserve_tokens.h), retries (nlmserve_retry.h), words and lowercasing (nlmserve_words.h),
// and the scoring tables GetScoringTables returns (nlmserve_tables.h).
//
// Thread safety: every public method may be called from many threads at once.
#ifndef NLMSERVE_CLIENT_H
#define NLMSERVE_CLIENT_H

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "nlmserve_error.h"
#include "nlmserve_ngram.h"
#include "nlmserve_retry.h"
#include "nlmserve_tables.h"
#include "nlmserve_target.h"
#include "nlmserve_tokens.h"
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

}  // namespace nlmserve

#endif  // NLMSERVE_CLIENT_H
