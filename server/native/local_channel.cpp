// LocalChannel (local_channel.h): one batch out as an NLQ2 frame, its NLR2 answer back.
#include "local_channel.h"

#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "endings.h"
#include "local_frames.h"

namespace nlmserve_frontend {

grpc::Status LocalChannel::Call(const nlmserve::v1::ScoreNgramsRequest &req,
                                const std::vector<std::pair<uint32_t, uint32_t> > &parts,
                                const std::string &authorization, uint32_t unk_id,
                                nlmserve::v1::ScoreNgramsResponse *res, std::vector<grpc::Status> *part_status) {
  std::string error;
  if (fd_ < 0 && !Connect(&error)) return End(kBackendUnreachable, error);
  const std::string &ids = req.packed_ids();
  LocalRequest request;
  request.id = next_id_++;
  request.flags = (req.log_base() == nlmserve::v1::LN ? 0u : kFrameLog10) |
                  (req.allow_unnormalized() ? kFrameAllowUnnormalized : 0u);
  request.timeout_ms = static_cast<uint32_t>(timeout_ms_);
  request.width = req.packed_order();
  request.rows = request.width ? static_cast<uint32_t>(ids.size() / (4u * request.width)) : 0;
  request.authorization = authorization;
  request.parts = parts;
  const std::string frame = EncodeRequest(request);
  if (!WriteAll(frame.data(), frame.size()) || !WriteAll(ids.data(), ids.size())) return Broken("send");
  LocalAnswer answer;
  switch (ReadAnswer([this](char *p, std::size_t n) { return ReadAll(p, n); }, request, &answer)) {
    case AnswerRead::kOk:
      break;
    case AnswerRead::kNoBytes:
      return Broken("receive");
    case AnswerRead::kMalformed:
      errno = EPROTO;
      return Broken("accept a malformed answer from");
    case AnswerRead::kInconsistent:
      errno = EPROTO;
      return Broken("accept an inconsistent answer from");
  }
  if (answer.status != 0) return grpc::Status(static_cast<grpc::StatusCode>(answer.status), answer.message);
  part_status->clear();
  part_status->reserve(answer.parts.size());
  for (const auto &part : answer.parts) {
    part_status->push_back(part.first == 0 ? grpc::Status::OK
                                           : grpc::Status(static_cast<grpc::StatusCode>(part.first), part.second));
  }
  auto *scores = res->mutable_log_probs();
  scores->Reserve(static_cast<int>(answer.scores.size()));
  for (float score : answer.scores) scores->Add(score);
  auto *oov = res->mutable_oov();
  oov->Reserve(static_cast<int>(request.rows));
  for (uint32_t row = 0; row < request.rows; ++row) {
    const std::size_t last = static_cast<std::size_t>(row) * request.width + request.width - 1;
    oov->Add(GetU32(ids.data() + last * 4) == unk_id);
  }
  res->set_log_base((answer.flags & kFrameLog10) ? nlmserve::v1::LOG10 : nlmserve::v1::LN);
  res->set_normalized((answer.flags & kFrameNormalized) != 0);
  res->set_model_hash(answer.model_hash);
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
