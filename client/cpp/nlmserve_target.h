// nlmserve server targets: the gRPC channel target a client connects to, from the address text
// a user writes (a decoder's path=, the client's --server).
//
// The contract (the golden file proto/contract/server_targets.tsv; the Python owner is
// nlmserve.client.replicas.endpoint_of): HOST:PORT is one server; a comma-separated list of
// HOST:PORT is replicas, their host names resolved once, here, into one ipv4: or ipv6: target
// that gRPC balances round_robin over (a list that mixes the two families is refused); a
// resolver target (dns:///NAME:PORT, ipv4:..., ipv6:...) passes unchanged, dns: balanced. A host
// holds no ':', '[', ']', '/' or white space, a [V6] host only hex digits, ':', '.' and '%', a
// port is 1 to 5 digits in 1 .. 65535. Errors are ClientError (code -1) naming the address.
// No gRPC here.
#ifndef NLMSERVE_TARGET_H
#define NLMSERVE_TARGET_H

#include <string>
#include <vector>

#include "nlmserve_error.h"

namespace nlmserve {

// Where a Client's channel connects (see ParseTarget).
struct Endpoint {
  std::string target;              // the gRPC target given to the channel
  std::vector<std::string> replicas;  // the addresses as given (empty for dns:///)
  bool replicated = false;         // round_robin over health-checked replicas
  std::string host_name;           // the one host all static replicas share ("" if they differ)
};

// The channel target for `HOST:PORT`, a comma-separated list of replica addresses
// (`a:1,b:2`, host names resolved once, here: `ipv4:A:1,B:2` or `ipv6:[A]:1,[B]:2`),
// or a resolver target (`dns:///name:port`, `ipv4:...`, `ipv6:...`) passed unchanged.
// Throws ClientError (code -1) for an address that is not HOST:PORT or does not resolve.
Endpoint ParseTarget(const std::string &target);

}  // namespace nlmserve

#endif  // NLMSERVE_TARGET_H
