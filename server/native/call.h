// One call of the front end, what every call does before and around its own work: its
// handler runs as soon as the call's headers have arrived, before its request message is
// read. So the front end checks the caller's token from the metadata alone (a refusal
// slowed by AuthFailures), waits for the request message at most --first-message-ms,
// takes a slot (Slots) while the call is held, ends a call whose client does not read an
// answer within --stream-write-timeout-ms, and gives its slots back once it is finished.
// Its kinds (score_call.h, relay_call.h, health_call.h) do the rest; CallService
// (service.h) makes them.
#ifndef NLMSERVE_FRONTEND_CALL_H
#define NLMSERVE_FRONTEND_CALL_H

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include <grpcpp/alarm.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/support/proto_buffer_reader.h>

#include "log.h"
#include "slots.h"
#include "waiting.h"

namespace nlmserve_frontend {

// The limits every call is held to (the flags of the same names).
struct CallLimits {
  long first_message_ms = 60000;
  long stream_write_timeout_ms = 30000;
  long backend_timeout_ms = 30000;
  long max_metadata_bytes = 16384;
};

// Whether `message` parses as a `Message` (read in place, the buffer left as it is).
template <class Message>
bool Parse(grpc::ByteBuffer *message, Message *out) {
  grpc::ProtoBufferReader reader(message);
  return reader.status().ok() && out->ParseFromZeroCopyStream(&reader);
}

template <class Message>
bool Parses(grpc::ByteBuffer *message) {
  Message parsed;
  return Parse(message, &parsed);
}

// kRelay: a unary or server-streaming method, whose one request message is forwarded;
// kRelayStream: a bidirectional one (reflection), every message of the client forwarded.
enum class Kind { kScore, kRelay, kRelayStream, kHealthCheck, kHealthWatch };

// A method the front end serves: its path, how, whether its request is parsed here
// (null: left to the backend, as reflection's), and the longest a backend call for it may
// take (0: --backend-timeout-ms).
struct Method {
  const char *path;
  Kind kind;
  bool (*parses)(grpc::ByteBuffer *);
  long timeout_ms;
};

class CallService;

// What every call does before and around its own work (file comment). Held by a
// shared_ptr to itself from its start until gRPC's OnDone, and by its timers' callbacks
// only while they run (they keep a weak_ptr).
class Call : public grpc::ServerGenericBidiReactor, public std::enable_shared_from_this<Call> {
 public:
  Call(CallService *service, grpc::GenericCallbackServerContext *ctx, const Method *method);
  ~Call() override {}

  // Starts the call (from CreateReactor): ends it at once when the front end is stopping,
  // the caller's token is missing or wrong, or the method is unknown; else reads the
  // request message, within --first-message-ms.
  void Begin(std::shared_ptr<Call> self);

 protected:
  // The first request message is in first_.
  virtual void OnRequest() = 0;
  // A read after the first one finished (only RelayCall reads more).
  virtual void OnLaterRead(bool /*ok*/) {}
  // A write started by Write finished (ok false: the call is over or was cut).
  virtual void OnWritten(bool /*ok*/) {}
  // The client cancelled, went away, or the deadline passed.
  virtual void OnCancelled() {}
  // A write waited longer than --stream-write-timeout-ms and the call was cut.
  virtual void OnWriteTimedOut() {}
  // gRPC has let the call go (its OnDone): nothing of it may be used from elsewhere after.
  virtual void OnGone() {}

  // Ends the call with `status` (the first call of Complete or CompleteWith wins).
  void Complete(const grpc::Status &status);
  // Ends the call with `last` as its last message and OK (held to the write timeout).
  void CompleteWith(grpc::ByteBuffer *last);
  // Writes `message` (which must live until OnWritten), held to the write timeout; false
  // (nothing written, no OnWritten) when the call is already finished.
  bool Write(grpc::ByteBuffer *message);
  // Takes a slot of `slots` for the call's connection and client until the call is
  // finished; false (and the call ended RESOURCE_EXHAUSTED, unless it was over already)
  // when a limit is reached.
  bool TakeSlot(Slots *slots) { return TakeSlot(slots, &slots_); }
  // Whether the client has cancelled or gone away.
  bool cancelled() const { return cancelled_.load(); }

