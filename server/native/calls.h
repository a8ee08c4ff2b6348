// The native front end's calls: every call is served by one generic callback service
// (CallService), whose handler runs as soon as a call's headers have arrived, before its
// request message is read. So the front end checks the caller's token from the metadata
// alone, waits for the request message at most --first-message-ms, parses it itself
// (INVALID_ARGUMENT when it does not parse), takes a slot (Slots) for the call while it is
// held, and ends a call whose client does not read an answer within
// --stream-write-timeout-ms. Then:
//
// - ScoreCall (LanguageModel.ScoreNgrams): handed to the batcher (ScoreQueue), which drops
//   it unsent when its deadline passes or its client goes away first;
// - RelayCall (every other LanguageModel and Admin method, and server reflection): the
//   request bytes forwarded to the backend, its answers back as the client reads them;
// - HealthCall (grpc.health.v1): answered here from HealthState, open without a token;
//   Check is never limited, Watch streams have slots of their own.
//
// Included by nlmserve_frontend.cpp (one translation unit), after guards.h.
#ifndef NLMSERVE_FRONTEND_CALLS_H
#define NLMSERVE_FRONTEND_CALLS_H

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/wire_format_lite.h>
#include <grpc/grpc.h>
#include <grpcpp/alarm.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/support/proto_buffer_reader.h>
#include <grpcpp/support/proto_buffer_writer.h>

#include "guards.h"
#include "nlmserve/v1/lm.grpc.pb.h"

