// The NeuralLMServer feature's batches scored ahead of Moses' asking (NeuralLMServer.h; the
// rest of the feature is NeuralLMServer.cpp): each puts many n-grams into one request, so that
// the scores Moses asks for one by one later come from the client's cache or from the
// thread's list of expansion scores.
//
// Contract:
//   PrefetchPhraseTables  table-prefetch=true: before the in-memory phrase tables load, the
//                         n-grams of their target phrases in requests of 65,536 rows, stopping
//                         at cache-size/2; an unreadable file is left to its table to report.
//   ScoreSentencePhrases  phrase-scores=sentence: when a sentence starts, the phrase-internal
//                         n-grams of every target phrase of its spans, in one request.
//   Prefetch              prefetch=hypothesis|stack: the boundary n-grams (and </s>) of every
//                         expansion Moses' normal search can make from a hypothesis or from its
//                         stack, in one request, once per hypothesis or stack and sentence; the
//                         boundary score of each expansion is kept, in the order search makes
//                         them, for EvaluateWhenApplied (NeuralLMServer.cpp).
//   ExpansionRows         the rows of those expansions (NeuralLMServerSearch.h, Moses' loops).
// A batch's scores are ScoreRows's (NeuralLMServer.cpp), so a score never depends on whether
// it was prefetched: only the number of requests does.
#include "NeuralLMServer.h"

#include <algorithm>
#include <vector>

#include "moses/Hypothesis.h"
#include "moses/InputType.h"
#include "moses/Manager.h"
#include "moses/Range.h"
#include "moses/SearchNormal.h"
#include "moses/TranslationOption.h"
#include "moses/TranslationTask.h"
#include "moses/TranslationModel/PhraseDictionary.h"
#include "moses/TranslationModel/PhraseDictionaryMemory.h"
#include "NeuralLMServerSearch.h"
#include "NeuralLMServerThread.h"
#include "nlmserve_decoder.h"
#include "nlmserve_moses_ini.h"
#include "util/exception.hh"
#include "util/file_piece.hh"
#include "util/tokenize_piece.hh"

namespace Moses {

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
  if (!local.prefetched.Renew(key, SentenceSerial())) return;
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
    // Only the first order-1 words are predicted across the boundary; the whole phrase only
    // when </s> follows it (its context is the last order-1 words).
    local.words.resize(context);
    AppendIds(option.GetTargetPhrase(), &local.words, completes ? size_t(-1) : order - 1);
    const nlmserve::NgramError error = nlmserve::BoundaryRows(*m_model, local.words.data(), context,
                                                              local.words.size(), completes, &local.rows);
    UTIL_THROW_IF2(error != nlmserve::NgramError::kNone,
                   "NeuralLMServer: a boundary n-gram breaks the rule " << nlmserve::NgramErrorKind(error));
    NeuralLMServerThread::Expansion x = {&prev, &option, local.rows.size() / order};
    local.expansions.push_back(x);
  });
}

}  // namespace Moses