  CallService *const service_;
  grpc::GenericCallbackServerContext *const ctx_;
  const Method *const method_;
  grpc::ByteBuffer first_;
  Clock::time_point began_;    // when the call's headers came (Begin)
  std::string peer_;           // the connection (address and port)
  std::string client_;         // the client (ClientOf)
  std::string authorization_;  // the caller's authorization metadata, forwarded

 private:
  void OnReadDone(bool ok) final;
  void OnWriteDone(bool ok) final;
  void OnCancel() final;
  void OnDone() final;
  void FirstMessageTimeout();
  // Ends a call still waiting for its request message, cut for a newer one (Waiting).
  void CutWaiting();
  // The call no longer waits for its request message (under mu_).
  void LeaveWaiting();
  // Ends the call with an authentication refusal, at once or after the delay AuthFailures
  // gives the caller's address.
  void Refuse(const grpc::Status &status);
  void SendRefusal();
  void ArmWriteTimer();
  void WriteTimeout(uint64_t generation);
  // Whether this caller is the one to finish the call; the call's slots are given back
  // then, all but its client's share when an answer goes with the finish (`answering`) or
  // is being written (under mu_).
  bool Finishing(bool answering);
  // Gives the front end's and the connection's slot back and keeps the client's share
  // until OnDone (under mu_).
  void HoldClientOnly();

  // The request message: awaited, then either not read in time or read (later reads are
  // RelayCall's).
  enum class FirstMessage { kAwaited, kTimedOut, kRead };
  std::mutex mu_;
  bool finished_ = false;
  FirstMessage first_state_ = FirstMessage::kAwaited;
  bool writing_ = false;
  uint64_t write_generation_ = 0;
  std::atomic<bool> cancelled_{false};
  grpc::Alarm first_alarm_;
  std::unique_ptr<grpc::Alarm> write_alarm_;
  // Cutting a call (grpc_call_cancel_with_status) and gRPC's OnDone, after which the call
  // is gone, exclude each other; recursive, as gRPC may run OnDone on the cutting thread.
  std::recursive_mutex done_mu_;
  bool done_ = false;
  // A slot of `slots` into `*held`, or the call ended RESOURCE_EXHAUSTED (none once the
  // call is finished); and its return, whole (under mu_).
  bool TakeSlot(Slots *slots, Slots **held);
  void GiveSlot(Slots **held);
  std::unique_ptr<grpc::Status> refusal_;  // a refusal waiting out its delay
  std::string refused_address_;
  // What a call holds (under mu_): a place among the calls waiting for their request
  // message (`waiting_`, `ticket_`) while it is awaited, a slot (`slots_`) once it is
  // there, until the call is finished (Finishing). Its answer and status are gRPC's to
  // send from then on, and gRPC's OnDone, after which the call is gone, can lag the finish
  // by seconds while the transport is busy with other clients: a finished call holds
  // neither the front end's slot nor its connection's, or clients would be refused for
  // calls the front end no longer has. A call finished with an answer still to be sent
  // (or cut by the write timeout) keeps counting against its client's share until OnDone
  // (`client_held_`), so that a client that does not read cannot pile up answers beyond
  // its share; the Python server's gate does the same (server/gate.py).
  Waiting *waiting_ = nullptr;  // and its ticket, while the request message is awaited
  Waiting::Ticket ticket_;
  bool read_started_ = false;  // Begin has started the first read (a cut waits for it)
  bool cut_pending_ = false;
  Slots *slots_ = nullptr;
  Slots *client_held_ = nullptr;
  std::shared_ptr<Call> self_;
};

}  // namespace nlmserve_frontend

#endif  // NLMSERVE_FRONTEND_CALL_H