namespace nlmserve_frontend {

using nlmserve::v1::ScoreNgramsRequest;
using nlmserve::v1::ScoreNgramsResponse;

// --------------------------------------------------------------------------- settings

// The limits every call is held to (the flags of the same names).
struct CallLimits {
  long first_message_ms = 60000;
  long stream_write_timeout_ms = 30000;
  long backend_timeout_ms = 30000;
  long max_metadata_bytes = 16384;
};

// What every call consults: tokens, slots, refusal counts, and whether the front end is
// stopping. Owned by main, outliving the server.
struct Guards {
  Guards(long max_rpcs, long per_connection, long per_client, long max_watches, long watches_per_connection)
      : rpcs({"concurrent calls", max_rpcs, per_connection, per_client,
              {kReasonMaxConcurrentRpcs, kReasonMaxRpcsPerConnection, kReasonMaxRpcsPerClient},
              {"--max-concurrent-rpcs", "--max-rpcs-per-connection", "--max-rpcs-per-client"}}),
        watches({"health Watch streams", max_watches, watches_per_connection, max_watches,
                 {kReasonMaxHealthWatches, kReasonMaxHealthWatchesPerConnection, kReasonMaxHealthWatches},
                 {"--max-health-watches", "--max-health-watches-per-connection", "--max-health-watches"}}),
        awaiting({"calls waiting for their request message", max_rpcs, per_connection, per_client,
                  {kReasonAwaitingMessage, kReasonAwaitingMessage, kReasonAwaitingMessage},
                  {"--max-concurrent-rpcs", "--max-rpcs-per-connection", "--max-rpcs-per-client"}}),
        health_awaiting({"health calls waiting for their request message", max_watches, watches_per_connection,
                         max_watches, {kReasonAwaitingMessage, kReasonAwaitingMessage, kReasonAwaitingMessage},
                         {"--max-health-watches", "--max-health-watches-per-connection", "--max-health-watches"}}) {}
  TokenSet tokens;
  AuthFailures auth_failures;
  Refusals refusals;
  Slots rpcs;     // every call but health's, once its request message is there
  Slots watches;  // health Watch streams
  // Calls whose headers have come and whose request message has not (a client sends it
  // with the headers: only a call held open without one waits here), authorised ones and
  // health's apart, so that a client cannot hold an unbounded number of them until
  // --first-message-ms cuts them.
  Slots awaiting;
  Slots health_awaiting;
  // The public port's connections (set before the server starts): told how each call
  // ended, for the premature-reset guard.
  Connections *connections = nullptr;
  std::atomic<bool> stopping{false};
};

// --------------------------------------------------------------------------- messages

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

// grpc.health.v1, by hand (two fields; the proto is not part of the installed library):
// HealthCheckRequest { string service = 1; }, HealthCheckResponse { ServingStatus status = 1; }.
enum HealthStatus { kHealthUnknown = 0, kServing = 1, kNotServing = 2, kServiceUnknown = 3 };

inline bool ParseHealthRequest(grpc::ByteBuffer *message, std::string *service) {
  using google::protobuf::internal::WireFormatLite;
  grpc::ProtoBufferReader reader(message);
  if (!reader.status().ok()) return false;
  google::protobuf::io::CodedInputStream in(&reader);
  service->clear();
  for (;;) {
    const uint32_t tag = in.ReadTag();
    if (tag == 0) return in.ConsumedEntireMessage();  // the end, or bytes that are no tag
    if (tag == WireFormatLite::MakeTag(1, WireFormatLite::WIRETYPE_LENGTH_DELIMITED)) {
      uint32_t length = 0;
      if (!in.ReadVarint32(&length) || !in.ReadString(service, static_cast<int>(length))) return false;
    } else if (!WireFormatLite::SkipField(&in, tag)) {
      return false;
    }
  }
}

inline grpc::ByteBuffer HealthRequest(const std::string &service) {
  std::string bytes;
  if (!service.empty()) {
    bytes += '\x0a';
    for (std::size_t n = service.size(); ; n >>= 7) {  // varint length
      if (n < 0x80) {
        bytes += static_cast<char>(n);
        break;
      }
      bytes += static_cast<char>((n & 0x7f) | 0x80);
    }
    bytes += service;
  }
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

inline grpc::ByteBuffer HealthResponse(HealthStatus status) {
  const char bytes[2] = {'\x08', static_cast<char>(status)};
  grpc::Slice slice(bytes, 2);
  return grpc::ByteBuffer(&slice, 1);
}

// The status a HealthCheckResponse holds (kHealthUnknown when it does not parse).
inline HealthStatus ParseHealthResponse(grpc::ByteBuffer *message) {
  using google::protobuf::internal::WireFormatLite;
  grpc::ProtoBufferReader reader(message);
  if (!reader.status().ok()) return kHealthUnknown;
  google::protobuf::io::CodedInputStream in(&reader);
  uint32_t status = kHealthUnknown;
  for (;;) {
    const uint32_t tag = in.ReadTag();
    if (tag == 0) break;
    if (tag == WireFormatLite::MakeTag(1, WireFormatLite::WIRETYPE_VARINT)) {
      if (!in.ReadVarint32(&status)) return kHealthUnknown;
    } else if (!WireFormatLite::SkipField(&in, tag)) {
      return kHealthUnknown;
    }
  }
  if (!in.ConsumedEntireMessage()) return kHealthUnknown;
  return status <= kServiceUnknown ? static_cast<HealthStatus>(status) : kHealthUnknown;
}

// --------------------------------------------------------------------------- methods

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

// --------------------------------------------------------------------------- health

// What the front end's health service reports: "" and the LanguageModel service, SERVING
// while the backend answers; every Watch stream is told of each change. A stream is
// dropped from the list when gRPC lets it go (Remove): a watcher kept in the list until the
// next change would keep its call's memory (make_shared's one block) scattered through
// the heap after a flood of Watch streams has left.
class HealthState {
 public:
  class Watcher {
   public:
    virtual ~Watcher() {}
    virtual void Notify(HealthStatus status) = 0;
    virtual void Close() = 0;
  };

  explicit HealthState(std::string service) : service_(std::move(service)) {}

  HealthStatus StatusOf(const std::string &service) const {
    if (!service.empty() && service != service_) return kServiceUnknown;
    std::lock_guard<std::mutex> lock(mu_);
    return serving_ ? kServing : kNotServing;
  }

  void Set(bool serving) {
    std::vector<std::shared_ptr<Watcher> > tell;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (serving_ == serving) return;
      serving_ = serving;
      tell = Live();
    }
    for (auto &w : tell) w->Notify(serving ? kServing : kNotServing);
  }

  void Add(const std::shared_ptr<Watcher> &watcher) {
    std::lock_guard<std::mutex> lock(mu_);
    watchers_[watcher.get()] = watcher;
  }

  void Remove(const Watcher *watcher) {
    std::lock_guard<std::mutex> lock(mu_);
    watchers_.erase(watcher);
  }

  // At shutdown: NOT_SERVING to every stream, which then ends (OK) once told.
  void CloseAll() {
    std::vector<std::shared_ptr<Watcher> > tell;
    {
      std::lock_guard<std::mutex> lock(mu_);
      serving_ = false;
      closed_ = true;
      tell = Live();
    }
    for (auto &w : tell) w->Close();
  }

  bool closed() const {
    std::lock_guard<std::mutex> lock(mu_);
    return closed_;
  }

 private:
  // The watchers still there. Under mu_.
  std::vector<std::shared_ptr<Watcher> > Live() {
    std::vector<std::shared_ptr<Watcher> > live;
    live.reserve(watchers_.size());
    for (auto &w : watchers_) {
      if (auto s = w.second.lock()) live.push_back(std::move(s));
    }
    return live;
  }

  const std::string service_;
  mutable std::mutex mu_;
  bool serving_ = true;
  bool closed_ = false;
  std::unordered_map<const Watcher *, std::weak_ptr<Watcher> > watchers_;
};

class CallService;

// --------------------------------------------------------------------------- one call

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
  // Ends the call with an authentication refusal, at once or after the delay AuthFailures
  // gives the caller's address.
  void Refuse(const grpc::Status &status);
  void SendRefusal();
  void ArmWriteTimer();
  void WriteTimeout(uint64_t generation);
  // Whether this caller is the one to finish the call; the call's slots are given back
  // then (under mu_).
  bool Finishing();

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
  // The slots a call holds (under mu_): `awaiting_` while its request message is awaited,
  // `slots_` once it is there, until the call is finished (Finishing). Its answer and
  // status are gRPC's to send from then on, and gRPC's OnDone, after which the call is
  // gone, can lag the finish by seconds while the transport is busy with other clients:
  // a finished call holds no slot, or an answered client would be refused for calls it no
  // longer has (the Python server's gate gives slots back when the handler returns). A call
  // cut by the write timeout gives the front end's and its connection's slot back at once
  // and keeps counting against its client's share until OnDone (`client_held_`), so that a
  // client that does not read cannot pile up calls beyond its share.
  Slots *awaiting_ = nullptr;
  Slots *slots_ = nullptr;
  Slots *client_held_ = nullptr;
  std::shared_ptr<Call> self_;
};

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

