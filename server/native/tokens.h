// The front end's token guards: the bearer tokens of --token-file and --admin-token-file
// (TokenSet), checked from a call's metadata before anything else is read and re-read on
// SIGHUP, and the slowing of repeated failures per client address (AuthFailures), the
// Python server's rules (server/auth.py, proto/contract/token_files.tsv).
#ifndef NLMSERVE_FRONTEND_TOKENS_H
#define NLMSERVE_FRONTEND_TOKENS_H

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <iterator>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "log.h"
#include "nlmserve_client.h"

namespace nlmserve_frontend {

// The bearer tokens callers may present: those of --token-file and, when it is set too,
// of --admin-token-file (an admin token may call every method, as the Python server's call
// gate accepts it; which token may reload is the backend's to say). Every token of a file
// is accepted (the rule of proto/contract/token_files.tsv, nlmserve::ParseTokens of the
// client library); the token file's first is the one the front end sends on its own calls.
// Thread-safe; each file is read whole or its tokens in force stay.
class TokenSet {
 public:
  // The longest token file read (the Python server's limit, server/files.py).
  static constexpr std::size_t kMaxFileBytes = 1024 * 1024;

  // The files to read: `path` (none: calls need no token) and `admin_path` (may be empty).
  void SetFiles(const std::string &path, const std::string &admin_path) {
    std::lock_guard<std::mutex> lock(mu_);
    paths_.clear();
    if (!path.empty()) paths_.push_back(path);
    if (!path.empty() && !admin_path.empty()) paths_.push_back(admin_path);
    files_.assign(paths_.size(), nullptr);
  }

  // Reads every file; returns what is wrong with those that could not be read (one line
  // each; empty when all were), whose tokens in force stay.
  std::string Load() {
    std::vector<std::string> paths;
    {
      std::lock_guard<std::mutex> lock(mu_);
      paths = paths_;
    }
    std::string errors;
    for (std::size_t i = 0; i < paths.size(); ++i) {
      auto tokens = std::make_shared<std::vector<std::string> >();
      const std::string error = ReadFile(paths[i], tokens.get());
      if (!error.empty()) {
        errors += (errors.empty() ? "" : "; ") + error;
        continue;
      }
      std::lock_guard<std::mutex> lock(mu_);
      files_[i] = std::move(tokens);
    }
    return errors;
  }

  // Whether calls need a token (--token-file is set).
  bool required() const {
    std::lock_guard<std::mutex> lock(mu_);
    return !paths_.empty();
  }

  // The token of the front end's own calls (empty: none).
  std::string First() const {
    auto files = Current();
    return !files.empty() && files[0] ? files[0]->front() : std::string();
  }

  // The tokens in force, all files together.
  std::size_t size() const {
    std::size_t n = 0;
    for (const auto &file : Current()) n += file ? file->size() : 0;
    return n;
  }

  // Null when the `authorization` metadata `header` (null: none) may call, else the
  // UNAUTHENTICATED message; `*client` is then the token when more than one is in force
  // (the caller's identity for its share of the slots), else left empty. "Bearer" in any
  // case, one space, the token (surrounding white space ignored), compared with every
  // token in a time that does not depend on which one matches or where a wrong one differs.
  const char *Refusal(const grpc::string_ref *header, std::string *client) const {
    if (!required()) return nullptr;
    if (header == nullptr) return "missing bearer token";
    const std::string raw(header->data(), header->size());
    const std::size_t space = raw.find(' ');
    std::string scheme = raw.substr(0, space);
    for (char &c : scheme) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (scheme != "bearer" || space == std::string::npos) return "invalid bearer token";
    std::string given = raw.substr(space + 1);
    const char *white = " \t\r\n\v\f";
    const std::size_t a = given.find_first_not_of(white);
    given = a == std::string::npos ? std::string() : given.substr(a, given.find_last_not_of(white) - a + 1);
    bool ok = false;
    std::size_t count = 0;
    for (const auto &file : Current()) {
      if (!file) continue;
      for (const std::string &token : *file) ok |= SameBytes(given, token);
      count += file->size();
    }
    if (!ok) return "invalid bearer token";
    if (count > 1) *client = "token:" + given;
    return nullptr;
  }

