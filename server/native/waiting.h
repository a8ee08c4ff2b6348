// Calls waiting for their request message (Waiting), the Python server's call gate's rule
// (server/gate.py, Waiting): a client sends the message with the call's headers, so only
// a call held open without one waits long. At most so many wait per connection, per client
// and in all; a call beyond one of these cuts the one of that connection, client or front
// end that has waited longest, so that calls held open, by others or by the caller itself,
// never keep out a call whose message is on its way (a health probe's Check, an authorised
// request), and what they hold stays bounded.
#ifndef NLMSERVE_FRONTEND_WAITING_H
#define NLMSERVE_FRONTEND_WAITING_H

#include <algorithm>
#include <functional>
#include <iterator>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace nlmserve_frontend {

class Waiting {
 public:
  struct Entry;
  using Ticket = std::shared_ptr<Entry>;
  using Queue = std::list<Ticket>;  // in the order they came: the first has waited longest
  // One waiting call: where it counts, how to cut it, and why it was cut.
  struct Entry {
    std::string connection, client;
    std::function<void()> cut;
    std::string why;
    Queue::iterator in_all, in_connection, in_client;
    bool listed = false;
  };

  // `what` names the calls in messages; per_client 0: no per-client limit; `flags`: the
  // flags of the limit in all, per connection and per client.
  Waiting(const char *what, long limit, long per_connection, long per_client, const char *const flags[3])
      : what_(what),
        limit_(std::max(1L, limit)),
        per_connection_(std::max(1L, std::min(per_connection, limit_))),
        per_client_(per_client > 0 ? std::max(1L, std::min(per_client, limit_)) : 0),
        flags_{flags[0], flags[1], flags[2]} {}

  // Counts a call as waiting (`cut` ends it; it is called without any lock of this class
  // held, and the entry's `why` says why). A call beyond a limit cuts the one of that
  // connection, client or front end that has waited longest.
  Ticket Enter(const std::string &connection, const std::string &client, std::function<void()> cut) {
    std::vector<std::function<void()>> victims;
    Ticket ticket = std::make_shared<Entry>();
    {
      std::lock_guard<std::mutex> lock(mu_);
      CutOldest(Find(&by_connection_, connection), per_connection_, "on this connection", 1, &victims);
      if (per_client_ > 0) CutOldest(Find(&by_client_, client), per_client_, "of this client", 2, &victims);
      CutOldest(&all_, limit_, "in all", 0, &victims);
      ticket->connection = connection;
      ticket->client = client;
      ticket->cut = std::move(cut);
      ticket->in_all = all_.insert(all_.end(), ticket);
      Queue &of_connection = by_connection_[connection];
      ticket->in_connection = of_connection.insert(of_connection.end(), ticket);
      Queue &of_client = by_client_[client];
      ticket->in_client = of_client.insert(of_client.end(), ticket);
      ticket->listed = true;
    }
    for (auto &victim : victims) victim();
    return ticket;
  }

  // The call no longer waits (its message came, it was cut or it ended); once.
  void Leave(const Ticket &ticket) {
    std::lock_guard<std::mutex> lock(mu_);
    LeaveLocked(ticket);
  }

  // Why the call of `ticket` was cut ("" when it was not).
  std::string Why(const Ticket &ticket) const {
    std::lock_guard<std::mutex> lock(mu_);
    return ticket->why;
  }

  long waiting() const {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<long>(all_.size());
  }

 private:
  static Queue *Find(std::unordered_map<std::string, Queue> *queues, const std::string &key) {
    auto it = queues->find(key);
    return it == queues->end() ? nullptr : &it->second;
  }
  // Under mu_: when `queue` holds `limit` calls, the first is cut (`where`, `flag`: for
  // its message).
  void CutOldest(Queue *queue, long limit, const char *where, int flag, std::vector<std::function<void()>> *victims) {
    if (queue == nullptr || static_cast<long>(queue->size()) < limit) return;
    Ticket oldest = queue->front();
    LeaveLocked(oldest);
    oldest->why = "cut for a newer call: " + std::to_string(limit) + " " + what_ + " " + where +
                  " were waiting for their request message (" + flags_[flag] + " " + std::to_string(limit) +
                  "); a client sends it with the call's headers; retry later";
    victims->push_back(std::move(oldest->cut));
  }
  void LeaveLocked(const Ticket &ticket) {
    if (!ticket->listed) return;
    ticket->listed = false;
    all_.erase(ticket->in_all);
    Erase(&by_connection_, ticket->connection, ticket->in_connection);
    Erase(&by_client_, ticket->client, ticket->in_client);
  }
  static void Erase(std::unordered_map<std::string, Queue> *queues, const std::string &key, Queue::iterator at) {
    auto it = queues->find(key);
    if (it == queues->end()) return;
    it->second.erase(at);
    if (it->second.empty()) queues->erase(it);
  }

  const std::string what_;
  const long limit_, per_connection_, per_client_;
  const std::string flags_[3];
  mutable std::mutex mu_;
  Queue all_;
  std::unordered_map<std::string, Queue> by_connection_, by_client_;
};

}  // namespace nlmserve_frontend

#endif  // NLMSERVE_FRONTEND_WAITING_H
