// CheckStatusCodes and CheckLocalFrames (checks.h).
#include "checks.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <utility>
#include <vector>

#include "endings.h"
#include "local_frames.h"

namespace nlmserve_frontend {

// 0 when the file's "frontend:" rows are exactly kEndingCodes (condition and number); else
// each difference on stderr and 1.
int CheckStatusCodes(const std::string &path) {
  std::ifstream in(path);
  if (!in) {
    std::cerr << "nlmserve_frontend: cannot read " << path << "\n";
    return 2;
  }
  std::map<std::string, int> file;
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("frontend:", 0) != 0) continue;
    std::istringstream fields(line);
    std::string condition, name, number;
    std::getline(fields, condition, '\t');
    std::getline(fields, name, '\t');
    std::getline(fields, number, '\t');
    file[condition.substr(9)] = std::atoi(number.c_str());
  }
  int bad = 0;
  for (const EndingCode &e : kEndingCodes) {
    auto it = file.find(e.condition);
    if (it == file.end() || it->second != static_cast<int>(e.code)) {
      std::cerr << "frontend:" << e.condition << " ends with code " << static_cast<int>(e.code) << ", the file says "
                << (it == file.end() ? std::string("nothing") : std::to_string(it->second)) << "\n";
      ++bad;
    }
    if (it != file.end()) file.erase(it);
  }
  for (const auto &rest : file) {
    std::cerr << "frontend:" << rest.first << " is in the file, not in the front end\n";
    ++bad;
  }
  std::cout << "status codes: " << kEndings << " front-end endings, " << bad << " differ\n";
  return bad ? 1 : 0;
}

namespace {

// A field of local_frames.tsv with its escapes (\xHH) made bytes.
std::string Unescape(const std::string &text) {
  std::string out;
  for (std::size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '\\' && i + 3 < text.size() && text[i + 1] == 'x') {
      out += static_cast<char>(std::strtoul(text.substr(i + 2, 2).c_str(), nullptr, 16));
      i += 3;
    } else {
      out += text[i];
    }
  }
  return out;
}

// The bytes of a hex column (spaces ignored).
std::string FromHex(const std::string &hex) {
  std::string digits, out;
  for (char c : hex) {
    if (c != ' ') digits += c;
  }
  for (std::size_t i = 0; i + 1 < digits.size(); i += 2) {
    out += static_cast<char>(std::strtoul(digits.substr(i, 2).c_str(), nullptr, 16));
  }
  return out;
}

std::string ToHex(const std::string &bytes) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out += kHex[c >> 4];
    out += kHex[c & 15];
  }
  return out;
}

// A row's fields: key=value, space-separated; `part` repeats, in order.
struct Fields {
  std::map<std::string, std::string> one;
  std::vector<std::string> parts;
  std::string Get(const std::string &key) const {
    auto it = one.find(key);
    return it == one.end() ? std::string() : it->second;
  }
  uint32_t Number(const std::string &key) const {
    return static_cast<uint32_t>(std::strtoul(Get(key).c_str(), nullptr, 10));
  }
};

Fields ParseFields(const std::string &text) {
  Fields f;
  std::istringstream words(text);
  std::string word;
  while (words >> word) {
    const std::size_t eq = word.find('=');
    const std::string key = word.substr(0, eq), value = eq == std::string::npos ? "" : Unescape(word.substr(eq + 1));
    if (key == "part") {
      f.parts.push_back(value);
    } else {
      f.one[key] = value;
    }
  }
  return f;
}

std::vector<std::string> Split(const std::string &text, char sep) {
  std::vector<std::string> out;
  if (text.empty()) return out;
  std::size_t start = 0;
  for (;;) {
    const std::size_t at = text.find(sep, start);
    out.push_back(text.substr(start, at == std::string::npos ? std::string::npos : at - start));
    if (at == std::string::npos) return out;
    start = at + 1;
  }
}

// The request an answer row answers: "ID:ROWS:PARTS".
LocalRequest Answered(const Fields &f) {
  const std::vector<std::string> r = Split(f.Get("request"), ':');
  LocalRequest request;
  request.id = static_cast<uint32_t>(std::strtoul(r.at(0).c_str(), nullptr, 10));
  request.rows = static_cast<uint32_t>(std::strtoul(r.at(1).c_str(), nullptr, 10));
  request.parts.assign(std::strtoul(r.at(2).c_str(), nullptr, 10), std::make_pair(1u, 1u));
  return request;
}

