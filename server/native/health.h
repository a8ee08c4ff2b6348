// The front end's health service state: grpc.health.v1's two messages by hand (the proto
// is not part of the installed library), and what the service reports (HealthState): ""
// and the LanguageModel service (kServiceName), SERVING while the backend answers, each
// Watch stream told of each change, and NOT_SERVING to every stream at shutdown.
#ifndef NLMSERVE_FRONTEND_HEALTH_H
#define NLMSERVE_FRONTEND_HEALTH_H

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/wire_format_lite.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/support/proto_buffer_reader.h>

namespace nlmserve_frontend {

// The service whose health the front end reports, and asks the backend about.
const char kServiceName[] = "nlmserve.v1.LanguageModel";

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

}  // namespace nlmserve_frontend

#endif  // NLMSERVE_FRONTEND_HEALTH_H
