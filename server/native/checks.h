// The front end's rules checked against their golden files (proto/contract), each a
// command-line mode of nlmserve_frontend run by the Python tests: 0 when every row agrees,
// else each difference on stderr and 1 (2: the file cannot be read).
//
//   --check-status-codes FILE: the "frontend:" rows of status_codes.tsv are kEndingCodes
//     (endings.h), condition and number (tests/test_native_frontend.py).
//   --check-local-frames FILE: every request row of local_frames.tsv encodes to its bytes
//     and every answer row's bytes read to its fields, or to the row's refusal, through
//     local_frames.h (tests/test_local_frames.py).
#ifndef NLMSERVE_FRONTEND_CHECKS_H
#define NLMSERVE_FRONTEND_CHECKS_H

#include <string>

namespace nlmserve_frontend {

int CheckStatusCodes(const std::string &path);
int CheckLocalFrames(const std::string &path);

}  // namespace nlmserve_frontend

#endif  // NLMSERVE_FRONTEND_CHECKS_H
