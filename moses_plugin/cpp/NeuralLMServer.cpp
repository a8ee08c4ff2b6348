// NeuralLMServer: a Moses language-model feature that asks an nlmserve server
// (see NeuralLMServer.h and moses_plugin/README.md).
#include "NeuralLMServer.h"

#include <algorithm>
#include <chrono>
#include <unordered_map>
#include <boost/functional/hash.hpp>

#include "moses/FactorCollection.h"
#include "moses/Hypothesis.h"
#include "moses/InputType.h"
#include "moses/Range.h"
#include "moses/ScoreComponentCollection.h"
#include "moses/InputPath.h"
#include "moses/Manager.h"
#include "moses/SearchNormal.h"
#include "moses/ReorderingConstraint.h"
#include "moses/StaticData.h"
#include "moses/TranslationOption.h"
#include "moses/TranslationOptionCollection.h"
#include "moses/TranslationOptionList.h"
#include "moses/TranslationModel/PhraseDictionary.h"
#include "moses/TranslationModel/PhraseDictionaryMemory.h"
#include "moses/TranslationTask.h"
#include "moses/TypeDef.h"
#include "moses/Util.h"
#include "nlmserve_client.h"
#include "util/exception.hh"

namespace Moses {

namespace {
// Round trips of this thread when its current sentence started.
thread_local uint64_t tl_sentence_start = 0;
// Sentences this thread started (a count, so that pointers of an earlier sentence that
// a later one reuses are never mistaken for its own).
thread_local uint64_t tl_sentence = 0;

// A predecessor hypothesis and the translation option that expands it.
typedef std::pair<const void *, const void *> Expansion;
struct ExpansionHash {
  size_t operator()(const Expansion &e) const {
    size_t seed = 0;
    boost::hash_combine(seed, e.first);
    boost::hash_combine(seed, e.second);
    return seed;
  }
};

}  // namespace

// What one thread keeps for one NeuralLMServer feature.
struct NeuralLMServerThread {
  // Factor id -> word id (-1: not looked up yet): the vocabulary, a string map, is asked
  // once per word.
  std::vector<int64_t> ids;
  // The hypothesis (prefetch=hypothesis) or stack (prefetch=stack) prefetched last, and
  // the value of tl_sentence then.
  const void *prefetched = NULL;
  uint64_t prefetchedSentence = 0;
  // The boundary score of every expansion prefetched last: EvaluateWhenApplied reads it
  // instead of asking the client's cache n-gram by n-gram.
  std::unordered_map<Expansion, float, ExpansionHash> boundary;
};

namespace {
int64_t SteadyMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

NeuralLMServerThread &Local(const void *feature) {
  thread_local std::unordered_map<const void *, NeuralLMServerThread> states;
  return states[feature];
}
// Manager keeps its Search protected; a pointer to the member named through a derived
// class reads it without changing Moses.
struct ManagerSearch : public Manager {
  static const Search *Of(const Manager &manager) { return manager.*(&ManagerSearch::m_search); }
};
}  // namespace

size_t NeuralLMServerState::hash() const {
  return boost::hash_range(m_words.begin(), m_words.end());
}

bool NeuralLMServerState::operator==(const FFState &other) const {
  return m_words == static_cast<const NeuralLMServerState &>(other).m_words;
}

NeuralLMServer::NeuralLMServer(const std::string &line)
    : LanguageModelSingleFactor(line),
      m_normalized(true),
      m_cacheSize(1 << 20),
      m_lowercase(false),
      m_deadlineMs(10000),
      m_connectTimeoutMs(5000),
      m_retries(2),
      m_floorOnError(false),
      m_prefetch(PrefetchStack),
      m_sentencePhrases(true),
      m_bosId(1),
      m_eosId(2),
      m_unkId(0),
      m_nullState(NULL),
      m_beginState(NULL),
      m_sentences(0),
      m_sentenceRoundTrips(0),
      m_errors(0),
      m_floored(0),
      m_pauseMs(0),
      m_downUntilMs(0) {
  ReadParameters();
  m_target = m_filePath;
  UTIL_THROW_IF2(m_target.empty(), "NeuralLMServer needs path=HOST:PORT (or A:1,B:2 or dns:///NAME:PORT) of nlmserve");
  UTIL_THROW_IF2(m_nGramOrder == NOT_FOUND, "NeuralLMServer needs order= (the served model's order)");
  UTIL_THROW_IF2(m_nGramOrder < 2, "NeuralLMServer: order must be at least 2, got " << m_nGramOrder);

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
    VERBOSE(1, std::endl);
  }
  delete m_nullState;
  delete m_beginState;
}

