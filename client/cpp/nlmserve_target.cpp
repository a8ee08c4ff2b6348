// Server targets (nlmserve_target.h): address text -> the channel target.
#include "nlmserve_target.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <sstream>
#include <utility>

namespace nlmserve {
namespace {

bool StartsWith(const std::string &s, const char *prefix) { return s.rfind(prefix, 0) == 0; }

std::string Trim(const std::string &s) {
  std::size_t a = s.find_first_not_of(" \t");
  if (a == std::string::npos) return std::string();
  return s.substr(a, s.find_last_not_of(" \t") - a + 1);
}

// HOST:PORT or [V6]:PORT -> (host, port); throws naming the address. A host holds no
// ':', '[', ']', '/' or white space; a [V6] host only hex digits, ':', '.' and '%'; a port
// is 1 to 5 digits in 1 .. 65535 (the Python owner's pattern, client/replicas.py).
std::pair<std::string, std::string> SplitAddress(const std::string &address) {
  std::string host, port;
  if (!address.empty() && address[0] == '[') {
    std::size_t close = address.find(']');
    if (close != std::string::npos && close + 1 < address.size() && address[close + 1] == ':') {
      host = address.substr(1, close - 1);
      port = address.substr(close + 2);
      if (host.find_first_not_of("0123456789abcdefABCDEF:.%") != std::string::npos) host.clear();
    }
  } else {
    std::size_t colon = address.find(':');
    if (colon != std::string::npos) {
      host = address.substr(0, colon);
      port = address.substr(colon + 1);
      if (host.find_first_of("[]/ \t\n\r\v\f") != std::string::npos) host.clear();
    }
  }
  bool digits = !port.empty() && port.size() <= 5 &&
                port.find_first_not_of("0123456789") == std::string::npos;
  if (host.empty() || !digits || std::stol(port) <= 0 || std::stol(port) > 65535) {
    throw ClientError(-1, "not a HOST:PORT address: " + address);
  }
  return std::make_pair(host, port);
}

// The first address `host` resolves to, as text, and its family (4 or 6).
std::pair<std::string, int> Resolve(const std::string &host, const std::string &address) {
  addrinfo hints = addrinfo();
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo *found = nullptr;
  int rc = getaddrinfo(host.c_str(), nullptr, &hints, &found);
  if (rc != 0 || found == nullptr) {
    throw ClientError(-1, "cannot resolve " + address + ": " + gai_strerror(rc));
  }
  char text[INET6_ADDRSTRLEN] = {0};
  int family = found->ai_family == AF_INET6 ? 6 : 4;
  const void *raw = family == 6
                        ? static_cast<const void *>(&reinterpret_cast<sockaddr_in6 *>(found->ai_addr)->sin6_addr)
                        : static_cast<const void *>(&reinterpret_cast<sockaddr_in *>(found->ai_addr)->sin_addr);
  inet_ntop(family == 6 ? AF_INET6 : AF_INET, raw, text, sizeof(text));
  freeaddrinfo(found);
  return std::make_pair(std::string(text), family);
}

}  // namespace

Endpoint ParseTarget(const std::string &given) {
  Endpoint e;
  std::string target = Trim(given);
  if (StartsWith(target, "dns:") || StartsWith(target, "ipv4:") || StartsWith(target, "ipv6:")) {
    e.target = target;
    e.replicated = StartsWith(target, "dns:") || target.find(',') != std::string::npos;
    if (!StartsWith(target, "dns:")) {
      std::istringstream list(target.substr(target.find(':') + 1));
      std::string part;
      while (std::getline(list, part, ',')) e.replicas.push_back(part);
    }
    return e;
  }
  std::vector<std::string> parts;
  {
    std::istringstream list(target);
    std::string part;
    while (std::getline(list, part, ',')) {
      part = Trim(part);
      if (!part.empty()) parts.push_back(part);
    }
  }
  if (parts.empty()) throw ClientError(-1, "no server address given");
  if (parts.size() == 1) {
    e.target = parts[0];
    e.replicas = parts;
    try {
      e.host_name = SplitAddress(parts[0]).first;
    } catch (const ClientError &) {
      // gRPC reports a target it cannot use when connecting.
    }
    return e;
  }
  std::vector<std::string> resolved;
  int families = 0;
  std::string host_name;
  bool one_host = true;
  for (const std::string &address : parts) {
    std::pair<std::string, std::string> hp = SplitAddress(address);
    if (host_name.empty()) host_name = hp.first;
    if (hp.first != host_name) one_host = false;
    std::pair<std::string, int> ip = Resolve(hp.first, address);
    families |= ip.second == 6 ? 2 : 1;
    resolved.push_back(ip.second == 6 ? "[" + ip.first + "]:" + hp.second : ip.first + ":" + hp.second);
  }
  if (families == 3) {
    throw ClientError(-1, "replica addresses mix IPv4 and IPv6 (" + target + "); use one family or a DNS name");
  }
  e.target = families == 2 ? "ipv6:" : "ipv4:";
  for (std::size_t i = 0; i < resolved.size(); ++i) e.target += (i ? "," : "") + resolved[i];
  e.replicas = parts;
  e.replicated = true;
  e.host_name = one_host ? host_name : std::string();
  return e;
}

}  // namespace nlmserve
