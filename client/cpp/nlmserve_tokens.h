// nlmserve token files: the bearer token a client sends (--token-file, the Moses feature's
// token-file=) and the tokens a server accepts, read from a file by one rule.
//
// The contract (the golden file proto/contract/token_files.tsv; the Python owner is
// nlmserve.wire.tokens.parse_tokens): see ParseTokens below. The client library and the
// native front end (server/native) both read token files with these functions. No gRPC here.
#ifndef NLMSERVE_TOKENS_H
#define NLMSERVE_TOKENS_H

#include <string>
#include <vector>

#include "nlmserve_error.h"

namespace nlmserve {

// The tokens of a token file's bytes `text` (proto/contract/token_files.tsv; the Python
// owner is nlmserve.wire.tokens): lines split at '\n', each stripped of ASCII white space;
// empty lines and lines starting with '#' skipped; any other line is one token of bytes
// 0x21-0x7E (printable ASCII without white space). Returns 0 with the tokens in
// `tokens`; the number (from 1) of the first line that is not a token; or -1 when the
// file holds no token (`tokens` empty then).
int ParseTokens(const std::string &text, std::vector<std::string> *tokens);

// The first token of the file `path` (what a client sends); ClientError naming the file
// (and the line) when it cannot be read or breaks ParseTokens' rule.
std::string ReadTokenFile(const std::string &path);

}  // namespace nlmserve

#endif  // NLMSERVE_TOKENS_H
