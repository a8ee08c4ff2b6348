// The front end's rules checked against their golden files (proto/contract), each a
// command-line mode of nlmserve_frontend run by the Python tests: 0 when every row agrees,
// else each difference on stderr and 1 (2: the file cannot be read).
//
//   --check-status-codes FILE: the "frontend:" rows of status_codes.tsv are kEndingCodes
//     (endings.h), condition and number (tests/test_native_frontend.py).
#ifndef NLMSERVE_FRONTEND_CHECKS_H
#define NLMSERVE_FRONTEND_CHECKS_H

#include <string>

namespace nlmserve_frontend {

int CheckStatusCodes(const std::string &path);

}  // namespace nlmserve_frontend

#endif  // NLMSERVE_FRONTEND_CHECKS_H
