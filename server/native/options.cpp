// ParseArgs and Usage (options.h).
#include "options.h"

#include <cerrno>
#include <cstdlib>
#include <iostream>
#include <utility>

namespace nlmserve_frontend {

[[noreturn]] void Usage(const std::string &error) {
  std::cerr << "nlmserve_frontend: " << error << "\n"
            << "usage: nlmserve_frontend --backend HOST:PORT --backend-socket PATH [--listen HOST:PORT]\n"
            << "         [--max-batch-ngrams N] [--max-delay-us US] [--delay-policy adaptive|fixed] [--max-inflight N]\n"
            << "         [--max-queue-ngrams N] [--backend-timeout-ms MS] [--max-message-mb MB] [--grace-s S]\n"
            << "         [--connect-timeout-s S] [--token-file F] [--admin-token-file F]\n"
            << "       guards (defaults as `nlmserve serve`'s):\n"
            << "         [--first-message-ms 60000] [--keepalive-ms 60000] [--keepalive-timeout-ms 20000]\n"
            << "         [--max-connection-idle-ms 300000 (0: never)] [--max-connection-age-ms 0 (0: never)]\n"
            << "         [--max-connection-age-grace-ms 60000] [--handshake-timeout-ms 10000]\n"
            << "         [--max-concurrent-rpcs 256] [--max-rpcs-per-connection 128] [--max-rpcs-per-client 128]\n"
            << "         [--max-health-watches 1024] [--max-health-watches-per-connection 8]\n"
            << "         [--stream-write-timeout-ms 30000] [--max-connections 4096] [--max-metadata-kb 16]\n"
            << "         [--max-concurrent-streams N (HTTP/2 streams per connection; default gRPC's)]\n"
            << "         [--max-memory-mb MB (default: 16 x --max-message-mb, at least 1024)]\n";
  std::exit(2);
}

namespace {

long ParsePositive(const std::string &flag, const char *text, long minimum) {
  char *end = nullptr;
  errno = 0;
  long v = std::strtol(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || v < minimum) {
    Usage(flag + " needs an integer >= " + std::to_string(minimum) + ", got '" + text + "'");
  }
  return v;
}

}  // namespace

Options ParseArgs(int argc, char **argv) {
  Options o;
  // Flags whose value is an integer, and the least each takes.
  const std::pair<const char *, std::pair<long Options::*, long> > kNumbers[] = {
      {"--max-batch-ngrams", {&Options::max_batch_ngrams, 1}},
      {"--max-delay-us", {&Options::max_delay_us, 0}},
      {"--max-inflight", {&Options::max_inflight, 1}},
      {"--max-queue-ngrams", {&Options::max_queue_ngrams, 1}},
      {"--backend-timeout-ms", {&Options::backend_timeout_ms, 1}},
      {"--max-message-mb", {&Options::max_message_mb, 1}},
      {"--grace-s", {&Options::grace_s, 0}},
      {"--connect-timeout-s", {&Options::connect_timeout_s, 1}},
      {"--first-message-ms", {&Options::first_message_ms, 1}},
      {"--keepalive-ms", {&Options::keepalive_ms, 1000}},
      {"--keepalive-timeout-ms", {&Options::keepalive_timeout_ms, 1}},
      {"--max-connection-idle-ms", {&Options::max_connection_idle_ms, 0}},
      {"--max-connection-age-ms", {&Options::max_connection_age_ms, 0}},
      {"--max-connection-age-grace-ms", {&Options::max_connection_age_grace_ms, 0}},
      {"--handshake-timeout-ms", {&Options::handshake_timeout_ms, 1}},
      {"--max-concurrent-rpcs", {&Options::max_concurrent_rpcs, 1}},
      {"--max-rpcs-per-connection", {&Options::max_rpcs_per_connection, 1}},
      {"--max-rpcs-per-client", {&Options::max_rpcs_per_client, 1}},
      {"--max-health-watches", {&Options::max_health_watches, 0}},
      {"--max-health-watches-per-connection", {&Options::max_health_watches_per_connection, 0}},
      {"--stream-write-timeout-ms", {&Options::stream_write_timeout_ms, 1}},
      {"--max-connections", {&Options::max_connections, 1}},
      {"--max-metadata-kb", {&Options::max_metadata_kb, 1}},
      {"--max-concurrent-streams", {&Options::max_concurrent_streams, 0}},
      {"--max-memory-mb", {&Options::max_memory_mb, 1}},
  };
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (flag == "-h" || flag == "--help") Usage("a micro-batching front end for `nlmserve serve`");
    if (i + 1 >= argc) Usage(flag + " needs a value");
    const char *v = argv[++i];
    bool number = false;
    for (const auto &n : kNumbers) {
      if (flag == n.first) {
        o.*(n.second.first) = ParsePositive(flag, v, n.second.second);
        number = true;
      }
    }
    if (number) continue;
    if (flag == "--listen") o.listen = v;
    else if (flag == "--backend") o.backend = v;
    else if (flag == "--delay-policy") {
      std::string policy = v;
      if (policy != "adaptive" && policy != "fixed") Usage("--delay-policy is adaptive or fixed, got '" + policy + "'");
      o.fixed_delay = policy == "fixed";
    }
    else if (flag == "--token-file") o.token_file = v;
    else if (flag == "--admin-token-file") o.admin_token_file = v;
    else if (flag == "--backend-socket") o.backend_socket = v;
    else Usage("unknown flag " + flag);
  }
  if (o.backend.empty()) Usage("--backend HOST:PORT is required");
  if (o.backend_socket.empty()) Usage("--backend-socket PATH is required");
  if (o.max_queue_ngrams < o.max_batch_ngrams) Usage("--max-queue-ngrams must be >= --max-batch-ngrams");
  return o;
}

}  // namespace nlmserve_frontend
