// The frames of the front end's private channel to the model server (server/local.py): an
// NLQ2 request frame per merged packed batch, an NLR2 answer frame back. Every number is an
// unsigned 32-bit little-endian integer (scores: IEEE float32 bits, little-endian), written
// and read here byte by byte, so the bytes are the same on every host; no structure is
// cast to bytes. The rule, field by field and with its edge cases, is the golden file
// proto/contract/local_frames.tsv, which `nlmserve_frontend --check-local-frames FILE`
// checks this header against, as tests/test_local_frames.py (which runs that check) checks
// the model server's side (server/local_frames.py).
#ifndef NLMSERVE_FRONTEND_LOCAL_FRAMES_H
#define NLMSERVE_FRONTEND_LOCAL_FRAMES_H

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace nlmserve_frontend {

// Request flags: bit 0 log10 (else natural log), bit 1 unnormalised scores allowed. Answer
// flags: bit 0 the scores are log10, bit 1 they are normalised.
constexpr uint32_t kFrameLog10 = 1;
constexpr uint32_t kFrameAllowUnnormalized = 2;
constexpr uint32_t kFrameNormalized = 2;
// Bytes of a frame's head (the magic and seven numbers) and of a part table's entry.
constexpr std::size_t kFrameHeadBytes = 32;
constexpr std::size_t kFramePartBytes = 8;
// The longest model hash, message and part message an answer may carry.
constexpr uint32_t kFrameMaxHashBytes = 4096;
constexpr uint32_t kFrameMaxMessageBytes = 1u << 20;

// `value` appended as 4 little-endian bytes; the number at `bytes`.
void PutU32(uint32_t value, std::string *out);
uint32_t GetU32(const char *bytes);

// A merged packed batch: its rows of `width` ids (`ids`: rows × width little-endian
// numbers, oldest word first, the bytes of the merged request's packed_ids), the
// callers' `authorization` metadata, and its parts (the client requests in row order:
// each one's rows and its own packed order).
struct LocalRequest {
  uint32_t id = 0;
  uint32_t flags = 0;
  uint32_t timeout_ms = 0;  // 0: no deadline
  uint32_t rows = 0;
  uint32_t width = 0;
  std::string authorization;
  std::vector<std::pair<uint32_t, uint32_t> > parts;  // (rows, order)
};

// The frame of `request` up to its ids (head, authorization, part table); its ids follow
// as they are.
std::string EncodeRequest(const LocalRequest &request);

// An answer: the batch's status (not 0: every part failed so, with `message`; no parts,
// no scores), its flags and model hash, and when it is 0 each part's status and message
// (empty when 0) and one score per row (0 for the rows of a failed part).
struct LocalAnswer {
  uint32_t id = 0;
  uint32_t status = 0;
  uint32_t flags = 0;
  uint32_t rows = 0;
  std::string model_hash;
  std::string message;
  std::vector<std::pair<uint32_t, std::string> > parts;  // (status, message)
  std::vector<float> scores;
};

// What reading an answer found: the answer; no bytes to read (the connection failed: errno
// says why); a frame that is not the answer to the request (magic or request id); or one
// whose sizes break the rule.
enum class AnswerRead { kOk, kNoBytes, kMalformed, kInconsistent };

// Reads the answer to `request` through `read` (fills its buffer with exactly that many
// bytes, or false), in the frame's order, stopping at the first field that breaks the rule.
AnswerRead ReadAnswer(const std::function<bool(char *, std::size_t)> &read, const LocalRequest &request,
                      LocalAnswer *answer);

}  // namespace nlmserve_frontend

#endif  // NLMSERVE_FRONTEND_LOCAL_FRAMES_H