 private:
  // The tokens of the file `path` in `tokens`; else what is wrong with the file. The file
  // must be a regular one (opened non-blocking, then fstat: a FIFO or a device is refused
  // without waiting on it) of at most kMaxFileBytes.
  static std::string ReadFile(const std::string &path, std::vector<std::string> *tokens) {
    int fd = open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return "cannot read token file " + path + ": " + std::strerror(errno);
    struct stat st {};
    std::string text, error;
    if (fstat(fd, &st) != 0) {
      error = "cannot read token file " + path + ": " + std::strerror(errno);
    } else if (!S_ISREG(st.st_mode)) {
      error = "token file " + path + " is not a regular file";
    } else {
      char buffer[65536];
      for (;;) {
        ssize_t k = read(fd, buffer, sizeof(buffer));
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) {
          error = "cannot read token file " + path + ": " + std::strerror(errno);
          break;
        }
        if (k == 0) break;
        text.append(buffer, static_cast<std::size_t>(k));
        if (text.size() > kMaxFileBytes) {
          error = "token file " + path + " is larger than " + std::to_string(kMaxFileBytes) + " bytes";
          break;
        }
      }
    }
    close(fd);
    if (!error.empty()) return error;
    const int bad = nlmserve::ParseTokens(text, tokens);
    if (bad > 0) return path + ":" + std::to_string(bad) + ": a token is printable ASCII and holds no whitespace";
    if (bad < 0) return "token file " + path + " holds no token";
    return std::string();
  }

  std::vector<std::shared_ptr<const std::vector<std::string> > > Current() const {
    std::lock_guard<std::mutex> lock(mu_);
    return files_;
  }

  // Equality in a time that depends on the lengths only.
  static bool SameBytes(const std::string &a, const std::string &b) {
    unsigned char diff = a.size() == b.size() ? 0 : 1;
    const std::size_t n = std::min(a.size(), b.size());
    for (std::size_t i = 0; i < n; ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
    return diff == 0;
  }

  mutable std::mutex mu_;
  std::vector<std::string> paths_;
  std::vector<std::shared_ptr<const std::vector<std::string> > > files_;  // null: never read
};

// Failed authentications per client address, answered more slowly as they accumulate (the
// Python server's rule, server/auth.py AuthFailures): an address's first kFree failures
// within kWindowSeconds are answered at once (a client with a wrong token learns it at
// once); after them each refusal waits kFirstDelaySeconds, doubling with each further
// failure up to kMaxDelaySeconds, so that one address can test at most a few tokens a
// second per call it keeps waiting. At most kHeldPerAddress refusals of one address, and
// kHeld in all, wait at once; beyond those a refusal is answered at once, so that waiting
// refusals hold bounded memory. Calls with a valid token are never slowed. Thread-safe.
class AuthFailures {
 public:
  static constexpr int kFree = 10;
  static constexpr double kWindowSeconds = 60.0;
  static constexpr double kFirstDelaySeconds = 0.05;
  static constexpr double kMaxDelaySeconds = 1.0;
  static constexpr int kHeldPerAddress = 32;
  static constexpr int kHeld = 1024;
  // Addresses remembered at most; the one that failed longest ago is forgotten first.
  static constexpr std::size_t kAddresses = 65536;

  // Counts a failure of `address`; the seconds its refusal waits (0: answer at once). A
  // positive delay must be followed by Answered(address) once the refusal is sent.
  double Failed(const std::string &address) {
    std::lock_guard<std::mutex> lock(mu_);
    const auto now = Clock::now();
    auto it = recent_.find(address);
    Window window{now, 0, order_.end()};
    if (it != recent_.end()) {
      window = it->second;
      order_.erase(window.position);
      recent_.erase(it);
    }
    if (now - window.start > std::chrono::duration<double>(kWindowSeconds)) window = Window{now, 0, order_.end()};
    ++window.failures;
    order_.push_back(address);
    window.position = std::prev(order_.end());
    recent_[address] = window;
    if (recent_.size() > kAddresses) {
      recent_.erase(order_.front());
      order_.pop_front();
    }
    int &held = held_[address];
    if (window.failures <= kFree || held >= kHeldPerAddress || total_held_ >= kHeld) {
      if (held == 0) held_.erase(address);
      return 0.0;
    }
    ++held;
    ++total_held_;
    const int doublings = std::min(window.failures - kFree - 1, 30);
    return std::min(kMaxDelaySeconds, kFirstDelaySeconds * static_cast<double>(1L << doublings));
  }

  // A delayed refusal of `address` was sent (or its call ended).
  void Answered(const std::string &address) {
    std::lock_guard<std::mutex> lock(mu_);
    --total_held_;
    auto it = held_.find(address);
    if (it != held_.end() && --it->second <= 0) held_.erase(it);
  }

 private:
  struct Window {
    Clock::time_point start;
    int failures;
    std::list<std::string>::iterator position;  // in order_
  };
  std::mutex mu_;
  std::unordered_map<std::string, Window> recent_;
  std::list<std::string> order_;  // addresses, the one that failed longest ago first
  std::unordered_map<std::string, int> held_;
  int total_held_ = 0;
};

}  // namespace nlmserve_frontend

#endif  // NLMSERVE_FRONTEND_TOKENS_H
