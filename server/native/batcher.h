// The batcher: ScoreNgrams calls (ScoreCall, admitted by the guards) merged into backend
// batches of up to --max-batch-ngrams n-grams, waiting at most --max-delay-us for company
// (--delay-policy adaptive: only while fewer requests are queued than the last batch held),
// at most --max-inflight batches at the backend and --max-queue-ngrams queued. Requests are
// merged only when they agree on log base, normalisation and the caller's `authorization`
// metadata (BatchKey); packed rows shorter than the batch's widest are widened by the
// client library's WidenRows. Packed batches go over the local channel (local_channel.h),
// whose answer gives each request its own status; string batches go over gRPC, and when
// the backend refuses one as INVALID_ARGUMENT each request of it is sent again alone. A
// request that fails the cheap shape check, or is larger than a batch, is sent alone. A
// call whose deadline has passed or whose client has gone by the time its turn comes is
// dropped (DEADLINE_EXCEEDED or CANCELLED, counted) rather than batched or sent, so expired
// and abandoned requests cost the model nothing.
#ifndef NLMSERVE_FRONTEND_BATCHER_H
#define NLMSERVE_FRONTEND_BATCHER_H

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "log.h"
#include "nlmserve/v1/lm.grpc.pb.h"
#include "options.h"
#include "score_call.h"

namespace nlmserve_frontend {

using nlmserve::v1::LanguageModel;
using nlmserve::v1::ModelInfo;

// What merged requests must agree on.
struct BatchKey {
  bool packed = true;
  int log_base = 0;
  bool allow_unnormalized = false;
  std::string authorization;
  bool operator==(const BatchKey &o) const {
    return packed == o.packed && log_base == o.log_base && allow_unnormalized == o.allow_unnormalized &&
           authorization == o.authorization;
  }
};

// One queued ScoreNgrams call.
struct Pending {
  std::shared_ptr<ScoreCall> call;
  BatchKey key;
  long ngrams;
  Clock::time_point arrival;
};

// One merged backend call and the calls it answers.
struct Batch {
  std::vector<Pending> items;
  grpc::ClientContext context;
  ScoreNgramsRequest request;
  ScoreNgramsResponse response;
  long ngrams = 0;
  // Packed batches (the local channel): each item's rows and packed order, and, once
  // answered, each item's own status.
  std::vector<std::pair<uint32_t, uint32_t> > parts;
  std::vector<grpc::Status> part_status;
};

// The batcher of the file comment; its threads run from construction to Stop.
class Batcher final : public ScoreQueue {
 public:
  Batcher(const Options &options, std::shared_ptr<grpc::Channel> channel, const ModelInfo &info);

  ~Batcher() { Stop(); }

  // Drains the queue and the in-flight batches, then ends the batching thread.
  void Stop();

  std::string Stats();

  // A ScoreNgrams call, parsed and holding its slot.
  void Submit(std::shared_ptr<ScoreCall> call) override;

 private:
  // Whether the request has a shape that can be merged, and its key kind and size.
  bool Shape(const ScoreNgramsRequest &r, BatchKey *key, long *ngrams) const;

  // Forwards one request unchanged; the caller gets the backend's answer as it is. A call
  // whose deadline passed or whose client left is dropped instead.
  void SendAlone(const Pending &p, bool resent = false);

  // The batching thread: waits for company up to the delay, takes one key's requests in
  // arrival order up to the batch size, and sends them while fewer than --max-inflight
  // batches are at the backend.
  void Run();

  void Send(std::unique_ptr<Batch> batch);

  // A sender thread of the local channel: one connection, one batch at a time.
  void SendLocal();

  // Backend answer for a merged batch: scatter (a packed batch's failed parts get their own
  // status), or hand every request the batch's error.
  void Done(std::unique_ptr<Batch> batch, const grpc::Status &status);

  const Options options_;
  std::unique_ptr<LanguageModel::Stub> stub_;
  const uint32_t order_;
  const uint32_t bos_id_;
  const uint32_t unk_id_;
  const long max_batch_;

  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::deque<Pending> queue_;
  long queued_ngrams_ = 0;
  long inflight_ = 0;
  long last_batch_requests_ = 1;
  bool stopping_ = false;
  uint64_t requests_ = 0, ngrams_ = 0, batches_ = 0, alone_ = 0, rejected_ = 0, dropped_ = 0;
  std::thread batcher_;
  std::deque<std::unique_ptr<Batch>> outbox_;  // batches for the local channel's senders
  std::condition_variable outbox_cv_;
  bool senders_done_ = false;
  std::vector<std::thread> senders_;
};

}  // namespace nlmserve_frontend

#endif  // NLMSERVE_FRONTEND_BATCHER_H