// --------------------------------------------------------------------------- the service

// Every method of the front end, on gRPC's generic callback service.
class CallService final : public grpc::CallbackGenericService {
 public:
  CallService(Guards *guards, HealthState *health, ScoreQueue *queue, std::shared_ptr<grpc::Channel> backend,
              const CallLimits &limits)
      : guards_(guards), health_(health), queue_(queue), backend_(std::move(backend)), limits_(limits) {}

  grpc::ServerGenericBidiReactor *CreateReactor(grpc::GenericCallbackServerContext *ctx) override {
    const Method *method = Find(ctx->method());
    std::shared_ptr<Call> call;
    if (method != nullptr && method->kind == Kind::kScore) {
      call = std::make_shared<ScoreCall>(this, ctx, method);
    } else if (method != nullptr && (method->kind == Kind::kHealthCheck || method->kind == Kind::kHealthWatch)) {
      call = std::make_shared<HealthCall>(this, ctx, method);
    } else {
      call = std::make_shared<RelayCall>(this, ctx, method);  // or, for an unknown method, ended at once
    }
    call->Begin(call);
    return call.get();
  }

  Guards *guards() { return guards_; }
  HealthState *health() { return health_; }
  ScoreQueue *queue() { return queue_; }
  grpc::GenericStub *stub() { return &stub_; }
  const CallLimits &limits() const { return limits_; }

