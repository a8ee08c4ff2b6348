// Batcher (batcher.h): the queue, the batching thread, the local channel's senders, and
// each batch's answer scattered to its calls.
#include "batcher.h"

#include <algorithm>
#include <chrono>
#include <sstream>

#include "endings.h"
#include "local_channel.h"
#include "local_frames.h"
#include "nlmserve_client.h"

namespace nlmserve_frontend {

Batcher::Batcher(const Options &options, std::shared_ptr<grpc::Channel> channel, const ModelInfo &info)
    : options_(options),
      stub_(LanguageModel::NewStub(channel)),
      order_(info.order()),
      bos_id_(info.bos_id()),
      unk_id_(info.unk_id()),
      max_batch_(std::min<long>(options.max_batch_ngrams,
                                info.max_ngrams_per_request() ? static_cast<long>(info.max_ngrams_per_request())
                                                              : options.max_batch_ngrams)) {
  batcher_ = std::thread([this]() { Run(); });
  for (long i = 0; i < options_.max_inflight; ++i) senders_.emplace_back([this]() { SendLocal(); });
}

void Batcher::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  cv_.notify_all();
  if (batcher_.joinable()) batcher_.join();
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [this]() { return inflight_ == 0; });
  senders_done_ = true;
  lock.unlock();
  outbox_cv_.notify_all();
  for (auto &t : senders_) t.join();
  senders_.clear();
}

std::string Batcher::Stats() {
  std::lock_guard<std::mutex> lock(mu_);
  std::ostringstream s;
  s << requests_ << " ScoreNgrams requests (" << ngrams_ << " n-grams merged) in " << batches_
    << " backend batches, " << alone_ << " sent alone, " << rejected_ << " refused (queue full), " << dropped_
    << " dropped unsent (deadline passed or client gone)";
  return s.str();
}

void Batcher::Submit(std::shared_ptr<ScoreCall> call) {
  Ending gone;
  if (call->Gone(&gone)) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++requests_;
      ++dropped_;
    }
    call->Drop(gone);
    return;
  }
  const ScoreNgramsRequest &request = call->request();
  Pending p{std::move(call), BatchKey(), 0, Clock::now()};
  if (!Shape(request, &p.key, &p.ngrams) || p.ngrams > max_batch_) {
    SendAlone(p);
    return;
  }
  p.key.log_base = request.log_base();
  p.key.allow_unnormalized = request.allow_unnormalized();
  p.key.authorization = p.call->authorization();
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++requests_;
    ngrams_ += p.ngrams;
    if (stopping_ || queued_ngrams_ + p.ngrams > options_.max_queue_ngrams) {
      ++rejected_;
      p.call->Answer(stopping_ ? End(kStopping, "the front end is shutting down")
                               : End(kQueueFull, "the front end's queue is full (" +
                                                     std::to_string(options_.max_queue_ngrams) +
                                                     " n-grams); retry later"));
      return;
    }
    const bool was_empty = queue_.empty();
    queued_ngrams_ += p.ngrams;
    queue_.push_back(std::move(p));
    // Wake the batching thread only when this arrival can change what it waits for: the
    // first request of an empty queue, a full batch, or (adaptive policy) as many
    // requests as the last batch held. Otherwise it is waiting out the delay or for a
    // batch in flight, and a wake-up would only cost a context switch.
    wake = was_empty || queued_ngrams_ >= max_batch_ ||
           (!options_.fixed_delay && static_cast<long>(queue_.size()) >= last_batch_requests_);
  }
  if (wake) cv_.notify_one();
}

bool Batcher::Shape(const ScoreNgramsRequest &r, BatchKey *key, long *ngrams) const {
  // A log base the enum does not hold goes alone: the model server refuses it.
  if (r.log_base() != nlmserve::v1::LOG_BASE_UNSPECIFIED && r.log_base() != nlmserve::v1::LOG10 &&
      r.log_base() != nlmserve::v1::LN)
    return false;
  bool has_packed = !r.packed_ids().empty() || r.packed_order() != 0;
  if (has_packed && r.ngrams_size() > 0) return false;
  if (has_packed) {
    std::size_t bytes = r.packed_ids().size();
    uint32_t k = r.packed_order();
    if (k == 0 || k > order_ || bytes == 0 || bytes % (4u * k) != 0) return false;
    key->packed = true;
    *ngrams = static_cast<long>(bytes / (4u * k));
    return true;
  }
  if (r.ngrams_size() == 0) return false;
  for (const auto &g : r.ngrams()) {
    if (g.words_size() == 0 || static_cast<uint32_t>(g.words_size()) > order_) return false;
  }
  key->packed = false;
  *ngrams = r.ngrams_size();
  return true;
}

