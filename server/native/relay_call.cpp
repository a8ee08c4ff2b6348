// RelayCall (relay_call.h): a call's messages to the backend and back, and its status.
#include "relay_call.h"

#include <chrono>
#include <memory>
#include <mutex>
#include <string>

#include <grpcpp/grpcpp.h>

#include "endings.h"
#include "service.h"

namespace nlmserve_frontend {

void RelayCall::OnRequest() {
  if (method_->parses != nullptr && !method_->parses(&first_)) {
    Complete(End(kMalformed, std::string("the request message does not parse as the request of ") + method_->path));
    return;
  }
  if (!TakeSlot(&service_->guards()->rpcs)) return;
  const long timeout_ms = method_->timeout_ms ? method_->timeout_ms : service_->limits().backend_timeout_ms;
  auto cap = std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms);
  backend_ctx_.set_deadline(std::min(ctx_->deadline(), cap));
  if (!authorization_.empty()) backend_ctx_.AddMetadata("authorization", authorization_);
  service_->stub()->PrepareBidiStreamingCall(&backend_ctx_, method_->path, grpc::StubOptions(), &backend_);
  // Reads from the backend are started from the client's side (once it has the previous
  // message), and so are a stream's writes: each flow holds the backend call open.
  if (method_->kind == Kind::kRelayStream) {
    backend_.AddMultipleHolds(2);
    backend_.StartWrite(&first_);
  } else {
    backend_.AddHold();
    backend_.StartWriteLast(&first_, grpc::WriteOptions());
  }
  backend_.StartRead(&down_);
  backend_keep_ = shared_from_this();
  started_.store(true);
  if (cancelled()) backend_ctx_.TryCancel();
  backend_.StartCall();
}

// A message reached the backend (kRelayStream: read the client's next one).
void RelayCall::Sent(bool ok) {
  if (method_->kind != Kind::kRelayStream) return;
  std::unique_lock<std::mutex> lock(relay_mu_);
  if (!ok || down_over_) {
    CloseUp(false);
    return;
  }
  up_state_ = Up::kReading;
  lock.unlock();
  StartRead(&up_);
}

void RelayCall::OnLaterRead(bool ok) {
  if (method_->kind != Kind::kRelayStream) return;
  std::unique_lock<std::mutex> lock(relay_mu_);
  if (up_state_ != Up::kReading) return;  // closed: the backend call is over
  if (!ok) {
    CloseUp(true);
    return;
  }
  up_state_ = Up::kWriting;
  lock.unlock();
  backend_.StartWrite(&up_);
}

void RelayCall::CloseUp(bool writes_done) {
  up_state_ = Up::kClosed;
  if (writes_done) backend_.StartWritesDone();
  backend_.RemoveHold();
}

// A message from the backend: to the client (the next is read once the client has it).
void RelayCall::Received(bool ok) {
  if (ok) {
    if (!Write(&down_)) OnWritten(false);  // the call is over: no more reads
    return;
  }
  if (method_->kind == Kind::kRelayStream) {
    // The backend has ended the call: stop waiting for the client's next message.
    std::lock_guard<std::mutex> lock(relay_mu_);
    down_over_ = true;
    if (up_state_ == Up::kReading) CloseUp(false);
  }
  backend_.RemoveHold();
}

void RelayCall::OnWritten(bool ok) {
  if (ok) {
    backend_.StartRead(&down_);
    return;
  }
  CancelBackend();  // the client is gone or the call was cut: no more reads
  backend_.RemoveHold();
}

void RelayCall::BackendDone(const grpc::Status &status) {
  std::shared_ptr<Call> keep = std::move(backend_keep_);  // released on return: nothing after
  Complete(status);
}

}  // namespace nlmserve_frontend
