// A call relayed to the backend as bytes (RelayCall): every LanguageModel and Admin method
// but ScoreNgrams, and server reflection: the client's messages forwarded, the backend's
// answers back one at a time as the client reads them, and the backend's status.
#ifndef NLMSERVE_FRONTEND_RELAY_CALL_H
#define NLMSERVE_FRONTEND_RELAY_CALL_H

#include <atomic>
#include <memory>
#include <mutex>

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/support/client_callback.h>

#include "call.h"

namespace nlmserve_frontend {

// A call forwarded to the backend as bytes: the client's messages to it, its messages back
// one at a time as the client reads them, and its status.
class RelayCall final : public Call {
 public:
  using Call::Call;

 private:
  // The backend's side of the call.
  class Backend : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
   public:
    explicit Backend(RelayCall *owner) : owner_(owner) {}
    void OnWriteDone(bool ok) override { owner_->Sent(ok); }
    void OnReadDone(bool ok) override { owner_->Received(ok); }
    void OnDone(const grpc::Status &status) override { owner_->BackendDone(status); }

   private:
    RelayCall *owner_;
  };

  void OnRequest() override;
  void OnLaterRead(bool ok) override;
  void OnWritten(bool ok) override;
  void OnCancelled() override { CancelBackend(); }
  void OnWriteTimedOut() override { CancelBackend(); }

  void Sent(bool ok);
  void Received(bool ok);
  void BackendDone(const grpc::Status &status);
  void CancelBackend() {
    if (started_.load()) backend_ctx_.TryCancel();
  }
  // No more messages go to the backend (kRelayStream; under relay_mu_ released by the caller).
  void CloseUp(bool writes_done);

  // The client-to-backend direction of a kRelayStream call: writing a message to the
  // backend, reading the client's next, or over.
  enum class Up { kWriting, kReading, kClosed };

  Backend backend_{this};
  grpc::ClientContext backend_ctx_;
  std::atomic<bool> started_{false};
  // The call itself, from the backend call's start to its OnDone: the call may be ended
  // (write timeout) before the backend call is over, whose reactor and context are ours.
  std::shared_ptr<Call> backend_keep_;
  std::mutex relay_mu_;
  Up up_state_ = Up::kWriting;
  bool down_over_ = false;      // the backend sent its last message
  grpc::ByteBuffer up_, down_;  // the message on its way to the backend, and back
};

}  // namespace nlmserve_frontend

#endif  // NLMSERVE_FRONTEND_RELAY_CALL_H
