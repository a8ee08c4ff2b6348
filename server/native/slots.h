// The front end's slot guards: concurrency limits on the calls held, in all, per
// connection and per client (ClientOf), each refusal with its reason and flag; the Python
// server's call gate (server/gate.py, Pool) with the same flags.
#ifndef NLMSERVE_FRONTEND_SLOTS_H
#define NLMSERVE_FRONTEND_SLOTS_H

#include <algorithm>
#include <mutex>
#include <string>
#include <unordered_map>

#include "refusals.h"

namespace nlmserve_frontend {

// The client a call counts against for a per-client share: its token when the token file
// holds several (TokenSet::Refusal sets it), else its address without the port
// ("ipv4:127.0.0.1:5000" -> "ipv4:127.0.0.1"), as the Python server's call gate does.
inline std::string ClientOf(const std::string &peer, const std::string &token_client) {
  if (!token_client.empty()) return token_client;
  const std::size_t colon = peer.rfind(':');
  const std::size_t bracket = peer.rfind(']');
  if (colon == std::string::npos || (bracket != std::string::npos && colon < bracket)) return peer;
  return peer.substr(0, colon);
}

// One kind of slot: what it holds (for messages), its limits in all, per connection (a
// peer address and port) and per client (ClientOf), and the reason and flag of each.
struct SlotKind {
  const char *what;
  long limit, per_connection, per_client;
  Reason reasons[3];
  const char *flags[3];
};

// Slots of one kind: at most `limit` held in all, `per_connection` by one connection,
// `per_client` by one client (each at most `limit`). A slot is given back in two parts, as
// the Python server's call gate does (server/gate.py, Pool): the front end's and its
// connection's (LeaveServer), and its client's (LeaveClient), which a call cut for not
// reading its answer keeps until gRPC has let it go (Call).
class Slots {
 public:
  explicit Slots(const SlotKind &kind)
      : kind_(kind),
        per_connection_(std::min(kind.per_connection, kind.limit)),
        per_client_(std::min(kind.per_client, kind.limit)) {}

  // Takes a slot for `connection` and `client`: true, or false with the refusal's reason
  // and RESOURCE_EXHAUSTED message.
  bool Take(const std::string &connection, const std::string &client, Reason *reason, std::string *message) {
    std::lock_guard<std::mutex> lock(mu_);
    int which = -1;
    long value = 0;
    if (active_ >= kind_.limit) {
      which = 0;
      value = kind_.limit;
    } else if (Held(by_connection_, connection) >= per_connection_) {
      which = 1;
      value = per_connection_;
    } else if (Held(by_client_, client) >= per_client_) {
      which = 2;
      value = per_client_;
    }
    if (which >= 0) {
      static const char *const kWho[] = {"the front end holds", "this connection holds", "this client holds"};
      *reason = kind_.reasons[which];
      *message = std::string(kWho[which]) + " its most " + kind_.what + " (" + kind_.flags[which] + " " +
                 std::to_string(value) + "); retry later";
      return false;
    }
    ++active_;
    ++by_connection_[connection];
    ++by_client_[client];
    return true;
  }

  // The call no longer holds a slot of the front end or of its connection.
  void LeaveServer(const std::string &connection) {
    std::lock_guard<std::mutex> lock(mu_);
    --active_;
    Release(&by_connection_, connection);
  }

  // The call no longer counts against its client's share.
  void LeaveClient(const std::string &client) {
    std::lock_guard<std::mutex> lock(mu_);
    Release(&by_client_, client);
  }

  long active() const {
    std::lock_guard<std::mutex> lock(mu_);
    return active_;
  }

 private:
  static long Held(const std::unordered_map<std::string, long> &held, const std::string &key) {
    auto it = held.find(key);
    return it == held.end() ? 0 : it->second;
  }
  static void Release(std::unordered_map<std::string, long> *held, const std::string &key) {
    auto it = held->find(key);
    if (it != held->end() && --it->second <= 0) held->erase(it);
  }

  const SlotKind kind_;
  const long per_connection_, per_client_;
  mutable std::mutex mu_;
  long active_ = 0;
  std::unordered_map<std::string, long> by_connection_, by_client_;
};

}  // namespace nlmserve_frontend

#endif  // NLMSERVE_FRONTEND_SLOTS_H
