// A grpc.health.v1 call (HealthCall), answered here from HealthState and open without a
// token: Check answered at once and never limited; Watch, in slots of its own, told each
// change until the client leaves or the front end stops.
#ifndef NLMSERVE_FRONTEND_HEALTH_CALL_H
#define NLMSERVE_FRONTEND_HEALTH_CALL_H

#include <mutex>
#include <string>

#include "call.h"
#include "health.h"

namespace nlmserve_frontend {

// A grpc.health.v1 call: Check answered at once; Watch told each change until the client
// leaves or the front end stops.
class HealthCall final : public Call, public HealthState::Watcher {
 public:
  using Call::Call;
  void Notify(HealthStatus status) override;
  void Close() override;

 private:
  void OnRequest() override;
  void OnWritten(bool ok) override;
  void OnCancelled() override;
  void OnWriteTimedOut() override {
    std::lock_guard<std::mutex> lock(health_mu_);
    ended_ = true;
  }
  void OnGone() override;
  // Writes the latest status when no write is on its way, or ends a closing stream once
  // told (under health_mu_, which it releases).
  void WriteLatest(std::unique_lock<std::mutex> *lock);

  std::string watched_;  // the service asked about
  std::mutex health_mu_;
  HealthStatus latest_ = kHealthUnknown, sent_ = kHealthUnknown;
  bool writing_ = false, closing_ = false, ended_ = false;
  grpc::ByteBuffer out_;
};

}  // namespace nlmserve_frontend

#endif  // NLMSERVE_FRONTEND_HEALTH_CALL_H
