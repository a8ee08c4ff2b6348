// Call (call.h): the steps every call takes, from its headers to gRPC's OnDone.
#include "call.h"

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include <grpcpp/grpcpp.h>

#include "endings.h"
#include "guards.h"
#include "service.h"

namespace nlmserve_frontend {

Call::Call(CallService *service, grpc::GenericCallbackServerContext *ctx, const Method *method)
    : service_(service), ctx_(ctx), method_(method) {}

void Call::Begin(std::shared_ptr<Call> self) {
  self_ = std::move(self);
  began_ = Clock::now();
  Guards *guards = service_->guards();
  peer_ = ctx_->peer();
  if (guards->stopping.load()) {
    Complete(End(kStopping, "the front end is shutting down"));
    return;
  }
  // gRPC 1.51 applies its metadata limit only once the client has acknowledged the
  // server's settings: a larger header list is refused here, before anything else, so that
  // no call holds one (the size as HTTP/2 counts it: each entry's bytes and 32).
  std::size_t metadata = 0;
  for (const auto &entry : ctx_->client_metadata()) metadata += entry.first.size() + entry.second.size() + 32;
  if (metadata > static_cast<std::size_t>(service_->limits().max_metadata_bytes)) {
    Complete(End(kMetadataTooLarge, "the call's metadata of " + std::to_string(metadata) +
                                        " bytes is larger than max (" +
                                        std::to_string(service_->limits().max_metadata_bytes) + "; --max-metadata-kb)"));
    return;
  }
  const bool open = method_ != nullptr && (method_->kind == Kind::kHealthCheck || method_->kind == Kind::kHealthWatch);
  std::string token_client;
  if (!open) {
    const auto &metadata = ctx_->client_metadata();
    auto it = metadata.find("authorization");
    const grpc::string_ref *header = it == metadata.end() ? nullptr : &it->second;
    if (const char *refusal = guards->tokens.Refusal(header, &token_client)) {
      guards->refusals.Note(kReasonUnauthenticated, ctx_->method(), peer_);
      Refuse(End(kUnauthenticated, refusal));
      return;
    }
    if (header != nullptr) authorization_.assign(header->data(), header->size());
  }
  client_ = ClientOf(peer_, token_client);
  if (method_ == nullptr) {
    Complete(End(kUnknownMethod, "the front end serves no method " + Refusals::Printable(ctx_->method())));
    return;
  }
  Waiting *waiting = open ? &guards->health_waiting : &guards->waiting;
  std::weak_ptr<Call> weak = self_;
  Waiting::Ticket ticket = waiting->Enter(peer_, client_, [weak] {
    if (auto call = weak.lock()) call->CutWaiting();
  });
  {
    // Nothing finishes the call before its read has started (a cut waits for it: CutWaiting).
    std::lock_guard<std::mutex> lock(mu_);
    waiting_ = waiting;
    ticket_ = std::move(ticket);
  }
  first_alarm_.Set(std::chrono::system_clock::now() + std::chrono::milliseconds(service_->limits().first_message_ms),
                   [weak](bool fired) {
                     if (!fired) return;
                     if (auto call = weak.lock()) call->FirstMessageTimeout();
                   });
  StartRead(&first_);
  bool cut;
  {
    std::lock_guard<std::mutex> lock(mu_);
    read_started_ = true;
    cut = cut_pending_;
  }
  if (cut) CutWaiting();
}

void Call::Refuse(const grpc::Status &status) {
  const std::string address = ClientOf(peer_, std::string());
  const double delay = service_->guards()->auth_failures.Failed(address);
  if (delay <= 0) {
    Complete(status);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    refusal_.reset(new grpc::Status(status));
    refused_address_ = address;
  }
  std::weak_ptr<Call> weak = self_;
  first_alarm_.Set(std::chrono::system_clock::now() + std::chrono::microseconds(static_cast<long>(delay * 1e6)),
                   [weak](bool) {
                     if (auto call = weak.lock()) call->SendRefusal();
                   });
}

// Sends a delayed refusal (its delay is over, or its client left); once.
void Call::SendRefusal() {
  std::unique_ptr<grpc::Status> status;
  {
    std::lock_guard<std::mutex> lock(mu_);
    status.swap(refusal_);
  }
  if (!status) return;
  service_->guards()->auth_failures.Answered(refused_address_);
  Complete(*status);
}

void Call::LeaveWaiting() {
  if (waiting_ == nullptr) return;
  waiting_->Leave(ticket_);
  waiting_ = nullptr;
  ticket_.reset();
}

bool Call::Finishing(bool answering) {
  if (finished_) return false;
  finished_ = true;
  LeaveWaiting();
  if (answering || writing_) {
    HoldClientOnly();  // its answer is gRPC's to send once the client reads
  } else {
    GiveSlot(&slots_);
  }
  return true;
}

// Under mu_.
void Call::HoldClientOnly() {
  if (slots_ == nullptr) return;
  slots_->LeaveServer(peer_);
  client_held_ = slots_;
  slots_ = nullptr;
}

// Finish and the writes are started under mu_, so that no write follows the finish (gRPC
// aborts on one). Neither runs a reaction on the calling thread.
void Call::Complete(const grpc::Status &status) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!Finishing(false)) return;
  Finish(status);
}

