// The NLQ2 and NLR2 frames (local_frames.h), byte by byte.
#include "local_frames.h"

#include <cstring>

namespace nlmserve_frontend {

namespace {

const char kRequestMagic[4] = {'N', 'L', 'Q', '2'};
const char kAnswerMagic[4] = {'N', 'L', 'R', '2'};

}  // namespace

void PutU32(uint32_t value, std::string *out) {
  const char bytes[4] = {static_cast<char>(value & 0xff), static_cast<char>((value >> 8) & 0xff),
                         static_cast<char>((value >> 16) & 0xff), static_cast<char>((value >> 24) & 0xff)};
  out->append(bytes, 4);
}

uint32_t GetU32(const char *bytes) {
  const unsigned char *b = reinterpret_cast<const unsigned char *>(bytes);
  return static_cast<uint32_t>(b[0]) | static_cast<uint32_t>(b[1]) << 8 | static_cast<uint32_t>(b[2]) << 16 |
         static_cast<uint32_t>(b[3]) << 24;
}

std::string EncodeRequest(const LocalRequest &request) {
  std::string frame(kRequestMagic, 4);
  frame.reserve(kFrameHeadBytes + request.authorization.size() + request.parts.size() * kFramePartBytes);
  PutU32(request.id, &frame);
  PutU32(request.flags, &frame);
  PutU32(request.timeout_ms, &frame);
  PutU32(request.rows, &frame);
  PutU32(request.width, &frame);
  PutU32(static_cast<uint32_t>(request.authorization.size()), &frame);
  PutU32(static_cast<uint32_t>(request.parts.size()), &frame);
  frame.append(request.authorization);
  for (const auto &part : request.parts) {
    PutU32(part.first, &frame);
    PutU32(part.second, &frame);
  }
  return frame;
}

AnswerRead ReadAnswer(const std::function<bool(char *, std::size_t)> &read, const LocalRequest &request,
                      LocalAnswer *answer) {
  char head[kFrameHeadBytes];
  if (!read(head, sizeof(head))) return AnswerRead::kNoBytes;
  answer->id = GetU32(head + 4);
  if (std::memcmp(head, kAnswerMagic, 4) != 0 || answer->id != request.id) return AnswerRead::kMalformed;
  answer->status = GetU32(head + 8);
  answer->flags = GetU32(head + 12);
  answer->rows = GetU32(head + 16);
  const uint32_t hash_len = GetU32(head + 20), message_len = GetU32(head + 24), parts = GetU32(head + 28);
  const uint32_t asked_parts = static_cast<uint32_t>(request.parts.size());
  if (hash_len > kFrameMaxHashBytes || message_len > kFrameMaxMessageBytes ||
      (answer->status == 0 && (answer->rows != request.rows || parts != asked_parts)) ||
      (answer->status != 0 && (answer->rows != 0 || parts != 0))) {
    return AnswerRead::kInconsistent;
  }
  answer->model_hash.assign(hash_len, '\0');
  answer->message.assign(message_len, '\0');
  if (!read(&answer->model_hash[0], hash_len) || !read(&answer->message[0], message_len)) return AnswerRead::kNoBytes;
  answer->parts.clear();
  answer->scores.clear();
  if (answer->status != 0) return AnswerRead::kOk;
  std::string table(static_cast<std::size_t>(parts) * kFramePartBytes, '\0');
  if (!read(&table[0], table.size())) return AnswerRead::kNoBytes;
  answer->parts.reserve(parts);
  for (uint32_t i = 0; i < parts; ++i) {
    const uint32_t code = GetU32(&table[i * kFramePartBytes]), len = GetU32(&table[i * kFramePartBytes + 4]);
    if (len > kFrameMaxMessageBytes || (code == 0 && len != 0)) return AnswerRead::kInconsistent;
    std::string text(len, '\0');
    if (!read(&text[0], len)) return AnswerRead::kNoBytes;
    answer->parts.emplace_back(code, std::move(text));
  }
  std::string scores(static_cast<std::size_t>(answer->rows) * 4, '\0');
  if (!read(&scores[0], scores.size())) return AnswerRead::kNoBytes;
  answer->scores.resize(answer->rows);
  for (uint32_t row = 0; row < answer->rows; ++row) {
    const uint32_t bits = GetU32(&scores[static_cast<std::size_t>(row) * 4]);
    std::memcpy(&answer->scores[row], &bits, 4);
  }
  return AnswerRead::kOk;
}

}  // namespace nlmserve_frontend
