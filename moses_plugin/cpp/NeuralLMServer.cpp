// NeuralLMServer: a Moses language-model feature that scores n-grams with an nlmserve model,
// from its tables file or by asking a server (see NeuralLMServer.h and moses_plugin/README.md).
#include "NeuralLMServer.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
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
#include "NeuralLMServerSearch.h"
#include "nlmserve_client.h"
#include "nlmserve_decoder.h"
#include "nlmserve_moses_ini.h"
#include "nlmserve_tables_file.h"
#include "util/exception.hh"
#include "util/file_piece.hh"
#include "util/tokenize_piece.hh"

namespace Moses {

namespace {
// Sentences this thread started (a count, so that pointers of an earlier sentence that
// a later one reuses are never mistaken for its own).
thread_local uint64_t tl_sentence = 0;
}  // namespace

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

namespace {
int64_t SteadyMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

NeuralLMServerThread &Local(const void *feature) {
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

}  // namespace

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

void NeuralLMServer::PrefetchPhraseTables() const {
  const size_t order = m_model->order;
  const size_t batchRows = 1 << 16;
  // Rows the cache takes before a prefetch would evict what it has just put there.
  const uint64_t room = m_options->cache_size / 2;
  NeuralLMServerThread &local = Local(this);
  const std::vector<PhraseDictionary *> &tables = PhraseDictionary::GetColl();
  for (size_t t = 0; t < tables.size(); ++t) {
    const PhraseDictionaryMemory *table = dynamic_cast<const PhraseDictionaryMemory *>(tables[t]);
    if (table == NULL) continue;  // other tables look phrases up while decoding
    const std::vector<FactorType> &output = table->GetOutput();
    if (std::find(output.begin(), output.end(), m_factorType) == output.end()) continue;  // a generation step makes it
    const std::string &path = table->GetFilePath();
    const int64_t started = SteadyMs();
    const uint64_t before = local.sentence.cache_misses;
    size_t phrases = 0;
    bool full = false;
    local.rows.clear();
    try {
      util::FilePiece in(path.c_str());
      StringPiece line;
      Phrase target;
      while (!full) {
        try {
          line = in.ReadLine();
        } catch (const util::EndOfFileException &) {
          break;
        }
        util::TokenIter<util::MultiCharacter> pipes(line, "|||");
        if (!pipes || !++pipes) continue;  // the table's own loader reports a bad line
        Word *lhs = NULL;
        target.Clear();
        target.CreateFromString(Output, output, *pipes, &lhs);
        delete lhs;
        local.words.clear();
        AppendIds(target, &local.words);
        const size_t at = local.rows.size();
        size_t position = 0;
        if (nlmserve::PhraseRows(*m_model, local.words.data(), local.words.size(), &local.rows, NULL, NULL,
                                 &position) != nlmserve::NgramError::kNone) {
          local.rows.resize(at);  // the table's own scoring reports the phrase
          continue;
        }
        ++phrases;
        if (local.rows.size() >= batchRows * order) {
          local.scores.resize(local.rows.size() / order);
          ScoreRows(local.rows.data(), local.scores.size(), local.scores.data(), local);
          local.rows.clear();
          full = local.sentence.cache_misses - before >= room;
        }
      }
      local.scores.resize(local.rows.size() / order);
      ScoreRows(local.rows.data(), local.scores.size(), local.scores.data(), local);
      local.rows.clear();
    } catch (const util::Exception &e) {
      // Unreadable here means unreadable for the table too, which then says why.
      VERBOSE(1, "NeuralLMServer " << GetScoreProducerDescription() << ": no prefetch of " << path << ": "
                                   << e.what() << std::endl);
      continue;
    }
    VERBOSE(1, "NeuralLMServer " << GetScoreProducerDescription() << ": prefetched the n-grams of " << phrases
                                 << " target phrases of " << table->GetScoreProducerDescription() << " ("
                                 << local.sentence.cache_misses - before << " scored) in "
                                 << (SteadyMs() - started) / 1000.0 << " s"
                                 << (full ? "; stopped at half of cache-size" : "") << std::endl);
  }
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

void NeuralLMServer::AppendIds(const Phrase &phrase, std::vector<uint32_t> *ids) const {
  const size_t size = phrase.GetSize();
  for (size_t pos = 0; pos < size; ++pos) {
    const Word &word = phrase.GetWord(pos);
    ids->push_back(word.IsNonTerminal() ? nlmserve::kNonTerminal : Id(word));
  }
}

void NeuralLMServer::ScoreRows(const uint32_t *rows, size_t n, float *out, NeuralLMServerThread &local) const {
  if (n == 0) return;
  if (m_tables) {
    // The rows come from CanonicalRow or BoundaryRows, which have checked them; they are
    // checked again here because the tables are read at their ids.
    nlmserve::NgramError error;
    const size_t bad = nlmserve::FirstBadRow(rows, n, *m_model, &error);
    if (bad < n) {
      const size_t width = m_model->order;
      Failed(nlmserve::NgramErrorMessage(error, rows + bad * width, width, bad, *m_model), n, out);
      return;
    }
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

void NeuralLMServer::ScoreSentencePhrases(ttasksptr const &ttask) const {
  const InputType &input = *ttask->GetSource();
  if (input.GetType() != SentenceInput) return;
  const Phrase *sentence = dynamic_cast<const Phrase *>(&input);
  if (sentence == NULL) return;
  const size_t size = sentence->GetSize();
  const size_t maxLength = ttask->options()->search.max_phrase_length;
  const size_t order = m_model->order;
  NeuralLMServerThread &local = Local(this);
  local.rows.clear();
  // Unknown words are copied to the target as one-word phrases (a word the model cannot
  // predict, such as <s>, is left to the scoring of its phrase).
  for (size_t i = 0; i < size; ++i) {
    const uint32_t id = Id(sentence->GetWord(i));
    const size_t at = local.rows.size();
    local.rows.resize(at + order);
    if (nlmserve::CanonicalRow(&id, 1, *m_model, local.rows.data() + at) != nlmserve::NgramError::kNone) {
      local.rows.resize(at);
    }
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
          PhraseRows(**it, local, false, NULL);
        }
      }
    }
  }
  const size_t n = local.rows.size() / order;
  local.scores.resize(n);
  ScoreRows(local.rows.data(), n, local.scores.data(), local);
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

void NeuralLMServer::Prefetch(const Hypothesis &prev, NeuralLMServerThread &local) const {
  Manager &manager = prev.GetManager();
  // Only the normal stack search expands the hypotheses of one stack, and all options
  // of each, in a row.
  if (manager.GetSource().GetType() != SentenceInput || manager.options()->search.algo != Normal) return;
  const void *key = &prev;
  const HypothesisStack *stack = NULL;
  if (m_options->prefetch == nlmserve::FeatureOptions::kPrefetchStack) {
    // SearchNormal processes stack k (hypotheses covering k source words) after
    // pruning it; expanding it adds hypotheses only to later stacks.
    const SearchNormal *search = dynamic_cast<const SearchNormal *>(NeuralLMServerSearch::ManagerSearch::Of(manager));
    const size_t covered = prev.GetWordsBitmap().GetNumWordsCovered();
    if (search != NULL && covered < search->GetHypothesisStacks().size()) {
      stack = search->GetHypothesisStacks()[covered];
      key = stack;
    }
  }
  if (!local.prefetched.Renew(key, tl_sentence)) return;
  local.boundary.Clear();
  local.rows.clear();
  local.expansions.clear();
  if (stack == NULL) {
    ExpansionRows(prev, local);
  } else {
    for (HypothesisStack::const_iterator it = stack->begin(); it != stack->end(); ++it) {
      ExpansionRows(**it, local);
    }
  }
  const size_t n = local.rows.size() / m_model->order;
  if (n == 0) return;
  local.scores.resize(n);
  ScoreRows(local.rows.data(), n, local.scores.data(), local);
  // Appended in enumeration order: sequential writes (a hash table filled here would take
  // a random write per expansion; ExpansionScores builds one only if it is needed).
  size_t begin = 0;
  for (size_t e = 0; e < local.expansions.size(); ++e) {
    const NeuralLMServerThread::Expansion &x = local.expansions[e];
    local.boundary.Add(x.prev, x.option, nlmserve::SumScores(local.scores.data() + begin, x.end - begin));
    begin = x.end;
  }
}

void NeuralLMServer::ExpansionRows(const Hypothesis &prev, NeuralLMServerThread &local) const {
  // The expansions search will make (NeuralLMServerSearch.h, a copy of Moses' loops): n-grams
  // of expansions that search will not make only cost server time.
  // The last order-1 words of prev (fewer at the sentence start), then each option's phrase.
  const size_t order = m_model->order;
  const size_t size = prev.GetSize();
  local.words.clear();
  for (size_t pos = size > order - 1 ? size - (order - 1) : 0; pos < size; ++pos) {
    local.words.push_back(Id(prev.GetWord(pos)));
  }
  const size_t context = local.words.size();
  NeuralLMServerSearch::ForEachExpansion(prev, [&](const TranslationOption &option, bool completes) {
    // An empty target phrase has no boundary n-grams, and EvaluateWhenApplied returns
    // before asking for its score: listing it would only put the cursor out of step.
    if (option.GetTargetPhrase().GetSize() == 0) return;
    local.words.resize(context);
    AppendIds(option.GetTargetPhrase(), &local.words);
    const nlmserve::NgramError error = nlmserve::BoundaryRows(*m_model, local.words.data(), context,
                                                              local.words.size(), completes, &local.rows);
    UTIL_THROW_IF2(error != nlmserve::NgramError::kNone,
                   "NeuralLMServer: a boundary n-gram breaks the rule " << nlmserve::NgramErrorKind(error));
    NeuralLMServerThread::Expansion x = {&prev, &option, local.rows.size() / order};
    local.expansions.push_back(x);
  });
}

void NeuralLMServer::InitializeForInput(ttasksptr const &ttask) {
  ++tl_sentence;
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
