// NeuralLMServer: a Moses language-model feature that scores n-grams with an nlmserve model,
// from its tables file or by asking a server (see NeuralLMServer.h and moses_plugin/README.md).
//
// This file: loading (the client or the tables file, the model's facts checked against the
// line), the words' ids, ScoreRows (every score of the feature, local or from the server, and
// on-error), the scores Moses asks for (GetValue, CalcScore, EvaluateInIsolation,
// EvaluateWithSourceContext, EvaluateWhenApplied), the hypothesis state and the per-sentence
// counts. What is scored ahead of Moses' asking, in batches, is NeuralLMServerPrefetch.cpp's;
// what each thread keeps, NeuralLMServerThread.h's.
#include "NeuralLMServer.h"

#include <algorithm>
#include <cstdio>
#include <boost/functional/hash.hpp>

#include "moses/FactorCollection.h"
#include "moses/Hypothesis.h"
#include "moses/InputType.h"
#include "moses/Range.h"
#include "moses/ScoreComponentCollection.h"
#include "moses/InputPath.h"
#include "moses/Manager.h"
#include "moses/StaticData.h"
#include "moses/TranslationOption.h"
#include "moses/TranslationTask.h"
#include "moses/TypeDef.h"
#include "moses/Util.h"
#include "NeuralLMServerThread.h"
#include "nlmserve_client.h"
#include "nlmserve_decoder.h"
#include "nlmserve_moses_ini.h"
#include "nlmserve_tables_file.h"
#include "util/exception.hh"

