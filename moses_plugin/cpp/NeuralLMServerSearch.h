// What the NeuralLMServer feature reads of Moses' own search, so that it can score the
// boundary n-grams of a whole stack's expansions in one request before search asks for them
// one by one (prefetch=hypothesis|stack, NeuralLMServer.h).
//
// COPIED FROM MOSES, moses-smt/mosesdecoder at commit 34452895 (the tree the feature is built
// and tested against, ../shared/moses-src): the loops of SearchNormal::ProcessOneHypothesis
// (moses/SearchNormal.cpp) for sentence input, and the search that Manager keeps in its
// protected m_search (moses/Manager.h). A Moses whose loops differ needs the same change here;
// until then the prefetched rows stop matching the expansions search makes, which costs time
// (rows scored for expansions search does not make; scores asked for one at a time when
// EvaluateWhenApplied finds none prefetched), never a score: each expansion's score is the
// one its own rows give. Nothing else of the feature depends on Moses' search.
#ifndef moses_NeuralLMServerSearch_h
#define moses_NeuralLMServerSearch_h

#include <cstddef>

#include "moses/Bitmap.h"
#include "moses/Hypothesis.h"
#include "moses/InputType.h"
#include "moses/Manager.h"
#include "moses/Range.h"
#include "moses/ReorderingConstraint.h"
#include "moses/Search.h"
#include "moses/TranslationOption.h"
#include "moses/TranslationOptionCollection.h"
#include "moses/TranslationOptionList.h"
#include "moses/TypeDef.h"

namespace Moses {
namespace NeuralLMServerSearch {

// The search `manager` runs: Manager keeps it protected, and a pointer to the member named
// through a derived class reads it without changing Moses.
struct ManagerSearch : public Manager {
  static const Search *Of(const Manager &manager) { return manager.*(&ManagerSearch::m_search); }
};

// Calls visit(option, completes) for each translation option that SearchNormal's
// ProcessOneHypothesis expands `prev` with, in its order (sentence input: the caller checks
// the input type and the search algorithm); `completes` says the expansion covers the whole
// source sentence. Options with an empty target phrase are visited too.
template <class Visit>
void ForEachExpansion(const Hypothesis &prev, Visit visit) {
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
        visit(**it, completes);
      }
    }
  }
}

}  // namespace NeuralLMServerSearch
}  // namespace Moses

#endif