void Batcher::SendAlone(const Pending &p, bool resent) {
  Ending gone;
  const bool drop = p.call->Gone(&gone);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!resent) ++requests_;
    ++(drop ? dropped_ : alone_);
  }
  if (drop) {
    p.call->Drop(gone);
    return;
  }
  std::shared_ptr<ScoreCall> call = p.call;
  grpc::ClientContext *ctx = call->NewForward(options_.backend_timeout_ms);
  stub_->async()->ScoreNgrams(ctx, &call->request(), call->response(),
                              [call](grpc::Status status) { call->Answer(status); });
}

void Batcher::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  const auto delay = std::chrono::microseconds(options_.max_delay_us);
  for (;;) {
    cv_.wait(lock, [this]() { return (!queue_.empty() && inflight_ < options_.max_inflight) || (stopping_ && queue_.empty()); });
    if (queue_.empty()) return;  // stopping, nothing left
    // Wait for company up to the delay; under the adaptive policy only while fewer
    // requests are queued than the last batch held: a lone client's request (last batch:
    // one request) goes at once, a crowd's batches wait for the crowd.
    auto until = queue_.front().arrival + delay;
    while (!stopping_ && queued_ngrams_ < max_batch_ &&
           (options_.fixed_delay || static_cast<long>(queue_.size()) < last_batch_requests_) &&
           Clock::now() < until) {
      cv_.wait_until(lock, until);
    }
    std::unique_ptr<Batch> batch(new Batch());
    std::vector<std::pair<std::shared_ptr<ScoreCall>, Ending> > gone;
    long left = 0;  // n-grams leaving the queue, taken or dropped
    bool keyed = false;
    BatchKey key;
    for (auto it = queue_.begin(); it != queue_.end();) {
      Ending why;
      if (it->call->Gone(&why)) {
        left += it->ngrams;
        gone.emplace_back(std::move(it->call), why);
        it = queue_.erase(it);
        continue;
      }
      if (!keyed) {
        key = it->key;
        keyed = true;
      }
      if (it->key == key && batch->ngrams + it->ngrams <= max_batch_) {
        batch->ngrams += it->ngrams;
        left += it->ngrams;
        batch->items.push_back(std::move(*it));
        it = queue_.erase(it);
        if (batch->ngrams == max_batch_) break;
      } else {
        ++it;
      }
    }
    queued_ngrams_ -= left;
    dropped_ += gone.size();
    if (batch->items.empty()) {  // every request looked at had gone
      lock.unlock();
      for (auto &g : gone) g.first->Drop(g.second);
      lock.lock();
      continue;
    }
    last_batch_requests_ = static_cast<long>(batch->items.size());
    ++inflight_;
    ++batches_;
    lock.unlock();
    for (auto &g : gone) g.first->Drop(g.second);
    Send(std::move(batch));
    lock.lock();
  }
}

