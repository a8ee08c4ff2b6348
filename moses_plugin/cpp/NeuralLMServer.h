// NeuralLMServer: a Moses language-model feature that scores n-grams with an nlmserve model,
// from its tables file in the decoder (no server), or by asking an nlmserve server.
//
// Goes into moses/LM/ of a Moses source tree (see moses_plugin/README.md) and links
// against the nlmserve C++ client library (nlmserve_client.h, built by
// client/cpp/CMakeLists.txt). moses.ini, with a tables file (`nlmserve export-tables`) and
// no server, as KENLM reads its file:
//
//   NeuralLMServer name=NLM0 factor=0 order=5 tables=/abs/model.nlt normalized=false
//
// or asking a running `nlmserve serve`:
//
//   NeuralLMServer name=NLM0 factor=0 order=5 path=127.0.0.1:50051
//
// `nlmserve moses-ini` prints the line that fits a model. One of tables= and path= is needed
// (nlmserve::SourceError); without path= the feature constructs no client and opens no
// connection: the file gives the vocabulary, the model's facts and the tables. The line is read
// by nlmserve_moses_ini.h (Moses-free: nlmserve::SetFeatureOption, LineError), whose golden file
// proto/contract/moses_ini_lines.tsv lists lines accepted and refused.
//
// Parameters (besides Moses' own name, factor, order, path, tuneable, oov-feature):
//   normalized=true|false   exactly normalised log-probabilities (default true), or the
//                           model's self-normalised score where it has one
//   cache-size=N            n-gram score cache entries shared by all threads (default 1048576;
//                           keyed by the n-gram's ids, stored inline, no allocation per lookup)
//   lowercase=true|false    lowercase words before the vocabulary lookup (default false;
//                           also done when the model says so)
//   deadline-ms=N           deadline of one request (default 10000)
//   connect-timeout-ms=N    how long a reconnection may wait (default 5000)
//   retries=N               further attempts on a fresh channel after a failure (default 2)
//   on-error=fail|floor     after the retries: stop the decoder with an exception naming
//                           the server (default), or score the n-grams LOWEST_SCORE and go on,
//                           leaving the server alone for a pause (1 s, doubling up to 60 s
//                           while it keeps failing) in which every request is floored
//   phrase-scores=load|sentence
//                           load (default): Moses' usual way, each target phrase scored once
//                           when the table loads or looks it up, so its score and the estimate
//                           of its first words go into the translation options' future costs
//                           and the table-limit pruning, as KENLM's do; sentence: when a
//                           sentence starts, the phrase-internal n-grams of all its target
//                           phrases in the in-memory phrase tables go to the server in one
//                           request and the phrase scores are added per translation option
//                           (EvaluateWithSourceContext): far fewer requests with scoring=server
//                           and a large table, but Moses' TranslationOption keeps the future
//                           score it had when it was made, so the search's future costs then
//                           leave the NLM out (more search errors as its weight grows)
//   table-prefetch=true|false
//                           with phrase-scores=load and scoring=server (default true): before
//                           the in-memory phrase tables (PhraseDictionaryMemory) load, read the
//                           target phrases of their files and score their n-grams into the
//                           cache in requests of 65,536 n-grams, so that the per-phrase scoring
//                           at load finds them there instead of costing one request per phrase;
//                           stops when it has put cache-size/2 n-grams in the cache
//   scoring=server|local    server (default): every n-gram not in the cache is scored by
//                           the server; local: at load the feature fetches the model's
//                           scoring tables from the server (GetScoringTables: order x
//                           vocabulary x width floats, 188 MB for a 5-gram of 36,660 words
//                           and width 256) and scores every n-gram in the decoder, table sums
//                           and a dot product each (a tree: a few node dot products; and a model's
//                           direct n-gram features: one hashed weight per context suffix
//                           from each of their two tables), with no cache and no request.
//                           A class-output model's tables give self-normalised scores, so it
//                           needs normalized=false (refused at load otherwise); a tree-output
//                           model's give exact log-probabilities, with normalized=true (the
//                           default) or false. The server then answers nothing per n-gram, and
//                           a reload of the server does not reach a running decoder
//   tables=FILE             scoring=local from a tables file (`nlmserve export-tables --model M --out
//                           FILE`) mapped read-only instead of fetched: every decoder of a host
//                           that maps the same file shares one copy of the tables (the page
//                           cache's), where fetched tables are a copy per process. The file's
//                           vocabulary maps the words to ids (lowercased first as the client
//                           does) and its header gives the model's order, special ids and hash,
//                           so no server is needed. Implies scoring=local (scoring=server
//                           beside it is refused). With path= as well, the server is asked at
//                           load which model it serves, and a file of another model (hash,
//                           order, vocabulary) stops the decoder; nothing more is asked of it
//   prefetch=stack|hypothesis|false
//                           stack (default; also true): when Moses' normal stack search starts
//                           expanding a stack, score the boundary n-grams of every possible
//                           expansion of every hypothesis in it in one request; hypothesis:
//                           one request per expanded hypothesis; false: one request per new
//                           hypothesis (cube pruning and lattices always score on demand)
//
// Scores: the server answers log10; each n-gram is converted with Moses'
// TransformLMScore (times ln 10) and FloorScore, as the other single-factor LMs.
// State: the last order-1 words (left-padded with <s>), compared by value.
// Round trips: each target phrase scored in isolation costs at most one request (all
// its n-grams in one batch); with prefetch=stack, each stack that Moses expands costs one
// request for the boundary n-grams (and </s>) of all expansions of its hypotheses, which
// then come from the cache; cache hits cost none. With -v 1 the feature prints the round trips
// and the cache hits of every sentence.
//
// Words become vocabulary ids once per Moses factor (a table indexed by Factor::GetId(), read
// without a lock); n-grams are built as canonical rows of ids (nlmserve::CanonicalRow, the
// client library's one owner of the n-gram rules) in buffers each thread reuses, and scored in
// flat batches (nlmserve::Client::ScoreRows). The Moses-free parts are in nlmserve_decoder.h.
// The feature's code: NeuralLMServer.cpp (loading, the scores Moses asks for, the state),
// NeuralLMServerPrefetch.cpp (the batches scored ahead: table-prefetch, phrase-scores=sentence,
// prefetch) and NeuralLMServerThread.h (what each thread keeps).
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "SingleFactor.h"
#include "moses/FF/FFState.h"

