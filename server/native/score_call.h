// A LanguageModel.ScoreNgrams call (ScoreCall): parsed here and handed to the batcher
// (ScoreQueue, batcher.h), which drops it unsent when its deadline passes or its client
// goes away first, sends it alone, or merges it and Answers it from the batch's answer.
#ifndef NLMSERVE_FRONTEND_SCORE_CALL_H
#define NLMSERVE_FRONTEND_SCORE_CALL_H

#include <chrono>
#include <memory>
#include <mutex>
#include <string>

#include <grpcpp/grpcpp.h>
#include <grpcpp/support/proto_buffer_writer.h>

#include "call.h"
#include "endings.h"
#include "nlmserve/v1/lm.grpc.pb.h"

namespace nlmserve_frontend {

using nlmserve::v1::ScoreNgramsRequest;
using nlmserve::v1::ScoreNgramsResponse;

// A ScoreNgrams call, for the batcher: its request, its response to fill, and Answer.
class ScoreCall final : public Call {
 public:
  using Call::Call;

  const ScoreNgramsRequest &request() const { return request_; }
  ScoreNgramsResponse *response() { return &response_; }
  const std::string &authorization() const { return authorization_; }

  // Sends the response (status OK) or `status`. Once.
  void Answer(const grpc::Status &status) {
    if (!status.ok()) {
      Complete(status);
      return;
    }
    bool own = false;
    grpc::GenericSerialize<grpc::ProtoBufferWriter, ScoreNgramsResponse>(response_, &out_, &own);
    // The answer is in out_ now: what it was made from goes at once, not when gRPC lets the
    // call go (a client that does not read keeps it waiting up to the write timeout).
    ScoreNgramsRequest().Swap(&request_);
    ScoreNgramsResponse().Swap(&response_);
    CompleteWith(&out_);
  }

  // Whether the call should not be sent on: its deadline has passed (kExpired) or its
  // client cancelled or went away (kCancelled).
  bool Gone(Ending *why) const {
    if (std::chrono::system_clock::now() >= ctx_->deadline()) {
      *why = kExpired;
      return true;
    }
    if (cancelled()) {
      *why = kCancelled;
      return true;
    }
    return false;
  }

  // Ends a call that is not sent on (Gone): counted, with the status its client already has.
  void Drop(Ending why) {
    Complete(End(why, why == kExpired ? "the call's deadline passed before it was scored"
                                      : "the client cancelled the call before it was scored"));
  }

  // A client context for sending the request alone to the backend: the caller's deadline
  // (at most `timeout_ms` from now) and authorization; cancelled when the client cancels.
  grpc::ClientContext *NewForward(long timeout_ms) {
    std::lock_guard<std::mutex> lock(forward_mu_);
    forward_.reset(new grpc::ClientContext());
    auto cap = std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms);
    forward_->set_deadline(std::min(ctx_->deadline(), cap));
    if (!authorization_.empty()) forward_->AddMetadata("authorization", authorization_);
    if (cancelled()) forward_->TryCancel();
    return forward_.get();
  }

 private:
  void OnRequest() override;
  void OnCancelled() override {
    grpc::ClientContext *forward;
    {
      std::lock_guard<std::mutex> lock(forward_mu_);
      forward = forward_.get();
    }
    if (forward != nullptr) forward->TryCancel();
  }

  ScoreNgramsRequest request_;
  ScoreNgramsResponse response_;
  grpc::ByteBuffer out_;
  std::mutex forward_mu_;
  std::unique_ptr<grpc::ClientContext> forward_;
};

// Where ScoreCalls go once parsed and admitted: the batcher.
class ScoreQueue {
 public:
  virtual ~ScoreQueue() {}
  virtual void Submit(std::shared_ptr<ScoreCall> call) = 0;
};

}  // namespace nlmserve_frontend

#endif  // NLMSERVE_FRONTEND_SCORE_CALL_H
