// HealthCall (health_call.h): Check and Watch answered from HealthState.
#include "health_call.h"

#include <memory>
#include <mutex>
#include <string>

#include <grpcpp/grpcpp.h>

#include "endings.h"
#include "service.h"

namespace nlmserve_frontend {

void HealthCall::OnRequest() {
  if (!ParseHealthRequest(&first_, &watched_)) {
    Complete(End(kMalformed, "the request message does not parse as grpc.health.v1.HealthCheckRequest"));
    return;
  }
  HealthState *health = service_->health();
  if (method_->kind == Kind::kHealthCheck) {
    const HealthStatus status = health->StatusOf(watched_);
    if (status == kServiceUnknown) {
      Complete(End(kUnknownHealthService, "unknown service"));
      return;
    }
    out_ = HealthResponse(status);
    CompleteWith(&out_);
    return;
  }
  if (!TakeSlot(&service_->guards()->watches)) return;
  health->Add(std::static_pointer_cast<HealthCall>(shared_from_this()));
  if (health->closed()) {
    Close();
  } else {
    Notify(health->StatusOf(watched_));
  }
}

void HealthCall::OnGone() { service_->health()->Remove(this); }

void HealthCall::Notify(HealthStatus) {
  std::unique_lock<std::mutex> lock(health_mu_);
  latest_ = service_->health()->StatusOf(watched_);
  WriteLatest(&lock);
}

void HealthCall::Close() {
  std::unique_lock<std::mutex> lock(health_mu_);
  closing_ = true;
  latest_ = service_->health()->StatusOf(watched_);
  WriteLatest(&lock);
}

void HealthCall::WriteLatest(std::unique_lock<std::mutex> *lock) {
  if (writing_ || ended_) return;
  if (latest_ == sent_) {
    if (closing_) {
      ended_ = true;
      lock->unlock();
      Complete(grpc::Status::OK);
    }
    return;
  }
  writing_ = true;
  sent_ = latest_;
  out_ = HealthResponse(sent_);
  lock->unlock();
  if (!Write(&out_)) {
    std::lock_guard<std::mutex> again(health_mu_);
    writing_ = false;
    ended_ = true;
  }
}

void HealthCall::OnWritten(bool ok) {
  std::unique_lock<std::mutex> lock(health_mu_);
  writing_ = false;
  if (!ok) {
    ended_ = true;  // cancelled or cut: OnCancelled or the write timeout ends the call
    return;
  }
  WriteLatest(&lock);
}

void HealthCall::OnCancelled() {
  {
    std::lock_guard<std::mutex> lock(health_mu_);
    ended_ = true;
  }
  Complete(grpc::Status::CANCELLED);
}

}  // namespace nlmserve_frontend