void NeuralLMServer::SetParameter(const std::string &key, const std::string &value) {
  if (key == "normalized") {
    m_normalized = Scan<bool>(value);
  } else if (key == "cache-size") {
    m_cacheSize = Scan<size_t>(value);
  } else if (key == "lowercase") {
    m_lowercase = Scan<bool>(value);
  } else if (key == "deadline-ms") {
    m_deadlineMs = Scan<int>(value);
  } else if (key == "connect-timeout-ms") {
    m_connectTimeoutMs = Scan<int>(value);
  } else if (key == "retries") {
    m_retries = Scan<int>(value);
  } else if (key == "phrase-scores") {
    UTIL_THROW_IF2(value != "sentence" && value != "load",
                   "NeuralLMServer: phrase-scores must be sentence or load, got " << value);
    m_sentencePhrases = (value == "sentence");
  } else if (key == "prefetch") {
    if (value == "stack" || value == "true") {
      m_prefetch = PrefetchStack;
    } else if (value == "hypothesis") {
      m_prefetch = PrefetchHypothesis;
    } else {
      UTIL_THROW_IF2(value != "false", "NeuralLMServer: prefetch must be stack, hypothesis or false, got " << value);
      m_prefetch = PrefetchOff;
    }
  } else if (key == "tls-ca") {
    m_tlsCa = value;
  } else if (key == "tls-cert") {
    m_tlsCert = value;
  } else if (key == "tls-key") {
    m_tlsKey = value;
  } else if (key == "tls-server-name") {
    m_tlsServerName = value;
  } else if (key == "token-file") {
    m_tokenFile = value;
  } else if (key == "on-error") {
    UTIL_THROW_IF2(value != "fail" && value != "floor",
                   "NeuralLMServer: on-error must be fail or floor, got " << value);
    m_floorOnError = (value == "floor");
  } else {
    LanguageModelSingleFactor::SetParameter(key, value);
  }
}

void NeuralLMServer::Load(AllOptions::ptr const &opts) {
  // Per-sentence phrase scoring needs phrase-based search (chart decoding subtracts the
  // scores given in isolation).
  if (opts && opts->search.algo != Normal && opts->search.algo != CubePruning) m_sentencePhrases = false;
  nlmserve::ClientOptions options;
  options.deadline_ms = m_deadlineMs;
  options.connect_timeout_ms = m_connectTimeoutMs;
  options.retries = m_retries;
  options.cache_size = m_cacheSize;
  options.lowercase = m_lowercase;
  options.normalized = m_normalized;
  options.tls_ca = m_tlsCa;
  options.tls_cert = m_tlsCert;
  options.tls_key = m_tlsKey;
  options.tls_server_name = m_tlsServerName;
  options.token_file = m_tokenFile;
  try {
    m_client.reset(new nlmserve::Client(m_target, options));
  } catch (const nlmserve::ClientError &e) {
    UTIL_THROW2("NeuralLMServer " << GetScoreProducerDescription() << ": " << e.what());
  }
  const nlmserve::ModelInfo &info = m_client->info();
  m_bosId = info.bos_id;
  m_eosId = info.eos_id;
  m_unkId = info.unk_id;
  // A shorter order would send short n-grams, which the server reads as sentence
  // starts (left-padded with <s>): the orders must agree.
  UTIL_THROW_IF2(m_nGramOrder != info.order,
                 "NeuralLMServer " << GetScoreProducerDescription() << ": order=" << m_nGramOrder
                                   << " but the model at " << m_target << " has order " << info.order);
  std::vector<const Factor *> begin(m_nGramOrder - 1, m_sentenceStart);
  m_beginState = new NeuralLMServerState(begin);
  m_nullState = new NeuralLMServerState(begin);
  VERBOSE(1, "NeuralLMServer " << GetScoreProducerDescription() << ": " << m_target << " model "
                               << info.model_hash << " order " << info.order << " vocabulary "
                               << info.vocab_size << (m_normalized ? " normalized" : " unnormalized")
                               << std::endl);
}

