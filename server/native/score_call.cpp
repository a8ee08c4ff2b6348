// ScoreCall (score_call.h): a parsed ScoreNgrams request, holding its slot, to the batcher.
#include "score_call.h"

#include <memory>

#include "endings.h"
#include "service.h"

namespace nlmserve_frontend {

void ScoreCall::OnRequest() {
  if (!Parse(&first_, &request_)) {
    Complete(End(kMalformed, "the request message does not parse as nlmserve.v1.ScoreNgramsRequest"));
    return;
  }
  first_.Clear();  // parsed: the bytes it came in are not needed again
  if (!TakeSlot(&service_->guards()->rpcs)) return;
  service_->queue()->Submit(std::static_pointer_cast<ScoreCall>(shared_from_this()));
}

}  // namespace nlmserve_frontend
