// Retries (nlmserve_retry.h).
#include "nlmserve_retry.h"

#include <grpcpp/grpcpp.h>

namespace nlmserve {

bool Retryable(int code, const std::string &message) {
  switch (static_cast<grpc::StatusCode>(code)) {
    case grpc::StatusCode::UNAVAILABLE:  // not an address that answers with something else than HTTP/2
      return message.find("Failed parsing HTTP/2") == std::string::npos;
    case grpc::StatusCode::CANCELLED:
      return true;
    case grpc::StatusCode::RESOURCE_EXHAUSTED:  // overload, not a message over the size limit
      return message.find("larger than max") == std::string::npos;
    default:
      return false;
  }
}

}  // namespace nlmserve