void Call::CompleteWith(grpc::ByteBuffer *last) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!Finishing(true)) return;
  writing_ = true;
  ++write_generation_;
  ArmWriteTimer();
  StartWriteAndFinish(last, grpc::WriteOptions(), grpc::Status::OK);
}

bool Call::Write(grpc::ByteBuffer *message) {
  std::lock_guard<std::mutex> lock(mu_);
  if (finished_) return false;
  writing_ = true;
  ++write_generation_;
  ArmWriteTimer();
  StartWrite(message);
  return true;
}

// Under mu_.
void Call::ArmWriteTimer() {
  std::weak_ptr<Call> weak = self_;
  const uint64_t generation = write_generation_;
  write_alarm_.reset(new grpc::Alarm());
  write_alarm_->Set(
      std::chrono::system_clock::now() + std::chrono::milliseconds(service_->limits().stream_write_timeout_ms),
      [weak, generation](bool fired) {
        if (!fired) return;
        if (auto call = weak.lock()) call->WriteTimeout(generation);
      });
}

void Call::WriteTimeout(uint64_t generation) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!writing_ || generation != write_generation_) return;
    writing_ = false;  // cut once
    HoldClientOnly();  // the front end's slot is free at once; the client's share is until OnDone
  }
  const long ms = service_->limits().stream_write_timeout_ms;
  service_->guards()->refusals.Note(kReasonStreamWriteTimeout, ctx_->method(), peer_);
  const std::string message = "the client did not read the call's answer within " + std::to_string(ms) +
                              " ms (--stream-write-timeout-ms)";
  {
    // The status cannot follow the unread data on the stream: the call is cut with it
    // (gRPC sends it at once, and resets the stream).
    std::lock_guard<std::recursive_mutex> lock(done_mu_);
    if (!done_) {
      Endings().Add(kStreamWriteTimeout);
      grpc_call_cancel_with_status(ctx_->c_call(), GRPC_STATUS_DEADLINE_EXCEEDED, message.c_str(), nullptr);
    }
  }
  OnWriteTimedOut();
  Complete(grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, message));
}

void Call::FirstMessageTimeout() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (first_state_ != FirstMessage::kAwaited || finished_) return;
    first_state_ = FirstMessage::kTimedOut;  // a message arriving now is not read
  }
  service_->guards()->refusals.Note(kReasonFirstMessageTimeout, ctx_->method(), peer_);
  Complete(End(kFirstMessageTimeout, "no request message within " +
                                         std::to_string(service_->limits().first_message_ms) +
                                         " ms of the call's headers (--first-message-ms)"));
}

