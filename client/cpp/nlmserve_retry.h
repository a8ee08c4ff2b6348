// nlmserve retries: which failed calls a client tries again.
//
// The contract (the golden file proto/contract/retry_codes.tsv; the Python owner is
// nlmserve.wire.status.retryable): Retryable below. Every call is idempotent (scores are
// read, never written); the client retries within ClientOptions::retries, on a fresh channel
// (one server) or on the same balanced one (replicas). No gRPC here: codes are numbers.
#ifndef NLMSERVE_RETRY_H
#define NLMSERVE_RETRY_H

#include <string>

namespace nlmserve {

// Whether a call that failed with the gRPC status `code` and `message` is tried again
// (proto/contract/retry_codes.tsv; the Python owner is nlmserve.wire.status.retryable):
// UNAVAILABLE (but not from an address that answered with something other than HTTP/2),
// CANCELLED (a stopping server's), and RESOURCE_EXHAUSTED from overload but not a message
// over the size limit. Never DEADLINE_EXCEEDED: the deadline is the caller's budget for
// the call.
bool Retryable(int code, const std::string &message);

}  // namespace nlmserve

#endif  // NLMSERVE_RETRY_H
