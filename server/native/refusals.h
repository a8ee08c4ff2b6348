// Refusals by a guard: why a call or a connection was refused (Reason, named as the Python
// server's nlmserve_refused_total{reason}), counted by reason for the stats line, and
// logged at most once per reason every kRefusalLogSeconds with the count since the last,
// client-chosen text made printable.
#ifndef NLMSERVE_FRONTEND_REFUSALS_H
#define NLMSERVE_FRONTEND_REFUSALS_H

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <sstream>
#include <string>

#include "log.h"

namespace nlmserve_frontend {

// Why a call or a connection was refused by a guard: the names of the Python server's
// refusal reasons (nlmserve_refused_total{reason}), so that both front ends' logs read alike.
enum Reason {
  kReasonUnauthenticated,
  kReasonMaxConcurrentRpcs,
  kReasonMaxRpcsPerConnection,
  kReasonMaxRpcsPerClient,
  kReasonMaxHealthWatches,
  kReasonMaxHealthWatchesPerConnection,
  kReasonFirstMessageTimeout,
  kReasonStreamWriteTimeout,
  kReasonMaxConnections,
  kReasonMaxMemory,
  kReasonAwaitingMessage,
  kReasonPrematureResets,
  kReasons
};
const char *const kReasonNames[kReasons] = {
    "unauthenticated",   "max_concurrent_rpcs",       "max_rpcs_per_connection",
    "max_rpcs_per_client", "max_health_watches",      "max_health_watches_per_connection",
    "first_message_timeout", "stream_write_timeout", "max_connections", "max_memory", "calls_awaiting_message",
    "premature_resets",
};

// Seconds between two log lines about refusals of one reason.
constexpr double kRefusalLogSeconds = 10.0;

// Refusals counted by reason and logged without letting a flood of them flood the log:
// one line per reason every kRefusalLogSeconds at most, with the count since the last.
class Refusals {
 public:
  void Note(Reason reason, const std::string &what, const std::string &peer) {
    std::string line;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++total_[reason];
      ++unlogged_[reason];
      const auto now = Clock::now();
      if (!logged_once_[reason] || now - logged_at_[reason] >= std::chrono::duration<double>(kRefusalLogSeconds)) {
        std::ostringstream s;
        const bool connections =
            reason == kReasonMaxConnections || reason == kReasonMaxMemory || reason == kReasonPrematureResets;
        s << "refused " << unlogged_[reason] << (connections ? " connection(s) by " : " call(s) by ") << kReasonNames[reason]
          << " since the last such line; the latest: " << Printable(what) << " from " << Printable(peer);
        line = s.str();
        unlogged_[reason] = 0;
        logged_at_[reason] = now;
        logged_once_[reason] = true;
      }
    }
    if (!line.empty()) Log(line);
  }

  // "N reason, ..." for the reasons that happened (empty when none).
  std::string Summary() const {
    std::lock_guard<std::mutex> lock(mu_);
    std::ostringstream s;
    for (int r = 0; r < kReasons; ++r) {
      if (total_[r] == 0) continue;
      if (s.tellp() > 0) s << ", ";
      s << total_[r] << " " << kReasonNames[r];
    }
    return s.str();
  }

  // A client-chosen string as a log may show it: at most 200 bytes, control and non-ASCII
  // bytes as \xHH, so that no caller can forge or break a log line.
  static std::string Printable(const std::string &text) {
    static const char kHex[] = "0123456789abcdef";
    std::string out;
    for (std::size_t i = 0; i < text.size() && i < 200; ++i) {
      unsigned char c = static_cast<unsigned char>(text[i]);
      if (c >= 0x20 && c < 0x7f && c != '\\') {
        out += static_cast<char>(c);
      } else {
        out += "\\x";
        out += kHex[c >> 4];
        out += kHex[c & 15];
      }
    }
    if (text.size() > 200) out += "...";
    return out;
  }

 private:
  mutable std::mutex mu_;
  uint64_t total_[kReasons] = {};
  uint64_t unlogged_[kReasons] = {};
  bool logged_once_[kReasons] = {};
  Clock::time_point logged_at_[kReasons];
};

}  // namespace nlmserve_frontend

#endif  // NLMSERVE_FRONTEND_REFUSALS_H
