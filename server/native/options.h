// The front end's options: its command line (Options, ParseArgs), the flags of `nlmserve
// serve` of the same names with the same defaults, which it passes. A flag it does not
// know, a value out of range or a missing required flag is one line on stderr with the
// usage, and exit status 2 (Usage).
#ifndef NLMSERVE_FRONTEND_OPTIONS_H
#define NLMSERVE_FRONTEND_OPTIONS_H

#include <string>

namespace nlmserve_frontend {

// The front end's settings, one a flag (Usage lists them).
struct Options {
  std::string listen = "127.0.0.1:0";
  std::string backend;
  long max_batch_ngrams = 4096;
  long max_delay_us = 500;
  long max_inflight = 1;
  // adaptive: wait for company only while fewer requests are queued than the last batch
  // held (a lone client never waits); fixed: always wait up to --max-delay-us.
  bool fixed_delay = false;
  long max_queue_ngrams = 1000000;
  long backend_timeout_ms = 30000;
  long max_message_mb = 64;
  long grace_s = 30;
  long connect_timeout_s = 30;
  // Bearer tokens: every one is accepted from callers; the first is sent on the front
  // end's own calls to the backend (the model info at start).
  std::string token_file;
  // Admin tokens (with --token-file): accepted from callers too; the backend says which
  // token may reload.
  std::string admin_token_file;
  // The model server's private Unix socket for merged packed batches.
  std::string backend_socket;
  // Guards (the flags of `nlmserve serve` of the same names, in milliseconds).
  long first_message_ms = 60000;
  long keepalive_ms = 60000;
  long keepalive_timeout_ms = 20000;
  long max_connection_idle_ms = 300000;  // 0: never
  long max_connection_age_ms = 0;        // 0: never
  long max_connection_age_grace_ms = 60000;
  long handshake_timeout_ms = 10000;
  long max_concurrent_rpcs = 256;
  long max_rpcs_per_connection = 128;
  long max_rpcs_per_client = 128;
  long max_health_watches = 1024;
  long max_health_watches_per_connection = 8;
  long stream_write_timeout_ms = 30000;
  long max_connections = 4096;
  long max_metadata_kb = 16;  // the Python server's METADATA_BYTES (server/app.py)
  long max_concurrent_streams = 0;  // HTTP/2 streams per connection; 0: gRPC's default
  long max_memory_mb = 0;  // 0: derived from --max-message-mb (MemoryLimitBytes)
};

// The options of `argv` (exits through Usage when they are not usable).
Options ParseArgs(int argc, char **argv);

// `error` and the usage on stderr; exit status 2.
[[noreturn]] void Usage(const std::string &error);

}  // namespace nlmserve_frontend

#endif  // NLMSERVE_FRONTEND_OPTIONS_H