// What is wrong with encoding a request row (empty: nothing).
std::string CheckRequest(const std::string &hex, const Fields &f) {
  LocalRequest request;
  request.id = f.Number("id");
  request.flags = f.Number("flags");
  request.timeout_ms = f.Number("timeout_ms");
  request.rows = f.Number("rows");
  request.width = f.Number("width");
  request.authorization = f.Get("auth");
  for (const std::string &part : f.parts) {
    const std::vector<std::string> two = Split(part, ':');
    request.parts.emplace_back(static_cast<uint32_t>(std::strtoul(two.at(0).c_str(), nullptr, 10)),
                               static_cast<uint32_t>(std::strtoul(two.at(1).c_str(), nullptr, 10)));
  }
  std::string frame = EncodeRequest(request);
  for (const std::string &id : Split(f.Get("ids"), ',')) {
    PutU32(static_cast<uint32_t>(std::strtoul(id.c_str(), nullptr, 10)), &frame);
  }
  const std::string want = FromHex(hex);
  return frame == want ? std::string() : "encodes to " + ToHex(frame) + ", not " + ToHex(want);
}

// Reads `bytes` as the answer to `request`: what ReadAnswer says, and whether it read them all.
AnswerRead Read(const std::string &bytes, const LocalRequest &request, LocalAnswer *answer, bool *all_read) {
  std::size_t at = 0;
  const AnswerRead got = ReadAnswer(
      [&](char *p, std::size_t n) {
        if (bytes.size() - at < n) return false;
        std::memcpy(p, bytes.data() + at, n);
        at += n;
        return true;
      },
      request, answer);
  *all_read = at == bytes.size();
  return got;
}

// What is wrong with reading an answer row (empty: nothing).
std::string CheckAnswer(const std::string &hex, const Fields &f) {
  LocalAnswer answer;
  bool all_read = false;
  const AnswerRead got = Read(FromHex(hex), Answered(f), &answer, &all_read);
  if (got != AnswerRead::kOk) return "is refused (" + std::to_string(static_cast<int>(got)) + ")";
  if (!all_read) return "leaves bytes unread";
  std::ostringstream why;
  if (answer.id != f.Number("id") || answer.status != f.Number("status") || answer.flags != f.Number("flags") ||
      answer.rows != f.Number("rows")) {
    why << "reads id " << answer.id << " status " << answer.status << " flags " << answer.flags << " rows "
        << answer.rows << "; ";
  }
  if (answer.model_hash != f.Get("hash") || answer.message != f.Get("message")) {
    why << "reads hash '" << answer.model_hash << "' message '" << answer.message << "'; ";
  }
  std::vector<std::string> parts;
  for (const auto &part : answer.parts) parts.push_back(std::to_string(part.first) + ":" + part.second);
  if (parts != f.parts) why << "reads " << parts.size() << " parts, not those of the row; ";
  const std::vector<std::string> scores = Split(f.Get("scores"), ',');
  bool same = scores.size() == answer.scores.size();
  for (std::size_t i = 0; same && i < scores.size(); ++i) {
    const float want = std::strtof(scores[i].c_str(), nullptr);
    same = std::memcmp(&want, &answer.scores[i], 4) == 0;
  }
  if (!same) why << "reads other scores; ";
  return why.str();
}

// What is wrong with refusing a bad answer row (empty: refused as the row says).
std::string CheckBadAnswer(const std::string &hex, const Fields &f) {
  LocalAnswer answer;
  bool all_read = false;
  const AnswerRead got = Read(FromHex(hex), Answered(f), &answer, &all_read);
  const std::string error = f.Get("error");
  const AnswerRead want = error == "malformed" ? AnswerRead::kMalformed
                          : error == "inconsistent" ? AnswerRead::kInconsistent
                                                    : AnswerRead::kNoBytes;
  if (error != "malformed" && error != "inconsistent" && error != "short") return "names no refusal: " + error;
  if (got == want) return std::string();
  return "is not refused as " + error + " (" + std::to_string(static_cast<int>(got)) + ")";
}

}  // namespace

int CheckLocalFrames(const std::string &path) {
  std::ifstream in(path);
  if (!in) {
    std::cerr << "nlmserve_frontend: cannot read " << path << "\n";
    return 2;
  }
  int checked = 0, bad = 0, number = 0;
  std::string line;
  while (std::getline(in, line)) {
    ++number;
    if (line.empty() || line[0] == '#') continue;
    const std::vector<std::string> columns = Split(line, '\t');
    if (columns.size() != 4) {
      std::cerr << path << ":" << number << ": " << columns.size() << " columns, not 4\n";
      ++bad;
      continue;
    }
    const std::string &frame = columns[0], &name = columns[1], &hex = columns[2];
    const Fields fields = ParseFields(columns[3]);
    std::string wrong;
    if (frame == "request") {
      wrong = CheckRequest(hex, fields);
    } else if (frame == "answer") {
      wrong = CheckAnswer(hex, fields);
    } else if (frame == "bad-answer") {
      wrong = CheckBadAnswer(hex, fields);
    } else if (frame == "bad-request") {
      continue;  // the model server's to refuse
    } else {
      wrong = "is no kind of frame";
    }
    ++checked;
    if (!wrong.empty()) {
      std::cerr << path << ":" << number << ": " << frame << " '" << name << "' " << wrong << "\n";
      ++bad;
    }
  }
  std::cout << "local frames: " << checked << " checked, " << bad << " differ\n";
  return bad ? 1 : 0;
}

}  // namespace nlmserve_frontend
