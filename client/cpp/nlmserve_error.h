// nlmserve client errors: ClientError, what every failure to get a score is thrown as.
//
// The contract: a ClientError carries the gRPC status code of the failure (the numeric value
// of grpc::StatusCode: 3 for an invalid request, 9 for a model that changed or differs
// between replicas, the transport's code otherwise) or -1 for a client-side error (a file
// that cannot be read, an address that is not one), and a message of one line that names
// the server, the file or the n-gram at fault. The client never exits the process.
// No gRPC or protobuf here.
#ifndef NLMSERVE_ERROR_H
#define NLMSERVE_ERROR_H

#include <stdexcept>
#include <string>

namespace nlmserve {

// Any failure to get a score: unreachable or restarting server, deadline, invalid
// request, or a model that changed under the client. Never a process exit.
class ClientError : public std::runtime_error {
 public:
  // code: the gRPC status code (numeric value of grpc::StatusCode), or -1 for a
  // client-side error.
  ClientError(int code, const std::string &message)
      : std::runtime_error(message), code_(code) {}
  int code() const { return code_; }

 private:
  int code_;
};

}  // namespace nlmserve

#endif  // NLMSERVE_ERROR_H