namespace nlmserve {
class Client;
struct ModelInfo;
class DenseIdMap;
class ScoringTables;
class TablesVocabulary;
class ErrorPause;
struct FeatureOptions;
}  // namespace nlmserve

namespace Moses {

struct NeuralLMServerThread;

// The last order-1 words of a hypothesis (oldest first, <s>-padded), held inline: Moses
// makes one state per hypothesis it builds, so a state costs one allocation, not two.
class NeuralLMServerState : public FFState {
 public:
  // Longest context a state holds: models up to order kMaxContext + 1 (Load checks).
  static const size_t kMaxContext = 9;
  explicit NeuralLMServerState(size_t size, const Factor *fill = NULL) : m_size(size) {
    for (size_t i = 0; i < kMaxContext; ++i) m_words[i] = fill;
  }
  size_t hash() const override;
  bool operator==(const FFState &other) const override;
  size_t size() const { return m_size; }
  const Factor **words() { return m_words; }
  const Factor *const *words() const { return m_words; }

 private:
  size_t m_size;
  const Factor *m_words[kMaxContext];
};

class NeuralLMServer : public LanguageModelSingleFactor {
 public:
  explicit NeuralLMServer(const std::string &line);
  ~NeuralLMServer();

  void SetParameter(const std::string &key, const std::string &value) override;
  void Load(AllOptions::ptr const &opts) override;

  // One n-gram (Moses' generic path, e.g. chart decoding): one batch of one.
  LMResult GetValue(const std::vector<const Word *> &contextFactor, State *finalState = 0) const override;

  const FFState *GetNullContextState() const override;
  const FFState *GetBeginSentenceState() const override;
  FFState *NewState(const FFState *from = NULL) const override;
  LMResult GetValueForgotState(const std::vector<const Word *> &contextFactor, FFState &outState) const override;
  void GetState(const std::vector<const Word *> &contextFactor, FFState &outState) const override;

  // All n-grams of a target phrase in one batch.
  void CalcScore(const Phrase &phrase, float &fullScore, float &ngramScore, size_t &oovCount) const override;

  // phrase-scores=load: Moses' usual phrase scoring; sentence: nothing here ...
  void EvaluateInIsolation(const Phrase &source, const TargetPhrase &targetPhrase,
                           ScoreComponentCollection &scoreBreakdown,
                           ScoreComponentCollection &estimatedScores) const override;
  // ... and the same scores here, per translation option of the sentence.
  void EvaluateWithSourceContext(const InputType &input, const InputPath &inputPath,
                                 const TargetPhrase &targetPhrase, const StackVec *stackVec,
                                 ScoreComponentCollection &scoreBreakdown,
                                 ScoreComponentCollection *estimatedScores = NULL) const override;

  // All boundary n-grams of a hypothesis (and </s>) in one batch.
  using LanguageModelImplementation::EvaluateWhenApplied;
  FFState *EvaluateWhenApplied(const Hypothesis &hypo, const FFState *ps,
                               ScoreComponentCollection *out) const override;