uint32_t NeuralLMServer::Id(const Word &word) const {
  const Factor *f = word.GetFactor(m_factorType);
  if (f == m_sentenceStart) return m_bosId;
  if (f == m_sentenceEnd) return m_eosId;
  // Factor ids are unique and dense.
  std::vector<int64_t> &ids = Local(this).ids;
  const size_t key = f->GetId();
  if (key >= ids.size()) ids.resize(std::max(key + 1, 2 * ids.size()), -1);
  if (ids[key] < 0) ids[key] = m_client->WordId(f->GetString().as_string());
  return static_cast<uint32_t>(ids[key]);
}

std::vector<float> NeuralLMServer::ScoreIds(const std::vector<std::vector<uint32_t> > &ngrams) const {
  std::vector<float> scores;
  // on-error=floor: after a failed request the server is left alone for a pause (1 s,
  // doubling after each further failure up to 60 s), so that a dead server costs one
  // failed request per pause instead of one per request.
  if (m_floorOnError && SteadyMs() < m_downUntilMs.load()) {
    m_floored.fetch_add(1);
    return std::vector<float>(ngrams.size(), LOWEST_SCORE);
  }
  try {
    scores = m_client->ScoreBatch(ngrams);
  } catch (const nlmserve::ClientError &e) {
    m_errors.fetch_add(1);
    if (!m_floorOnError) {
      UTIL_THROW2("NeuralLMServer " << GetScoreProducerDescription() << ": " << e.what());
    }
    const int64_t pause = std::min<int64_t>(60000, std::max<int64_t>(1000, 2 * m_pauseMs.load()));
    m_pauseMs.store(pause);
    m_downUntilMs.store(SteadyMs() + pause);
    m_floored.fetch_add(1);
    VERBOSE(1, "NeuralLMServer " << GetScoreProducerDescription() << ": " << e.what() << "; scoring "
                                 << ngrams.size() << " n-grams " << LOWEST_SCORE
                                 << ", and every request of the next " << pause << " ms" << std::endl);
    return std::vector<float>(ngrams.size(), LOWEST_SCORE);
  }
  m_pauseMs.store(0);
  for (size_t i = 0; i < scores.size(); ++i) scores[i] = FloorScore(TransformLMScore(scores[i]));
  return scores;
}

void NeuralLMServer::SetState(const std::vector<const Word *> &contextFactor, FFState &outState) const {
  const size_t keep = m_nGramOrder - 1;
  std::vector<const Factor *> &words = static_cast<NeuralLMServerState &>(outState).m_words;
  words.assign(keep, m_sentenceStart);
  const size_t n = std::min(keep, contextFactor.size());
  for (size_t i = 0; i < n; ++i) {
    words[keep - n + i] = contextFactor[contextFactor.size() - n + i]->GetFactor(m_factorType);
  }
  for (size_t j = keep; j-- > 0;) {
    if (words[j] == m_sentenceStart) {
      std::fill(words.begin(), words.begin() + j, m_sentenceStart);
      break;
    }
  }
}

LMResult NeuralLMServer::GetValue(const std::vector<const Word *> &contextFactor, State *finalState) const {
  std::vector<std::vector<uint32_t> > ngram(1);
  for (size_t i = 0; i < contextFactor.size(); ++i) ngram[0].push_back(Id(*contextFactor[i]));
  LMResult ret;
  ret.score = ScoreIds(ngram)[0];
  ret.unknown = ngram[0].back() == m_unkId;
  if (finalState) *finalState = NULL;
  return ret;
}

const FFState *NeuralLMServer::GetNullContextState() const { return m_nullState; }

const FFState *NeuralLMServer::GetBeginSentenceState() const { return m_beginState; }