 private:
  static const Method *Find(const std::string &path) {
    static const Method kMethods[] = {
        {"/nlmserve.v1.LanguageModel/ScoreNgrams", Kind::kScore, nullptr, 0},
        {"/nlmserve.v1.LanguageModel/ScoreSentences", Kind::kRelay, Parses<nlmserve::v1::ScoreSentencesRequest>, 0},
        {"/nlmserve.v1.LanguageModel/GetModelInfo", Kind::kRelay, Parses<nlmserve::v1::GetModelInfoRequest>, 0},
        {"/nlmserve.v1.LanguageModel/GetVocabulary", Kind::kRelay, Parses<nlmserve::v1::GetVocabularyRequest>, 0},
        {"/nlmserve.v1.LanguageModel/GetScoringTables", Kind::kRelay,
         Parses<nlmserve::v1::GetScoringTablesRequest>, 0},
        // A reload reads and checks a model file: the caller's deadline, not the backend timeout.
        {"/nlmserve.v1.Admin/ReloadModel", Kind::kRelay, Parses<nlmserve::v1::ReloadModelRequest>,
         24L * 3600 * 1000},
        {"/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", Kind::kRelayStream, nullptr, 0},
        {"/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", Kind::kRelayStream, nullptr, 0},
        {"/grpc.health.v1.Health/Check", Kind::kHealthCheck, nullptr, 0},
        {"/grpc.health.v1.Health/Watch", Kind::kHealthWatch, nullptr, 0},
    };
    for (const Method &m : kMethods) {
      if (path == m.path) return &m;
    }
    return nullptr;
  }

  Guards *guards_;
  HealthState *health_;
  ScoreQueue *queue_;
  std::shared_ptr<grpc::Channel> backend_;
  grpc::GenericStub stub_{backend_};
  const CallLimits limits_;
};

// --------------------------------------------------------------------------- Call

inline Call::Call(CallService *service, grpc::GenericCallbackServerContext *ctx, const Method *method)
    : service_(service), ctx_(ctx), method_(method) {}

inline void Call::Begin(std::shared_ptr<Call> self) {
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
  if (!TakeSlot(open ? &guards->health_awaiting : &guards->awaiting, &awaiting_)) return;
  std::weak_ptr<Call> weak = self_;
  first_alarm_.Set(std::chrono::system_clock::now() + std::chrono::milliseconds(service_->limits().first_message_ms),
                   [weak](bool fired) {
                     if (!fired) return;
                     if (auto call = weak.lock()) call->FirstMessageTimeout();
                   });
  StartRead(&first_);
}

inline void Call::Refuse(const grpc::Status &status) {
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
inline void Call::SendRefusal() {
  std::unique_ptr<grpc::Status> status;
  {
    std::lock_guard<std::mutex> lock(mu_);
    status.swap(refusal_);
  }
  if (!status) return;
  service_->guards()->auth_failures.Answered(refused_address_);
  Complete(*status);
}

inline bool Call::Finishing() {
  if (finished_) return false;
  finished_ = true;
  GiveSlot(&awaiting_);
  GiveSlot(&slots_);
  return true;
}

// Finish and the writes are started under mu_, so that no write follows the finish (gRPC
// aborts on one). Neither runs a reaction on the calling thread.
inline void Call::Complete(const grpc::Status &status) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!Finishing()) return;
  Finish(status);
}

inline void Call::CompleteWith(grpc::ByteBuffer *last) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!Finishing()) return;
  writing_ = true;
  ++write_generation_;
  ArmWriteTimer();
  StartWriteAndFinish(last, grpc::WriteOptions(), grpc::Status::OK);
}

inline bool Call::Write(grpc::ByteBuffer *message) {
  std::lock_guard<std::mutex> lock(mu_);
  if (finished_) return false;
  writing_ = true;
  ++write_generation_;
  ArmWriteTimer();
  StartWrite(message);
  return true;
}

// Under mu_.
inline void Call::ArmWriteTimer() {
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

inline void Call::WriteTimeout(uint64_t generation) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!writing_ || generation != write_generation_) return;
    writing_ = false;  // cut once
    // The front end's slot is free at once; the client's share is until OnDone.
    if (slots_ != nullptr) {
      slots_->LeaveServer(peer_);
      client_held_ = slots_;
      slots_ = nullptr;
    }
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