void Batcher::Send(std::unique_ptr<Batch> batch) {
  const BatchKey &key = batch->items.front().key;
  ScoreNgramsRequest &req = batch->request;
  req.set_log_base(static_cast<nlmserve::v1::LogBase>(key.log_base));
  req.set_allow_unnormalized(key.allow_unnormalized);
  if (key.packed) {
    uint32_t width = 0;
    for (const auto &p : batch->items) width = std::max(width, p.call->request().packed_order());
    std::string *out = req.mutable_packed_ids();
    out->reserve(static_cast<std::size_t>(batch->ngrams) * width * 4);
    batch->parts.reserve(batch->items.size());
    std::vector<uint32_t> narrow, wide;
    for (const auto &p : batch->items) {
      const std::string &in = p.call->request().packed_ids();
      uint32_t k = p.call->request().packed_order();
      batch->parts.emplace_back(static_cast<uint32_t>(p.ngrams), k);
      if (k == width) {
        out->append(in);
        continue;
      }
      // Shorter rows are widened as the client library's owner of the canonical context
      // does it, the ids read and written as the wire's little-endian numbers.
      const std::size_t rows = in.size() / (4u * k);
      narrow.resize(rows * k);
      wide.resize(rows * width);
      for (std::size_t i = 0; i < narrow.size(); ++i) narrow[i] = GetU32(in.data() + 4 * i);
      nlmserve::WidenRows(narrow.data(), rows, k, width, bos_id_, wide.data());
      for (uint32_t id : wide) PutU32(id, out);
    }
    req.set_packed_order(width);
  } else {
    for (const auto &p : batch->items) {
      for (const auto &g : p.call->request().ngrams()) *req.add_ngrams() = g;
    }
  }
  if (key.packed) {  // to a sender thread of the local channel
    {
      std::lock_guard<std::mutex> lock(mu_);
      outbox_.push_back(std::move(batch));
    }
    outbox_cv_.notify_one();
    return;
  }
  batch->context.set_deadline(std::chrono::system_clock::now() +
                              std::chrono::milliseconds(options_.backend_timeout_ms));
  if (!key.authorization.empty()) batch->context.AddMetadata("authorization", key.authorization);
  Batch *raw = batch.release();
  stub_->async()->ScoreNgrams(&raw->context, &raw->request, &raw->response,
                              [this, raw](grpc::Status status) { Done(std::unique_ptr<Batch>(raw), status); });
}

void Batcher::SendLocal() {
  LocalChannel channel(options_.backend_socket, options_.backend_timeout_ms);
  for (;;) {
    std::unique_ptr<Batch> batch;
    {
      std::unique_lock<std::mutex> lock(mu_);
      outbox_cv_.wait(lock, [this]() { return !outbox_.empty() || senders_done_; });
      if (outbox_.empty()) return;
      batch = std::move(outbox_.front());
      outbox_.pop_front();
    }
    grpc::Status status = channel.Call(batch->request, batch->parts, batch->items.front().key.authorization, unk_id_,
                                       &batch->response, &batch->part_status);
    Done(std::move(batch), status);
  }
}

void Batcher::Done(std::unique_ptr<Batch> batch, const grpc::Status &status) {
  const ScoreNgramsResponse &res = batch->response;
  const bool per_part = batch->part_status.size() == batch->items.size();
  if (status.ok() && res.log_probs_size() == batch->ngrams && res.oov_size() == batch->ngrams) {
    int at = 0;
    for (std::size_t item = 0; item < batch->items.size(); ++item) {
      Pending &p = batch->items[item];
      if (per_part && !batch->part_status[item].ok()) {
        at += static_cast<int>(p.ngrams);
        p.call->Answer(batch->part_status[item]);
        continue;
      }
      ScoreNgramsResponse *out = p.call->response();
      out->mutable_log_probs()->Reserve(static_cast<int>(p.ngrams));
      out->mutable_oov()->Reserve(static_cast<int>(p.ngrams));
      for (long i = 0; i < p.ngrams; ++i, ++at) {
        out->add_log_probs(res.log_probs(at));
        out->add_oov(res.oov(at));
      }
      out->set_log_base(res.log_base());
      out->set_normalized(res.normalized());
      out->set_model_hash(res.model_hash());
      p.call->Answer(grpc::Status::OK);
    }
  } else if (status.error_code() == grpc::StatusCode::INVALID_ARGUMENT && batch->items.size() > 1 &&
             !batch->items.front().key.packed) {
    // Some request of a string batch is invalid: each one alone gets its own exact answer.
    for (auto &p : batch->items) SendAlone(p, true);
  } else {
    grpc::Status err = status.ok() ? End(kBackendBadAnswer, "the backend answered " +
                                                                std::to_string(res.log_probs_size()) + " scores for " +
                                                                std::to_string(batch->ngrams) + " n-grams")
                                   : status;
    for (auto &p : batch->items) p.call->Answer(err);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    --inflight_;
  }
  cv_.notify_one();
  done_cv_.notify_all();
}

}  // namespace nlmserve_frontend
