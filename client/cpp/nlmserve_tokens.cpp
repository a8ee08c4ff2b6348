// Token files (nlmserve_tokens.h).
#include "nlmserve_tokens.h"

#include "nlmserve_channel.h"

namespace nlmserve {

int ParseTokens(const std::string &text, std::vector<std::string> *tokens) {
  static const char kWhite[] = " \t\r\v\f";
  tokens->clear();
  std::size_t start = 0;
  for (int number = 1; start <= text.size(); ++number) {
    std::size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(start, end - start);
    start = end + 1;
    const std::size_t a = line.find_first_not_of(kWhite);
    if (a == std::string::npos || line[a] == '#') continue;
    const std::string token = line.substr(a, line.find_last_not_of(kWhite) - a + 1);
    for (unsigned char c : token) {
      if (c < 0x21 || c > 0x7e) {
        tokens->clear();
        return number;
      }
    }
    tokens->push_back(token);
  }
  return tokens->empty() ? -1 : 0;
}

std::string ReadTokenFile(const std::string &path) {
  std::vector<std::string> tokens;
  const int bad = ParseTokens(ReadFile(path, "token"), &tokens);
  if (bad > 0) {
    throw ClientError(-1, path + ":" + std::to_string(bad) + ": a token is printable ASCII and holds no whitespace");
  }
  if (bad < 0) throw ClientError(-1, "token file " + path + " holds no token");
  return tokens[0];
}

}  // namespace nlmserve