inline void Call::FirstMessageTimeout() {
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

inline void Call::OnReadDone(bool ok) {
  FirstMessage state;
  {
    std::lock_guard<std::mutex> lock(mu_);
    state = first_state_;
    if (state == FirstMessage::kAwaited) {
      first_state_ = FirstMessage::kRead;
      GiveSlot(&awaiting_);
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

inline void Call::OnWriteDone(bool ok) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    writing_ = false;
    ++write_generation_;
    if (write_alarm_) write_alarm_->Cancel();
  }
  OnWritten(ok);
}

inline void Call::OnCancel() {
  cancelled_.store(true);
  SendRefusal();  // a delayed refusal ends now
  OnCancelled();
}

inline bool Call::TakeSlot(Slots *slots, Slots **held) {
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

inline void Call::GiveSlot(Slots **held) {
  if (*held == nullptr) return;
  (*held)->LeaveServer(peer_);
  (*held)->LeaveClient(client_);
  *held = nullptr;
}

inline void Call::OnDone() {
  {
    std::lock_guard<std::recursive_mutex> lock(done_mu_);
    done_ = true;
  }
  first_alarm_.Cancel();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (write_alarm_) write_alarm_->Cancel();
    GiveSlot(&awaiting_);
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

// --------------------------------------------------------------------------- ScoreCall

inline void ScoreCall::OnRequest() {
  if (!Parse(&first_, &request_)) {
    Complete(End(kMalformed, "the request message does not parse as nlmserve.v1.ScoreNgramsRequest"));
    return;
  }
  if (!TakeSlot(&service_->guards()->rpcs)) return;
  service_->queue()->Submit(std::static_pointer_cast<ScoreCall>(shared_from_this()));
}

// --------------------------------------------------------------------------- RelayCall

inline void RelayCall::OnRequest() {
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
inline void RelayCall::Sent(bool ok) {
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

inline void RelayCall::OnLaterRead(bool ok) {
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

inline void RelayCall::CloseUp(bool writes_done) {
  up_state_ = Up::kClosed;
  if (writes_done) backend_.StartWritesDone();
  backend_.RemoveHold();
}

// A message from the backend: to the client (the next is read once the client has it).
inline void RelayCall::Received(bool ok) {
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

inline void RelayCall::OnWritten(bool ok) {
  if (ok) {
    backend_.StartRead(&down_);
    return;
  }
  CancelBackend();  // the client is gone or the call was cut: no more reads
  backend_.RemoveHold();
}

inline void RelayCall::BackendDone(const grpc::Status &status) {
  std::shared_ptr<Call> keep = std::move(backend_keep_);  // released on return: nothing after
  Complete(status);
}

// --------------------------------------------------------------------------- HealthCall

inline void HealthCall::OnRequest() {
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

inline void HealthCall::OnGone() { service_->health()->Remove(this); }

inline void HealthCall::Notify(HealthStatus) {
  std::unique_lock<std::mutex> lock(health_mu_);
  latest_ = service_->health()->StatusOf(watched_);
  WriteLatest(&lock);
}

inline void HealthCall::Close() {
  std::unique_lock<std::mutex> lock(health_mu_);
  closing_ = true;
  latest_ = service_->health()->StatusOf(watched_);
  WriteLatest(&lock);
}

inline void HealthCall::WriteLatest(std::unique_lock<std::mutex> *lock) {
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

inline void HealthCall::OnWritten(bool ok) {
  std::unique_lock<std::mutex> lock(health_mu_);
  writing_ = false;
  if (!ok) {
    ended_ = true;  // cancelled or cut: OnCancelled or the write timeout ends the call
    return;
  }
  WriteLatest(&lock);
}

inline void HealthCall::OnCancelled() {
  {
    std::lock_guard<std::mutex> lock(health_mu_);
    ended_ = true;
  }
  Complete(grpc::Status::CANCELLED);
}

}  // namespace nlmserve_frontend

#endif  // NLMSERVE_FRONTEND_CALLS_H