FFState *NeuralLMServer::NewState(const FFState *from) const {
  if (from) return new NeuralLMServerState(*static_cast<const NeuralLMServerState *>(from));
  return new NeuralLMServerState(std::vector<const Factor *>(m_nGramOrder - 1, m_sentenceStart));
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

void NeuralLMServer::PhraseNgrams(const Phrase &phrase, std::vector<std::vector<uint32_t> > *ngrams,
                                  std::vector<bool> *complete, size_t *oovCount) const {
  // The n-grams of the phrase as Moses' LanguageModelImplementation::CalcScore
  // walks them (a non-terminal resets the context).
  const size_t size = phrase.GetSize();
  std::vector<uint32_t> context;
  for (size_t pos = 0; pos < size; ++pos) {
    const Word &word = phrase.GetWord(pos);
    if (word.IsNonTerminal()) {
      context.clear();
      continue;
    }
    uint32_t id = Id(word);
    if (context.size() == m_nGramOrder) context.erase(context.begin());
    context.push_back(id);
    if (word.GetFactor(m_factorType) == m_sentenceStart) {
      UTIL_THROW_IF2(pos != 0, "NeuralLMServer: <s> inside a phrase at position " << pos);
      continue;  // <s> is context, never predicted
    }
    ngrams->push_back(context);
    if (complete) complete->push_back(context.size() == m_nGramOrder);
    if (oovCount && id == m_unkId) ++*oovCount;
  }
}

void NeuralLMServer::CalcScore(const Phrase &phrase, float &fullScore, float &ngramScore,
                               size_t &oovCount) const {
  fullScore = 0;
  ngramScore = 0;
  oovCount = 0;
  std::vector<std::vector<uint32_t> > ngrams;
  std::vector<bool> complete;
  PhraseNgrams(phrase, &ngrams, &complete, &oovCount);
  if (ngrams.empty()) return;
  std::vector<float> scores = ScoreIds(ngrams);
  for (size_t i = 0; i < scores.size(); ++i) {
    fullScore += scores[i];
    if (complete[i]) ngramScore += scores[i];
  }
}

void NeuralLMServer::EvaluateInIsolation(const Phrase &source, const TargetPhrase &targetPhrase,
                                         ScoreComponentCollection &scoreBreakdown,
                                         ScoreComponentCollection &estimatedScores) const {
  if (m_sentencePhrases) return;  // scored per sentence in EvaluateWithSourceContext
  LanguageModelSingleFactor::EvaluateInIsolation(source, targetPhrase, scoreBreakdown, estimatedScores);
}

void NeuralLMServer::EvaluateWithSourceContext(const InputType & /*input*/, const InputPath & /*inputPath*/,
                                               const TargetPhrase &targetPhrase, const StackVec *stackVec,
                                               ScoreComponentCollection &scoreBreakdown,
                                               ScoreComponentCollection *estimatedScores) const {
  if (!m_sentencePhrases || stackVec != NULL) return;
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

void NeuralLMServer::ScoreSentencePhrases(ttasksptr const &ttask) const {
  const InputType &input = *ttask->GetSource();
  if (input.GetType() != SentenceInput) return;
  const Phrase *sentence = dynamic_cast<const Phrase *>(&input);
  if (sentence == NULL) return;
  const size_t size = sentence->GetSize();
  const size_t maxLength = ttask->options()->search.max_phrase_length;
  std::vector<std::vector<uint32_t> > ngrams;
  // Unknown words are copied to the target as one-word phrases.
  for (size_t i = 0; i < size; ++i) {
    ngrams.push_back(std::vector<uint32_t>(1, Id(sentence->GetWord(i))));
  }
  const std::vector<PhraseDictionary *> &tables = PhraseDictionary::GetColl();
  for (size_t t = 0; t < tables.size(); ++t) {
    // Lookups in an in-memory table are side-effect free; other tables are scored on demand.
    const PhraseDictionaryMemory *table = dynamic_cast<const PhraseDictionaryMemory *>(tables[t]);
    if (table == NULL) continue;
    for (size_t start = 0; start < size; ++start) {
      for (size_t end = start; end < size && end - start < maxLength; ++end) {
        Phrase source = sentence->GetSubString(Range(start, end));
        TargetPhraseCollection::shared_ptr targets = table->GetTargetPhraseCollectionLEGACY(source);
        if (!targets) continue;
        for (TargetPhraseCollection::const_iterator it = targets->begin(); it != targets->end(); ++it) {
          PhraseNgrams(**it, &ngrams, NULL, NULL);
        }
      }
    }
  }
  if (!ngrams.empty()) ScoreIds(ngrams);
}

FFState *NeuralLMServer::EvaluateWhenApplied(const Hypothesis &hypo, const FFState *ps,
                                             ScoreComponentCollection *out) const {
  // Only the n-grams that cross the phrase boundary (and </s>): the phrase-internal
  // ones came with the translation option (CalcScore).
  if (hypo.GetCurrTargetLength() == 0) return ps ? NewState(ps) : NULL;

  const Hypothesis *prev = hypo.GetPrevHypo();
  const float *prefetched = NULL;
  if (m_prefetch != PrefetchOff && prev != NULL) {
    NeuralLMServerThread &local = Local(this);
    Prefetch(*prev, local);
    std::unordered_map<Expansion, float, ExpansionHash>::const_iterator found =
        local.boundary.find(Expansion(prev, &hypo.GetTranslationOption()));
    if (found != local.boundary.end()) prefetched = &found->second;
  }

  const size_t order = m_nGramOrder;
  const size_t size = hypo.GetSize();
  std::vector<const Word *> last;  // the last order-1 words, the state
  for (size_t i = 0; i + 1 < order; ++i) {
    int pos = static_cast<int>(size) - static_cast<int>(order) + 1 + static_cast<int>(i);
    last.push_back(pos >= 0 ? &hypo.GetWord(static_cast<size_t>(pos)) : &GetSentenceStartWord());
  }
  float lmScore = prefetched ? *prefetched : BoundaryScore(hypo, last);
  if (hypo.IsSourceCompleted()) last.push_back(&GetSentenceEndWord());

  FFState *res = NewState(ps);
  SetState(last, *res);
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

float NeuralLMServer::BoundaryScore(const Hypothesis &hypo, const std::vector<const Word *> &last) const {
  const size_t order = m_nGramOrder;
  const size_t start = hypo.GetCurrTargetWordsRange().GetStartPos();
  const size_t end = hypo.GetCurrTargetWordsRange().GetEndPos();
  std::vector<std::vector<uint32_t> > ngrams;
  // Ids of the window ending at `last` (order words, <s> before the sentence).
  std::vector<uint32_t> window(order);
  for (size_t i = 0; i < order; ++i) {
    int pos = static_cast<int>(start) - static_cast<int>(order) + 1 + static_cast<int>(i);
    window[i] = pos >= 0 ? Id(hypo.GetWord(static_cast<size_t>(pos))) : m_bosId;
  }
  ngrams.push_back(window);
  const size_t boundaryEnd = std::min(start + order - 2, end);
  for (size_t pos = start + 1; pos <= boundaryEnd; ++pos) {
    window.erase(window.begin());
    window.push_back(Id(hypo.GetWord(pos)));
    ngrams.push_back(window);
  }
  if (hypo.IsSourceCompleted()) {
    std::vector<uint32_t> eos;
    for (size_t i = 0; i < last.size(); ++i) eos.push_back(Id(*last[i]));
    eos.push_back(m_eosId);
    ngrams.push_back(eos);
  }
  std::vector<float> scores = ScoreIds(ngrams);
  float lmScore = 0;  // summed in this order by Prefetch too
  for (size_t i = 0; i < scores.size(); ++i) lmScore += scores[i];
  return lmScore;
}

void NeuralLMServer::BoundaryNgrams(const std::vector<uint32_t> &context, const Phrase &phrase,
                                    bool completes, std::vector<std::vector<uint32_t> > *out) const {
  // The same n-grams as EvaluateWhenApplied computes for this expansion.
  const size_t order = m_nGramOrder;
  const size_t length = phrase.GetSize();
  if (length == 0) return;
  std::vector<uint32_t> window(context);  // order-1 ids
  const size_t boundary = std::min(order - 1, length);
  for (size_t i = 0; i < length; ++i) {
    window.push_back(Id(phrase.GetWord(i)));
    if (window.size() > order) window.erase(window.begin());
    if (i < boundary) out->push_back(window);
  }
  if (completes) {
    if (window.size() == order) window.erase(window.begin());
    window.push_back(m_eosId);
    out->push_back(window);
  }
}

void NeuralLMServer::Prefetch(const Hypothesis &prev, NeuralLMServerThread &local) const {
  Manager &manager = prev.GetManager();
  // Only the normal stack search expands the hypotheses of one stack, and all options
  // of each, in a row.
  if (manager.GetSource().GetType() != SentenceInput || manager.options()->search.algo != Normal) return;
  const void *key = &prev;
  const HypothesisStack *stack = NULL;
  if (m_prefetch == PrefetchStack) {
    // SearchNormal processes stack k (hypotheses covering k source words) after
    // pruning it; expanding it adds hypotheses only to later stacks.
    const SearchNormal *search = dynamic_cast<const SearchNormal *>(ManagerSearch::Of(manager));
    const size_t covered = prev.GetWordsBitmap().GetNumWordsCovered();
    if (search != NULL && covered < search->GetHypothesisStacks().size()) {
      stack = search->GetHypothesisStacks()[covered];
      key = stack;
    }
  }
  if (key == local.prefetched && local.prefetchedSentence == tl_sentence) return;
  local.prefetched = key;
  local.prefetchedSentence = tl_sentence;
  local.boundary.clear();
  std::vector<std::vector<uint32_t> > ngrams;
  std::vector<std::pair<Expansion, size_t> > expansions;  // and the end of its n-grams
  if (stack == NULL) {
    ExpansionNgrams(prev, &ngrams, &expansions);
  } else {
    for (HypothesisStack::const_iterator it = stack->begin(); it != stack->end(); ++it) {
      ExpansionNgrams(**it, &ngrams, &expansions);
    }
  }
  if (ngrams.empty()) return;
  std::vector<float> scores = ScoreIds(ngrams);
  size_t begin = 0;
  for (size_t e = 0; e < expansions.size(); ++e) {
    float sum = 0;  // in BoundaryScore's order, so the values are identical
    for (size_t i = begin; i < expansions[e].second; ++i) sum += scores[i];
    local.boundary[expansions[e].first] = sum;
    begin = expansions[e].second;
  }
}

void NeuralLMServer::ExpansionNgrams(const Hypothesis &prev, std::vector<std::vector<uint32_t> > *ngrams,
                                     std::vector<std::pair<Expansion, size_t> > *expansions) const {
  // Mirrors the loops of Moses' SearchNormal::ProcessOneHypothesis for sentence input;
  // n-grams of expansions that search will not make only cost server time.
  Manager &manager = prev.GetManager();
  const InputType &source = manager.GetSource();
  const TranslationOptionCollection *options = manager.getSntTranslationOptions();
  if (options == NULL) return;
  const Bitmap &bitmap = prev.GetWordsBitmap();
  const size_t sourceSize = source.GetSize();
  const size_t firstGap = bitmap.GetFirstGapPos();
  if (firstGap == NOT_FOUND) return;
  const int maxDistortion = manager.options()->reordering.max_distortion;
  const ReorderingConstraint &constraint = source.GetReorderingConstraint();
  const Range &prevRange = prev.GetCurrSourceWordsRange();

  const size_t order = m_nGramOrder;
  std::vector<uint32_t> context(order - 1, m_bosId);
  const size_t size = prev.GetSize();
  for (size_t i = 0; i + 1 < order; ++i) {
    int pos = static_cast<int>(size) - static_cast<int>(order) + 1 + static_cast<int>(i);
    if (pos >= 0) context[i] = Id(prev.GetWord(static_cast<size_t>(pos)));
  }

  for (size_t startPos = firstGap; startPos < sourceSize; ++startPos) {
    if (bitmap.GetValue(startPos)) continue;
    if (maxDistortion >= 0 &&
        source.ComputeDistortionDistance(prevRange, Range(startPos, startPos)) > maxDistortion) {
      continue;
    }
    for (size_t endPos = startPos; endPos < sourceSize; ++endPos) {
      const TranslationOptionList *list = options->GetTranslationOptionList(startPos, endPos);
      if (list == NULL) break;
      Range range(startPos, endPos);
      if (list->size() == 0 || bitmap.Overlap(range) || !constraint.Check(bitmap, startPos, endPos)) {
        continue;
      }
      if (maxDistortion >= 0 && startPos != firstGap &&
          source.ComputeDistortionDistance(range, Range(firstGap, firstGap)) > maxDistortion) {
        continue;
      }
      const bool completes = bitmap.GetNumWordsCovered() + range.GetNumWordsCovered() == sourceSize;
      for (TranslationOptionList::const_iterator it = list->begin(); it != list->end(); ++it) {
        BoundaryNgrams(context, (*it)->GetTargetPhrase(), completes, ngrams);
        expansions->push_back(std::make_pair(Expansion(&prev, *it), ngrams->size()));
      }
    }
  }
}

void NeuralLMServer::InitializeForInput(ttasksptr const &ttask) {
  tl_sentence_start = nlmserve::Client::ThreadRoundTrips();
  ++tl_sentence;
  if (m_sentencePhrases) ScoreSentencePhrases(ttask);
}

void NeuralLMServer::CleanUpAfterSentenceProcessing(ttasksptr const &ttask) {
  uint64_t trips = nlmserve::Client::ThreadRoundTrips() - tl_sentence_start;
  m_sentences.fetch_add(1);
  m_sentenceRoundTrips.fetch_add(trips);
  VERBOSE(1, "NeuralLMServer " << GetScoreProducerDescription() << ": sentence "
                               << ttask->GetSource()->GetTranslationId() << " took " << trips
                               << " round trips" << std::endl);
  LanguageModelSingleFactor::CleanUpAfterSentenceProcessing(ttask);
}

}  // namespace Moses
