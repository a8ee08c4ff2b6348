// The native front end's log: one line per message on stderr, "nlmserve_frontend: " first,
// written whole (no other thread's line inside it); gRPC's own lines pass through the same
// function, at most kGrpcLogLines every kGrpcLogSeconds, so that no client can flood the
// log through gRPC. Clock: the steady clock every guard measures time with.
#ifndef NLMSERVE_FRONTEND_LOG_H
#define NLMSERVE_FRONTEND_LOG_H

#include <chrono>
#include <cstdint>
#include <iostream>
#include <mutex>
#include <sstream>
#include <string>

#include <grpc/support/log.h>

namespace nlmserve_frontend {

using Clock = std::chrono::steady_clock;

inline void Log(const std::string &message) {
  std::ostringstream line;
  line << "nlmserve_frontend: " << message << "\n";
  std::cerr << line.str() << std::flush;
}

// gRPC's own log lines (an error per refused compressed call, for one) at most
// kGrpcLogLines every kGrpcLogSeconds, then one line saying how many were left out, so
// that no client can flood the log through gRPC.
constexpr int kGrpcLogLines = 20;
constexpr double kGrpcLogSeconds = 10.0;

inline void GrpcLogLine(gpr_log_func_args *args) {
  static std::mutex mu;
  static Clock::time_point window;
  static int lines = 0;
  static uint64_t left_out = 0;
  std::string out;
  {
    std::lock_guard<std::mutex> lock(mu);
    const auto now = Clock::now();
    if (now - window >= std::chrono::duration<double>(kGrpcLogSeconds)) {
      if (left_out > 0) out = "grpc: " + std::to_string(left_out) + " more line(s) left out\n";
      window = now;
      lines = 0;
      left_out = 0;
    }
    if (lines >= kGrpcLogLines) {
      ++left_out;
      if (out.empty()) return;
    } else {
      ++lines;
      out += std::string("grpc: ") + gpr_log_severity_string(args->severity) + " " + args->message + " (" +
             args->file + ":" + std::to_string(args->line) + ")";
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  Log(out);
}

inline void LimitGrpcLog() { gpr_set_log_function(GrpcLogLine); }

}  // namespace nlmserve_frontend

#endif  // NLMSERVE_FRONTEND_LOG_H
