// LocalChannel (local_channel.h): one batch out, its answer back.
#include "local_channel.h"

#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "endings.h"

namespace nlmserve_frontend {

grpc::Status LocalChannel::Call(const nlmserve::v1::ScoreNgramsRequest &req,
                                const std::vector<std::pair<uint32_t, uint32_t> > &parts,
                                const std::string &authorization, uint32_t unk_id,
                                nlmserve::v1::ScoreNgramsResponse *res, std::vector<grpc::Status> *part_status) {
  std::string error;
  if (fd_ < 0 && !Connect(&error)) return End(kBackendUnreachable, error);
  const std::string &ids = req.packed_ids();
  const uint32_t width = req.packed_order();
  const uint32_t rows = width ? static_cast<uint32_t>(ids.size() / (4u * width)) : 0;
  const uint32_t id = next_id_++;
  const uint32_t n_parts = static_cast<uint32_t>(parts.size());
  uint32_t flags = (req.log_base() == nlmserve::v1::LN ? 0u : 1u) | (req.allow_unnormalized() ? 2u : 0u);
  uint32_t head[7] = {id, flags, static_cast<uint32_t>(timeout_ms_), rows, width,
                      static_cast<uint32_t>(authorization.size()), n_parts};
  std::string frame("NLQ2", 4);
  frame.append(reinterpret_cast<const char *>(head), sizeof(head));  // little-endian hosts (x86-64, aarch64)
  frame.append(authorization);
  for (const auto &part : parts) {
    uint32_t two[2] = {part.first, part.second};
    frame.append(reinterpret_cast<const char *>(two), sizeof(two));
  }
  if (!WriteAll(frame.data(), frame.size()) || !WriteAll(ids.data(), ids.size())) return Broken("send");
  char rmagic[4];
  uint32_t rhead[7];
  if (!ReadAll(rmagic, 4) || !ReadAll(reinterpret_cast<char *>(rhead), sizeof(rhead))) return Broken("receive");
  if (std::memcmp(rmagic, "NLR2", 4) != 0 || rhead[0] != id) {
    errno = EPROTO;
    return Broken("accept a malformed answer from");
  }
  const uint32_t status = rhead[1], rflags = rhead[2], n = rhead[3], hash_len = rhead[4], msg_len = rhead[5],
                 answered_parts = rhead[6];
  if (hash_len > 4096 || msg_len > (1u << 20) ||
      (status == 0 && (n != rows || answered_parts != n_parts)) || (status != 0 && (n != 0 || answered_parts != 0))) {
    errno = EPROTO;
    return Broken("accept an inconsistent answer from");
  }
  std::string hash(hash_len, '\0'), message(msg_len, '\0');
  if (!ReadAll(&hash[0], hash_len) || !ReadAll(&message[0], msg_len)) return Broken("receive");
  if (status != 0) return grpc::Status(static_cast<grpc::StatusCode>(status), message);
  std::vector<uint32_t> table(2u * n_parts);
  if (!ReadAll(reinterpret_cast<char *>(table.data()), table.size() * 4u)) return Broken("receive");
  part_status->clear();
  part_status->reserve(n_parts);
  for (uint32_t i = 0; i < n_parts; ++i) {
    const uint32_t code = table[2u * i], len = table[2u * i + 1];
    if (len > (1u << 20) || (code == 0 && len != 0)) {
      errno = EPROTO;
      return Broken("accept an inconsistent answer from");
    }
    std::string text(len, '\0');
    if (!ReadAll(&text[0], len)) return Broken("receive");
    part_status->push_back(code == 0 ? grpc::Status::OK : grpc::Status(static_cast<grpc::StatusCode>(code), text));
  }
  auto *scores = res->mutable_log_probs();
  scores->Resize(static_cast<int>(n), 0.0f);
  if (!ReadAll(reinterpret_cast<char *>(scores->mutable_data()), 4u * n)) return Broken("receive");
  auto *oov = res->mutable_oov();
  oov->Reserve(static_cast<int>(n));
  for (uint32_t row = 0; row < n; ++row) {
    uint32_t last;
    std::memcpy(&last, ids.data() + (static_cast<std::size_t>(row) * width + width - 1) * 4, 4);
    oov->Add(last == unk_id);
  }
  res->set_log_base((rflags & 1u) ? nlmserve::v1::LOG10 : nlmserve::v1::LN);
  res->set_normalized((rflags & 2u) != 0);
  res->set_model_hash(hash);
  return grpc::Status::OK;
}

bool LocalChannel::Connect(std::string *error) {
  fd_ = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (fd_ < 0 || path_.size() >= sizeof(addr.sun_path)) {
    *error = "cannot open the backend socket " + path_;
    Close();
    return false;
  }
  std::memcpy(addr.sun_path, path_.c_str(), path_.size() + 1);
  if (connect(fd_, reinterpret_cast<sockaddr *>(&addr), sizeof(addr)) != 0) {
    *error = "cannot connect to the backend socket " + path_ + ": " + std::strerror(errno);
    Close();
    return false;
  }
  // A backend that stops answering costs a batch its timeout, not the front end forever.
  timeval tv{};
  tv.tv_sec = timeout_ms_ / 1000 + 1;
  setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  return true;
}

void LocalChannel::Close() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

// The connection is unusable (server gone, timeout, garbage): drop it; the next call reconnects.
grpc::Status LocalChannel::Broken(const std::string &what) {
  bool timed_out = errno == EAGAIN || errno == EWOULDBLOCK;
  Close();
  if (timed_out) return End(kBackendTimeout, "the backend socket did not answer in time");
  return End(kBackendUnreachable, "cannot " + what + " the backend socket " + path_);
}

bool LocalChannel::WriteAll(const char *p, std::size_t n) {
  while (n > 0) {
    ssize_t k = send(fd_, p, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    p += k;
    n -= static_cast<std::size_t>(k);
  }
  return true;
}

bool LocalChannel::ReadAll(char *p, std::size_t n) {
  while (n > 0) {
    ssize_t k = recv(fd_, p, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) {
      if (k == 0) errno = ECONNRESET;
      return false;
    }
    p += k;
    n -= static_cast<std::size_t>(k);
  }
  return true;
}

}  // namespace nlmserve_frontend
