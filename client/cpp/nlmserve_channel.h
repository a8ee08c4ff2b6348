// The client's channels (internal to the client library, not installed): one gRPC channel and
// its stub, made with the options of a Client (TLS, replicas balanced round_robin over
// health-checked subchannels, quick reconnection), and the helpers of its calls.
// nlmserve_client.cpp holds the client that uses them.
#ifndef NLMSERVE_CHANNEL_H
#define NLMSERVE_CHANNEL_H

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "nlmserve/v1/lm.grpc.pb.h"
#include "nlmserve_client.h"

namespace nlmserve {

typedef std::chrono::system_clock Clock;

// Now plus `ms` milliseconds: a call's deadline.
inline Clock::time_point DeadlineIn(int ms) { return Clock::now() + std::chrono::milliseconds(ms); }

// "nlmserve WHAT at TARGET failed: status CODE (MESSAGE)": the message of a call that failed.
std::string Describe(const std::string &what, const std::string &target, const grpc::Status &s);

// One channel and its stub; replaced as a whole when a call fails.
struct Connection {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr< ::nlmserve::v1::LanguageModel::Stub> stub;
  uint64_t generation = 0;
};

// A fresh channel to `endpoint` (never sharing a subchannel with an earlier one; replicas
// balanced round_robin over those whose health is SERVING), checking the servers'
// certificates against `tls_name` when it is not empty. `generation` tells channels apart.
std::shared_ptr<Connection> MakeConnection(const Endpoint &endpoint,
                                           const std::shared_ptr<grpc::ChannelCredentials> &creds,
                                           const std::string &tls_name, uint64_t generation);

// The whole file `path`; ClientError (code -1) naming it as "the WHAT file" when it cannot be
// read (the TLS files, the token file).
std::string ReadFile(const std::string &path, const std::string &what);

// The channel credentials of the options: insecure when no TLS field is set, else TLS with
// the CA, and the client's certificate and key (both or neither), read from their files.
std::shared_ptr<grpc::ChannelCredentials> Credentials(const ClientOptions &o);

}  // namespace nlmserve

#endif  // NLMSERVE_CHANNEL_H
