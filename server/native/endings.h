// How a call the front end ends itself ends: each way (Ending) and its gRPC status code
// (kEndingCodes, the "frontend:" rows of proto/contract/status_codes.tsv, checked by
// `nlmserve_frontend --check-status-codes`), and End(), which counts each ending for the
// stats line at exit. Every other status a client sees is the backend's own.
#ifndef NLMSERVE_FRONTEND_ENDINGS_H
#define NLMSERVE_FRONTEND_ENDINGS_H

#include <atomic>
#include <cstdint>
#include <sstream>
#include <string>

#include <grpcpp/grpcpp.h>

namespace nlmserve_frontend {

// The ways a call ends in the front end itself, and their codes: the rows "frontend:" of
// proto/contract/status_codes.tsv, which `nlmserve_frontend --check-status-codes FILE`
// checks this table against (tests/test_native_frontend.py runs it). Every other status a
// client sees is the backend's own.
enum Ending {
  kBackendUnreachable,
  kBackendTimeout,
  kBackendBadAnswer,
  kQueueFull,
  kStopping,
  kUnauthenticated,      // no or an unknown bearer token (before the message is read)
  kMalformed,            // a request message that does not parse
  kNoMessage,            // the call ended without a request message
  kFirstMessageTimeout,  // no request message within --first-message-ms of the headers
  kSlotsFull,            // a concurrency limit (Slots)
  kExpired,              // the call's deadline passed before its request was sent on
  kCancelled,            // the client cancelled or went away before its request was sent on
  kStreamWriteTimeout,   // the client did not read an answer within --stream-write-timeout-ms
  kUnknownMethod,        // a method the front end does not serve
  kUnknownHealthService, // health Check of a service the front end does not report
  kMetadataTooLarge,     // a header list larger than --max-metadata-kb
  kWatchesFull,          // a health Watch beyond its pool (gRFC A17: then counted healthy)
  kEndings
};
struct EndingCode {
  const char *condition;
  grpc::StatusCode code;
};
const EndingCode kEndingCodes[kEndings] = {
    {"backend_unreachable", grpc::StatusCode::UNAVAILABLE},
    {"backend_timeout", grpc::StatusCode::DEADLINE_EXCEEDED},
    {"backend_bad_answer", grpc::StatusCode::INTERNAL},
    {"queue_full", grpc::StatusCode::RESOURCE_EXHAUSTED},
    {"stopping", grpc::StatusCode::UNAVAILABLE},
    {"unauthenticated", grpc::StatusCode::UNAUTHENTICATED},
    {"malformed", grpc::StatusCode::INVALID_ARGUMENT},
    {"no_message", grpc::StatusCode::INVALID_ARGUMENT},
    {"first_message_timeout", grpc::StatusCode::DEADLINE_EXCEEDED},
    {"slots_full", grpc::StatusCode::RESOURCE_EXHAUSTED},
    {"expired", grpc::StatusCode::DEADLINE_EXCEEDED},
    {"cancelled", grpc::StatusCode::CANCELLED},
    {"stream_write_timeout", grpc::StatusCode::DEADLINE_EXCEEDED},
    {"unknown_method", grpc::StatusCode::UNIMPLEMENTED},
    {"unknown_health_service", grpc::StatusCode::NOT_FOUND},
    {"metadata_too_large", grpc::StatusCode::RESOURCE_EXHAUSTED},
    {"watches_full", grpc::StatusCode::UNIMPLEMENTED},
};

// How many calls ended each way; thread-safe.
class EndingCounts {
 public:
  EndingCounts() {
    for (auto &n : counts_) n.store(0);
  }
  void Add(Ending ending) { counts_[ending].fetch_add(1, std::memory_order_relaxed); }
  uint64_t Get(Ending ending) const { return counts_[ending].load(std::memory_order_relaxed); }

  // "N condition, ..." for the conditions that happened (empty when none).
  std::string Summary() const {
    std::ostringstream s;
    for (int e = 0; e < kEndings; ++e) {
      uint64_t n = counts_[e].load(std::memory_order_relaxed);
      if (n == 0) continue;
      if (s.tellp() > 0) s << ", ";
      s << n << " " << kEndingCodes[e].condition;
    }
    return s.str();
  }

 private:
  std::atomic<uint64_t> counts_[kEndings];
};

// The process's one tally of endings (the stats line at exit reads it).
inline EndingCounts &Endings() {
  static EndingCounts counts;
  return counts;
}

// The status of `ending` with `message`, counted.
inline grpc::Status End(Ending ending, const std::string &message) {
  Endings().Add(ending);
  return grpc::Status(kEndingCodes[ending].code, message);
}

}  // namespace nlmserve_frontend

#endif  // NLMSERVE_FRONTEND_ENDINGS_H
