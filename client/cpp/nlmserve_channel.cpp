// The client's channels (nlmserve_channel.h).
#include "nlmserve_channel.h"

#include <fstream>
#include <sstream>

namespace nlmserve {
namespace {

namespace pb = ::nlmserve::v1;

// Health service name each replica is checked for, and the longest pause between
// reconnection attempts to a replica (gRPC's default grows to 120 s).
const char kHealthService[] = "nlmserve.v1.LanguageModel";
const int kMaxReconnectBackoffMs = 5000;

}  // namespace

std::string Describe(const std::string &what, const std::string &target, const grpc::Status &s) {
  std::ostringstream out;
  out << "nlmserve " << what << " at " << target << " failed: status " << s.error_code() << " ("
      << s.error_message() << ")";
  return out.str();
}

std::shared_ptr<Connection> MakeConnection(const Endpoint &endpoint,
                                           const std::shared_ptr<grpc::ChannelCredentials> &creds,
                                           const std::string &tls_name, uint64_t generation) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  // A fresh channel must make a fresh connection, not reuse a dead shared subchannel.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  // Reconnect quickly to a server that restarts.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, endpoint.replicated ? kMaxReconnectBackoffMs : 1000);
  if (endpoint.replicated) {
    // round_robin over every replica; each subchannel watches its replica's
    // grpc.health.v1 status and is picked only while SERVING.
    args.SetServiceConfigJSON(std::string("{\"loadBalancingConfig\": [{\"round_robin\": {}}], "
                                          "\"healthCheckConfig\": {\"serviceName\": \"") +
                              kHealthService + "\"}}");
    args.SetInt(GRPC_ARG_SERVICE_CONFIG_DISABLE_RESOLUTION, 1);
  }
  if (!tls_name.empty()) args.SetSslTargetNameOverride(tls_name);
  // Distinguishes channels so that gRPC does not share them.
  args.SetInt("nlmserve.generation", static_cast<int>(generation & 0x7fffffff));
  std::shared_ptr<Connection> c = std::make_shared<Connection>();
  c->channel = grpc::CreateCustomChannel(endpoint.target, creds, args);
  c->stub = pb::LanguageModel::NewStub(c->channel);
  c->generation = generation;
  return c;
}

std::string ReadFile(const std::string &path, const std::string &what) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  if (!in || !(out << in.rdbuf())) {
    throw ClientError(-1, "cannot read the " + what + " file " + path);
  }
  return out.str();
}

std::shared_ptr<grpc::ChannelCredentials> Credentials(const ClientOptions &o) {
  if (o.tls_ca.empty() && o.tls_cert.empty() && o.tls_key.empty() && o.tls_server_name.empty()) {
    return grpc::InsecureChannelCredentials();
  }
  if (o.tls_cert.empty() != o.tls_key.empty()) {
    throw ClientError(-1, "TLS client certificate and key go together (tls-cert and tls-key)");
  }
  grpc::SslCredentialsOptions ssl;
  if (!o.tls_ca.empty()) ssl.pem_root_certs = ReadFile(o.tls_ca, "TLS CA");
  if (!o.tls_cert.empty()) {
    ssl.pem_cert_chain = ReadFile(o.tls_cert, "TLS certificate");
    ssl.pem_private_key = ReadFile(o.tls_key, "TLS key");
  }
  return grpc::SslCredentials(ssl);
}

}  // namespace nlmserve
