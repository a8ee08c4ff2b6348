// CheckStatusCodes (checks.h).
#include "checks.h"

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>

#include "endings.h"

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

}  // namespace nlmserve_frontend