void Call::CutWaiting() {
  std::string why;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (first_state_ != FirstMessage::kAwaited || finished_) return;
    if (!read_started_) {  // no finish before the read has started: Begin cuts it then
      cut_pending_ = true;
      return;
    }
    first_state_ = FirstMessage::kTimedOut;  // a message arriving now is not read
    if (waiting_ != nullptr) why = waiting_->Why(ticket_);
  }
  service_->guards()->refusals.Note(kReasonAwaitingMessage, ctx_->method(), peer_);
  // As a call refused by a limit ends (TakeSlot): RESOURCE_EXHAUSTED, which clients retry
  // (a call of a burst whose message had come but was not read yet may be cut), or
  // UNIMPLEMENTED for a Watch.
  Complete(End(method_->kind == Kind::kHealthWatch ? kWatchesFull : kSlotsFull, why));
}

void Call::OnReadDone(bool ok) {
  FirstMessage state;
  {
    std::lock_guard<std::mutex> lock(mu_);
    state = first_state_;
    if (state == FirstMessage::kAwaited) {
      first_state_ = FirstMessage::kRead;
      LeaveWaiting();
    }
  }
  if (state == FirstMessage::kTimedOut) return;  // the call is ended already
  if (state == FirstMessage::kRead) {
    OnLaterRead(ok);
    return;
  }
  first_alarm_.Cancel();
  if (!ok) {
    if (std::chrono::system_clock::now() >= ctx_->deadline()) {
      Complete(End(kExpired, "the call's deadline passed before its request message came"));
    } else if (cancelled()) {
      Complete(End(kCancelled, "the client cancelled the call"));
    } else {
      Complete(End(kNoMessage, "the call ended without a request message"));
    }
    return;
  }
  OnRequest();
}

void Call::OnWriteDone(bool ok) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    writing_ = false;
    ++write_generation_;
    if (write_alarm_) write_alarm_->Cancel();
  }
  OnWritten(ok);
}

void Call::OnCancel() {
  cancelled_.store(true);
  SendRefusal();  // a delayed refusal ends now
  OnCancelled();
}

bool Call::TakeSlot(Slots *slots, Slots **held) {
  Reason reason;
  std::string message;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (finished_) return false;  // ended meanwhile (cancelled, stopping): nothing to hold
    if (slots->Take(peer_, client_, &reason, &message)) {
      *held = slots;
      return true;
    }
  }
  service_->guards()->refusals.Note(reason, ctx_->method(), peer_);
  // A Watch refused ends UNIMPLEMENTED, as at the Python server (server/gate.py): a gRPC
  // client's own health checking (gRFC A17) then counts this server healthy instead of
  // failing it, so whoever fills the pool takes no replica out of its clients' balancing.
  const bool watch = method_ != nullptr && method_->kind == Kind::kHealthWatch;
  Complete(End(watch ? kWatchesFull : kSlotsFull, message));
  return false;
}

void Call::GiveSlot(Slots **held) {
  if (*held == nullptr) return;
  (*held)->LeaveServer(peer_);
  (*held)->LeaveClient(client_);
  *held = nullptr;
}

void Call::OnDone() {
  {
    std::lock_guard<std::recursive_mutex> lock(done_mu_);
    done_ = true;
  }
  first_alarm_.Cancel();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (write_alarm_) write_alarm_->Cancel();
    LeaveWaiting();
    GiveSlot(&slots_);
    if (client_held_ != nullptr) client_held_->LeaveClient(client_);
    client_held_ = nullptr;
  }
  // A call its client reset as it began, before its deadline, counts against its
  // connection's premature resets (Connections::CallEnded).
  if (Connections *connections = service_->guards()->connections) {
    const bool premature = cancelled() &&
                           Clock::now() - began_ < std::chrono::duration<double>(Connections::kPrematureSeconds) &&
                           std::chrono::system_clock::now() < ctx_->deadline();
    connections->CallEnded(peer_, premature);
  }
  OnGone();
  self_.reset();  // may be the last reference: nothing after this line
}

}  // namespace nlmserve_frontend