namespace Moses {

size_t NeuralLMServerState::hash() const {
  return boost::hash_range(m_words, m_words + m_size);
}

bool NeuralLMServerState::operator==(const FFState &other) const {
  const NeuralLMServerState &o = static_cast<const NeuralLMServerState &>(other);
  return m_size == o.m_size && std::equal(m_words, m_words + m_size, o.m_words);
}

NeuralLMServer::NeuralLMServer(const std::string &line)
    : LanguageModelSingleFactor(line),
      m_options(new nlmserve::FeatureOptions()),
      m_model(new nlmserve::ModelInfo()),
      m_ids(new nlmserve::DenseIdMap()),
      m_nullState(NULL),
      m_beginState(NULL),
      m_sentences(0),
      m_sentenceRoundTrips(0),
      m_errors(0),
      m_floored(0),
      m_inOrder(0),
      m_lookedUp(0),
      m_scoredAlone(0),
      m_scoredLocally(0),
      m_rowsSummed(0),
      m_nodesComputed(0),
      m_rowsRemembered(0),
      m_pause(new nlmserve::ErrorPause()) {
  static_assert(NeuralLMServerState::kMaxContext + 1 == nlmserve::kLargestOrder,
                "a state holds the context of the largest order the line accepts");
  ReadParameters();
  m_target = m_filePath;
  const std::string wrong = nlmserve::LineError(*m_options, nlmserve::kLargestOrder);
  UTIL_THROW_IF2(!wrong.empty(), "NeuralLMServer: " << wrong);

  FactorCollection &factors = FactorCollection::Instance();
  m_sentenceStart = factors.AddFactor(Output, m_factorType, BOS_);
  m_sentenceStartWord[m_factorType] = m_sentenceStart;
  m_sentenceEnd = factors.AddFactor(Output, m_factorType, EOS_);
  m_sentenceEndWord[m_factorType] = m_sentenceEnd;
}

NeuralLMServer::~NeuralLMServer() {
  if (m_sentences.load() > 0) {
    VERBOSE(1, "NeuralLMServer " << GetScoreProducerDescription() << ": " << m_sentences.load()
                                 << " sentences, " << m_sentenceRoundTrips.load()
                                 << " round trips, " << m_errors.load() << " failed requests, "
                                 << m_floored.load() << " requests floored");
    if (m_client) {
      nlmserve::ClientStats stats = m_client->stats();
      VERBOSE(1, ", " << stats.ngrams_sent << " n-grams sent, " << stats.cache_hits << " cache hits, "
                      << stats.cache_misses << " misses");
    }
    if (m_tables) {
      VERBOSE(1, ", " << m_scoredLocally.load() << " n-grams scored locally (");
      VERBOSE(1, m_rowsRemembered.load() << " remembered, " << m_rowsSummed.load() << " position rows summed");
      if (m_tables->normalized()) VERBOSE(1, ", " << m_nodesComputed.load() << " tree nodes computed");
      VERBOSE(1, ")");
    }
    VERBOSE(1, "; boundary scores: " << m_inOrder.load() << " in order, " << m_lookedUp.load() << " looked up, "
                                     << m_scoredAlone.load() << " scored alone");
    VERBOSE(1, std::endl);
  }
  delete m_nullState;
  delete m_beginState;
}

// The options are read by nlmserve::SetFeatureOption (nlmserve_moses_ini.h, Moses-free): the
// feature's own set there, Moses' base classes' checked there, then set by Moses.
void NeuralLMServer::SetParameter(const std::string &key, const std::string &value) {
  std::string error;
  const nlmserve::OptionKind kind = nlmserve::SetFeatureOption(key, value, m_options.get(), &error);
  UTIL_THROW_IF2(kind == nlmserve::OptionKind::kRefused, "NeuralLMServer: " << error);
  if (kind == nlmserve::OptionKind::kMoses) LanguageModelSingleFactor::SetParameter(key, value);
}

void NeuralLMServer::Load(AllOptions::ptr const &opts) {
  // Per-sentence phrase scoring needs phrase-based search (chart decoding subtracts the
  // scores given in isolation).
  if (opts && opts->search.algo != Normal && opts->search.algo != CubePruning) m_options->sentence_phrases = false;
  const std::string name = "NeuralLMServer " + GetScoreProducerDescription();
  if (!m_options->tables.empty()) m_options->local_scoring = true;  // SourceError has refused scoring=server beside it
  if (!m_target.empty()) {
    nlmserve::ClientOptions options;
    options.deadline_ms = static_cast<int>(m_options->deadline_ms);
    options.connect_timeout_ms = static_cast<int>(m_options->connect_timeout_ms);
    options.retries = static_cast<int>(m_options->retries);
    options.cache_size = m_options->local_scoring ? 0 : m_options->cache_size;  // local scores cost less than a lookup
    options.lowercase = m_options->lowercase;
    options.normalized = m_options->normalized;
    options.tls_ca = m_options->tls_ca;
    options.tls_cert = m_options->tls_cert;
    options.tls_key = m_options->tls_key;
    options.tls_server_name = m_options->tls_server_name;
    options.token_file = m_options->token_file;
    try {
      m_client.reset(new nlmserve::Client(m_target, options));
    } catch (const nlmserve::ClientError &e) {
      UTIL_THROW2(name << ": " << e.what());
    }
    *m_model = m_client->info();
  }
  if (!m_options->tables.empty()) {
    // The file gives the tables, the vocabulary and the model's facts: no server is needed.
    nlmserve::TablesFile file;
    std::string error;
    UTIL_THROW_IF2(!nlmserve::MapTablesFile(m_options->tables, &file, &error), name << ": tables=" << error);
    if (m_client) {
      const std::string mismatch = nlmserve::TablesMismatch(file.info, *m_model, m_options->tables, m_target);
      UTIL_THROW_IF2(!mismatch.empty(), name << ": " << mismatch);
      m_client.reset();  // asked which model it serves; nothing more is asked of it
    }
    *m_model = nlmserve::ModelInfoOf(file.info);
    m_tables = file.tables;
    m_vocabulary.reset(new nlmserve::TablesVocabulary(file.vocabulary));
  } else if (m_options->local_scoring) {
    try {
      m_tables = m_client->GetScoringTables();
    } catch (const nlmserve::ClientError &e) {
      UTIL_THROW2(name << ": scoring=local: " << e.what());
    }
  }
  const nlmserve::ModelInfo &info = *m_model;
  const std::string where = m_options->tables.empty() ? m_target : m_options->tables;
  // The decoder's own sentence boundaries are the model's special ids.
  m_ids->Set(m_sentenceStart->GetId(), info.bos_id);
  m_ids->Set(m_sentenceEnd->GetId(), info.eos_id);
  const std::string wrongOrder = nlmserve::OrderMismatch(m_nGramOrder, info.order, where);
  UTIL_THROW_IF2(!wrongOrder.empty(), name << ": " << wrongOrder);
  m_beginState = new NeuralLMServerState(m_nGramOrder - 1, m_sentenceStart);
  m_nullState = new NeuralLMServerState(m_nGramOrder - 1, m_sentenceStart);
  if (m_options->local_scoring) {
    // A tree output's tables give exact log-probabilities; a class output's give the
    // self-normalised score, not what normalized=true (the default) asks for.
    UTIL_THROW_IF2(m_options->normalized && !m_tables->normalized(),
                   name << ": scoring=local computes self-normalised scores only with a class-output model: add "
                           "normalized=false, use scoring=server, or serve a tree-output model (exact scores)");
    VERBOSE(1, name << ": scoring locally with " << m_tables->bytes() / 1048576 << " MB of tables"
                    << (m_tables->mapped() ? " mapped from " + m_options->tables : std::string(" fetched")) << " (width "
                    << m_tables->dim()
                    << (m_tables->normalized() ? ", a tree: exact log-probabilities" : ", self-normalised") << ")"
                    << (m_client ? "" : "; no server") << std::endl);
  }
  // phrase-scores=load asks for each target phrase's n-grams as the tables load it, one
  // request per phrase; reading the in-memory tables' target phrases first puts their
  // n-grams into the cache in a few large requests.
  const bool phraseBased = !opts || opts->search.algo == Normal || opts->search.algo == CubePruning;
  if (m_options->table_prefetch && phraseBased && !m_options->sentence_phrases && !m_options->local_scoring && m_options->cache_size > 0) {
    PrefetchPhraseTables();
  }
  VERBOSE(1, name << ": " << where << " model " << info.model_hash << " order " << info.order << " vocabulary "
                  << info.vocab_size << (m_options->normalized ? " normalized" : " unnormalized") << std::endl);
}

uint32_t NeuralLMServer::Id(const Word &word) const {
  const Factor *f = word.GetFactor(m_factorType);
  // Factor ids are unique and dense; the vocabulary (the tables file's, else the client's) is
  // asked once per factor.
  return m_ids->Get(f->GetId(), [this, f](size_t) {
    const std::string text = f->GetString().as_string();
    return m_vocabulary ? nlmserve::FileWordId(*m_vocabulary, text, m_options->lowercase) : m_client->WordId(text);
  });
}

void NeuralLMServer::AppendIds(const Phrase &phrase, std::vector<uint32_t> *ids, size_t limit) const {
  const size_t size = std::min(phrase.GetSize(), limit);
  for (size_t pos = 0; pos < size; ++pos) {
    const Word &word = phrase.GetWord(pos);
    ids->push_back(word.IsNonTerminal() ? nlmserve::kNonTerminal : Id(word));
  }
}

void NeuralLMServer::ScoreRows(const uint32_t *rows, size_t n, float *out, NeuralLMServerThread &local) const {
  if (n == 0) return;
  if (m_tables) {
    // The tables are read at the rows' ids: every row comes from CanonicalRow, PhraseRows or
    // BoundaryRows, which check each id (nlmserve_decoder.h), so they are not checked again.
    const uint64_t summed = local.tables.rows_added, computed = local.tables.nodes_computed,
                   remembered = local.tables.rows_remembered;
    m_tables->Score(rows, n, out, &local.tables);  // natural log, as TransformLMScore makes it
    for (size_t i = 0; i < n; ++i) out[i] = FloorScore(out[i]);
    local.scoredLocally += n;
    local.rowsSummed += local.tables.rows_added - summed;
    local.nodesComputed += local.tables.nodes_computed - computed;
    local.rowsRemembered += local.tables.rows_remembered - remembered;
    return;
  }
  // on-error=floor: after a failed request the server is left alone for a pause, so that
  // a dead server costs one failed request per pause instead of one per request.
  if (m_options->floor_on_error && m_pause->Paused(SteadyMs())) {
    m_floored.fetch_add(1);
    std::fill(out, out + n, LOWEST_SCORE);
    return;
  }
  try {
    m_client->ScoreRows(rows, n, m_model->order, out, &local.sentence);
  } catch (const nlmserve::ClientError &e) {
    Failed(e.what(), n, out);
    return;
  }
  m_pause->Succeeded();
  for (size_t i = 0; i < n; ++i) out[i] = FloorScore(TransformLMScore(out[i]));
}

void NeuralLMServer::Failed(const std::string &what, size_t n, float *out) const {
  m_errors.fetch_add(1);
  if (!m_options->floor_on_error) {
    UTIL_THROW2("NeuralLMServer " << GetScoreProducerDescription() << ": " << what);
  }
  const int64_t pause = m_pause->Failed(SteadyMs());
  m_floored.fetch_add(1);
  VERBOSE(1, "NeuralLMServer " << GetScoreProducerDescription() << ": " << what << "; scoring " << n
                               << " n-grams " << LOWEST_SCORE << ", and every request of the next " << pause
                               << " ms" << std::endl);
  std::fill(out, out + n, LOWEST_SCORE);
}

void NeuralLMServer::SetState(const std::vector<const Word *> &contextFactor, FFState &outState) const {
  std::vector<const Factor *> &factors = Local(this).factors;
  factors.clear();
  for (size_t i = 0; i < contextFactor.size(); ++i) factors.push_back(contextFactor[i]->GetFactor(m_factorType));
  NeuralLMServerState &state = static_cast<NeuralLMServerState &>(outState);
  nlmserve::CanonicalContext(factors.data(), factors.size(), state.size(), m_sentenceStart, state.words());
}

LMResult NeuralLMServer::GetValue(const std::vector<const Word *> &contextFactor, State *finalState) const {
  NeuralLMServerThread &local = Local(this);
  local.words.clear();
  for (size_t i = 0; i < contextFactor.size(); ++i) local.words.push_back(Id(*contextFactor[i]));
  local.rows.resize(m_model->order);
  LMResult ret;
  ret.unknown = !local.words.empty() && local.words.back() == m_model->unk_id;
  const nlmserve::NgramError error =
      nlmserve::CanonicalRow(local.words.data(), local.words.size(), *m_model, local.rows.data());
  if (error != nlmserve::NgramError::kNone) {
    Failed(nlmserve::NgramErrorMessage(error, local.words.data(), local.words.size(), 0, *m_model), 1, &ret.score);
  } else {
    ScoreRows(local.rows.data(), 1, &ret.score, local);
  }
  if (finalState) *finalState = NULL;
  return ret;
}

const FFState *NeuralLMServer::GetNullContextState() const { return m_nullState; }

const FFState *NeuralLMServer::GetBeginSentenceState() const { return m_beginState; }

FFState *NeuralLMServer::NewState(const FFState *from) const {
  if (from) return new NeuralLMServerState(*static_cast<const NeuralLMServerState *>(from));
  return new NeuralLMServerState(m_nGramOrder - 1, m_sentenceStart);
}

LMResult NeuralLMServer::GetValueForgotState(const std::vector<const Word *> &contextFactor,
                                             FFState &outState) const {
  LMResult ret = GetValue(contextFactor, NULL);
  SetState(contextFactor, outState);
  return ret;
}

void NeuralLMServer::GetState(const std::vector<const Word *> &contextFactor, FFState &outState) const {
  SetState(contextFactor, outState);  // no score needed, so no request
}

void NeuralLMServer::PhraseRows(const Phrase &phrase, NeuralLMServerThread &local, bool complete,
                                size_t *oovCount) const {
  // The n-grams of the phrase as Moses' LanguageModelImplementation::CalcScore walks them
  // (a non-terminal resets the context; <s> first is context only).
  local.words.clear();
  AppendIds(phrase, &local.words);
  size_t position = 0;
  const nlmserve::NgramError error = nlmserve::PhraseRows(*m_model, local.words.data(), local.words.size(), &local.rows,
                                                          complete ? &local.complete : NULL, oovCount, &position);
  UTIL_THROW_IF2(error == nlmserve::NgramError::kBosTarget,
                 "NeuralLMServer: <s> inside a phrase at position " << position);
  UTIL_THROW_IF2(error != nlmserve::NgramError::kNone,
                 "NeuralLMServer: " << nlmserve::NgramErrorMessage(error, local.words.data() + position, 1, 0, *m_model));
}

void NeuralLMServer::CalcScore(const Phrase &phrase, float &fullScore, float &ngramScore,
                               size_t &oovCount) const {
  fullScore = 0;
  ngramScore = 0;
  oovCount = 0;
  NeuralLMServerThread &local = Local(this);
  local.rows.clear();
  local.complete.clear();
  PhraseRows(phrase, local, true, &oovCount);
  const size_t n = local.complete.size();
  if (n == 0) return;
  local.scores.resize(n);
  ScoreRows(local.rows.data(), n, local.scores.data(), local);
  for (size_t i = 0; i < n; ++i) {
    fullScore += local.scores[i];
    if (local.complete[i]) ngramScore += local.scores[i];
  }
}

void NeuralLMServer::EvaluateInIsolation(const Phrase &source, const TargetPhrase &targetPhrase,
                                         ScoreComponentCollection &scoreBreakdown,
                                         ScoreComponentCollection &estimatedScores) const {
  if (m_options->sentence_phrases) return;  // scored per sentence in EvaluateWithSourceContext
  LanguageModelSingleFactor::EvaluateInIsolation(source, targetPhrase, scoreBreakdown, estimatedScores);
}

void NeuralLMServer::EvaluateWithSourceContext(const InputType & /*input*/, const InputPath & /*inputPath*/,
                                               const TargetPhrase &targetPhrase, const StackVec *stackVec,
                                               ScoreComponentCollection &scoreBreakdown,
                                               ScoreComponentCollection *estimatedScores) const {
  if (!m_options->sentence_phrases || stackVec != NULL) return;
  // The same values LanguageModel::EvaluateInIsolation assigns; after
  // ScoreSentencePhrases they come from the cache.
  float fullScore, ngramScore;
  size_t oovCount;
  CalcScore(targetPhrase, fullScore, ngramScore, oovCount);
  if (OOVFeatureEnabled()) {
    std::vector<float> scores(2), estimates(2);
    scores[0] = ngramScore;
    scores[1] = oovCount;
    scoreBreakdown.PlusEquals(this, scores);
    estimates[0] = fullScore - ngramScore;
    if (estimatedScores) estimatedScores->PlusEquals(this, estimates);
  } else {
    scoreBreakdown.PlusEquals(this, ngramScore);
    if (estimatedScores) estimatedScores->PlusEquals(this, fullScore - ngramScore);
  }
}

FFState *NeuralLMServer::EvaluateWhenApplied(const Hypothesis &hypo, const FFState *ps,
                                             ScoreComponentCollection *out) const {
  // Only the n-grams that cross the phrase boundary (and </s>): the phrase-internal
  // ones came with the translation option (CalcScore).
  if (hypo.GetCurrTargetLength() == 0) return ps ? NewState(ps) : NULL;

  NeuralLMServerThread &local = Local(this);
  const Hypothesis *prev = hypo.GetPrevHypo();
  float lmScore = 0;
  nlmserve::ExpansionScores::Found found = nlmserve::ExpansionScores::kNotFound;
  if (m_options->prefetch != nlmserve::FeatureOptions::kPrefetchOff && prev != NULL) {
    const TranslationOption *option = &hypo.GetTranslationOption();
    // Moses evaluates the expansions in the order the prefetch listed them: the next one
    // is normally the entry at the cursor. Such a match also means that prev belongs to
    // what this thread prefetched last in this sentence (the entries are this sentence's:
    // InitializeForInput empties them; and the hypotheses they name are alive, so no
    // other hypothesis has their address), so Prefetch would do nothing and is skipped.
    // Otherwise Prefetch first (a new stack renews the entries), then the full lookup.
    if (local.boundary.Next(prev, option, &lmScore)) {
      found = nlmserve::ExpansionScores::kInOrder;
    } else {
      Prefetch(*prev, local);
      found = local.boundary.Get(prev, option, &lmScore);
    }
  }
  if (found == nlmserve::ExpansionScores::kInOrder) {
    ++local.inOrder;
  } else if (found == nlmserve::ExpansionScores::kLookedUp) {
    ++local.lookedUp;
  } else {
    ++local.scoredAlone;
    lmScore = BoundaryScore(hypo, local);
  }

  // The state: the last order-1 words, then </s> when the sentence is complete.
  const size_t keep = m_nGramOrder - 1;
  const size_t size = hypo.GetSize();
  local.factors.clear();
  for (size_t pos = size > keep ? size - keep : 0; pos < size; ++pos) {
    local.factors.push_back(hypo.GetWord(pos).GetFactor(m_factorType));
  }
  if (hypo.IsSourceCompleted()) local.factors.push_back(m_sentenceEnd);
  NeuralLMServerState *res = new NeuralLMServerState(keep);
  nlmserve::CanonicalContext(local.factors.data(), local.factors.size(), keep, m_sentenceStart, res->words());

  if (OOVFeatureEnabled()) {
    std::vector<float> values(2);
    values[0] = lmScore;
    values[1] = 0;
    out->PlusEquals(this, values);
  } else {
    out->PlusEquals(this, lmScore);
  }
  return res;
}

float NeuralLMServer::BoundaryScore(const Hypothesis &hypo, NeuralLMServerThread &local) const {
  // The words before the phrase (at most order-1 of them), then the phrase.
  const size_t keep = m_model->order - 1;
  const size_t start = hypo.GetCurrTargetWordsRange().GetStartPos();
  local.words.clear();
  for (size_t pos = start > keep ? start - keep : 0; pos < start; ++pos) local.words.push_back(Id(hypo.GetWord(pos)));
  const size_t context = local.words.size();
  AppendIds(hypo.GetCurrTargetPhrase(), &local.words);
  local.rows.clear();
  const nlmserve::NgramError error = nlmserve::BoundaryRows(*m_model, local.words.data(), context, local.words.size(),
                                                            hypo.IsSourceCompleted(), &local.rows);
  UTIL_THROW_IF2(error != nlmserve::NgramError::kNone,
                 "NeuralLMServer: a boundary n-gram breaks the rule " << nlmserve::NgramErrorKind(error));
  const size_t n = local.rows.size() / m_model->order;
  local.scores.resize(n);
  ScoreRows(local.rows.data(), n, local.scores.data(), local);
  return nlmserve::SumScores(local.scores.data(), n);  // as Prefetch sums
}

void NeuralLMServer::InitializeForInput(ttasksptr const &ttask) {
  ++SentenceSerial();
  NeuralLMServerThread &local = Local(this);
  local.sentence = nlmserve::BatchCounts();
  local.inOrder = local.lookedUp = local.scoredAlone = local.scoredLocally = local.rowsSummed = 0;
  local.nodesComputed = local.rowsRemembered = 0;
  // The last sentence's expansions name its hypotheses, whose addresses this one may
  // reuse: EvaluateWhenApplied trusts an entry that matches at the cursor.
  local.boundary.Clear();
  if (m_options->sentence_phrases) ScoreSentencePhrases(ttask);
}

void NeuralLMServer::CleanUpAfterSentenceProcessing(ttasksptr const &ttask) {
  const NeuralLMServerThread &local = Local(this);
  const nlmserve::BatchCounts &counts = local.sentence;
  m_sentences.fetch_add(1);
  m_sentenceRoundTrips.fetch_add(counts.round_trips);
  m_inOrder.fetch_add(local.inOrder);
  m_lookedUp.fetch_add(local.lookedUp);
  m_scoredAlone.fetch_add(local.scoredAlone);
  m_scoredLocally.fetch_add(local.scoredLocally);
  m_rowsSummed.fetch_add(local.rowsSummed);
  m_nodesComputed.fetch_add(local.nodesComputed);
  m_rowsRemembered.fetch_add(local.rowsRemembered);
  const uint64_t lookups = counts.cache_hits + counts.cache_misses;
  char rate[32] = "no lookups";
  if (lookups > 0) std::snprintf(rate, sizeof(rate), "%.1f%% hits", 100.0 * counts.cache_hits / lookups);
  VERBOSE(1, "NeuralLMServer " << GetScoreProducerDescription() << ": sentence "
                               << ttask->GetSource()->GetTranslationId() << " took " << counts.round_trips
                               << " round trips, " << counts.ngrams_sent << " n-grams sent; cache: "
                               << counts.cache_hits << " hits, " << counts.cache_misses << " misses (" << rate
                               << "); boundary scores: " << local.inOrder << " in order, " << local.lookedUp
                               << " looked up, " << local.scoredAlone << " scored alone" << std::endl);
  LanguageModelSingleFactor::CleanUpAfterSentenceProcessing(ttask);
}

}  // namespace Moses