  using LanguageModelSingleFactor::CleanUpAfterSentenceProcessing;
  void InitializeForInput(ttasksptr const &ttask) override;
  void CleanUpAfterSentenceProcessing(ttasksptr const &ttask) override;

 private:
  // The vocabulary id of a word (its factor's id, looked up once per factor in m_ids).
  uint32_t Id(const Word &word) const;
  // Appends the ids of the phrase's first `limit` words (all by default) to `ids`
  // (nlmserve::kNonTerminal for a non-terminal).
  void AppendIds(const Phrase &phrase, std::vector<uint32_t> *ids, size_t limit = size_t(-1)) const;
  // Scores `n` canonical rows (order ids each) into Moses scores (natural log, floored),
  // counted for the thread's sentence; a failure is handled as on-error says.
  void ScoreRows(const uint32_t *rows, size_t n, float *out, NeuralLMServerThread &local) const;
  // After a failed request: throws (on-error=fail), or floors the `n` scores and starts a pause.
  void Failed(const std::string &what, size_t n, float *out) const;
  // The last order-1 words of a context as nlmserve::CanonicalContext makes them.
  void SetState(const std::vector<const Word *> &contextFactor, FFState &outState) const;
  // Scores (into the cache), in one request, the boundary n-grams of every expansion
  // Moses' normal search can make from `prev` (prefetch=hypothesis) or from every
  // hypothesis of prev's stack (prefetch=stack), unless this thread just did so.
  // Keeps the boundary score of each expansion in `local` for EvaluateWhenApplied.
  void Prefetch(const Hypothesis &prev, NeuralLMServerThread &local) const;
  // Appends to local.rows the boundary rows of every expansion the normal search can make
  // from `prev`, and to local.expansions each expansion with the end of its rows.
  void ExpansionRows(const Hypothesis &prev, NeuralLMServerThread &local) const;
  // The n-grams of `hypo` that cross its phrase boundary (and </s>), scored and summed.
  float BoundaryScore(const Hypothesis &hypo, NeuralLMServerThread &local) const;
  // Appends to local.rows the rows CalcScore scores for a phrase; with `complete`, marks in
  // local.complete which have a full context.
  void PhraseRows(const Phrase &phrase, NeuralLMServerThread &local, bool complete, size_t *oovCount) const;
  // phrase-scores=sentence: one request for the phrase-internal n-grams of every target
  // phrase the in-memory phrase tables hold for spans of the sentence.
  void ScoreSentencePhrases(ttasksptr const &ttask) const;
  // table-prefetch: reads the target phrases of every in-memory phrase table's file and
  // scores their n-grams into the cache in batches, before the tables load.
  void PrefetchPhraseTables() const;

  std::string m_target;
  // The line's options (nlmserve_moses_ini.h); Load sets local_scoring for tables=FILE and
  // drops sentence_phrases where the search cannot use it.
  std::unique_ptr<nlmserve::FeatureOptions> m_options;

  // Without path= (a tables file alone), none: no connection is ever made.
  std::unique_ptr<nlmserve::Client> m_client;
  // The client library's types are held by pointer, so that this header (included by
  // moses/FF/Factory.cpp, which is compiled without the client library's include path)
  // needs only Moses' headers.
  std::unique_ptr<nlmserve::ModelInfo> m_model;  // the served model's order, vocabulary size and special ids
  std::unique_ptr<nlmserve::DenseIdMap> m_ids;   // Factor::GetId() -> vocabulary id
  std::shared_ptr<const nlmserve::ScoringTables> m_tables;  // scoring=local: the model's tables
  std::unique_ptr<nlmserve::TablesVocabulary> m_vocabulary;  // tables=FILE: the file's words -> ids
  NeuralLMServerState *m_nullState;
  NeuralLMServerState *m_beginState;

  mutable std::atomic<uint64_t> m_sentences;
  mutable std::atomic<uint64_t> m_sentenceRoundTrips;
  mutable std::atomic<uint64_t> m_errors;
  // on-error=floor: requests answered LOWEST_SCORE, and the pause after failures.
  mutable std::atomic<uint64_t> m_floored;
  // Boundary scores of all sentences: at the prefetch's cursor, looked up, scored alone.
  mutable std::atomic<uint64_t> m_inOrder, m_lookedUp, m_scoredAlone;
  // scoring=local: n-grams scored in the decoder, the position rows summed for them, a
  // tree's node dot products computed and the rows whose scores the tables remembered.
  mutable std::atomic<uint64_t> m_scoredLocally, m_rowsSummed, m_nodesComputed, m_rowsRemembered;
  std::unique_ptr<nlmserve::ErrorPause> m_pause;
};

}  // namespace Moses
