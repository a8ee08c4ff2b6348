// The C++ owners of the cross-language rules against the golden files of proto/contract
// (proto/contract/README.md), which the Python owners pass too (tests/test_contract.py).
// No server: tests/test_cpp_client.py runs it.
//
//   nlmserve_contract_test DIR
//       reads every golden file of DIR (proto/contract; moses_ini_lines.tsv through the Moses
//       feature's own reader, moses_plugin/cpp/nlmserve_moses_ini.h) and checks its cases; prints
//       "FILE: N passed" for each file and "contract: N passed, 0 failed" (exit 1 on a
//       failure, each named on stderr).
//   nlmserve_contract_test --score FILE < rows
//       maps the tables file FILE (MapTablesFile) and scores the canonical rows of stdin (order
//       ids a line): prints its facts ("ok N quantization=Q bound=B lowercase=L hash=H
//       normalized=0|1"), then each row's natural-log score; "error MESSAGE" and exit 1 when
//       the file is refused (tests/test_cpp_client.py compares them with the Python reader's).
//   nlmserve_contract_test --words FILE < words
//       each word of stdin (one a line) through the file's vocabulary: its id, or "unknown".
//   nlmserve_contract_test --nlm0 FILE < hypotheses
//       the NLM0 the Moses feature gives a hypothesis with scoring=local from the tables file
//       FILE (DecoderNlm0 below): one hypothesis a line, its phrase lengths, a tab, its words
//       ("2 1<TAB>the house is"); prints "ok N", then each hypothesis' value (natural log).
//       tests/test_nlm0_routes.py compares it with `nlmserve rescore`'s NLM0 of the same list.
#include <grpcpp/grpcpp.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "nlmserve_client.h"
#include "nlmserve_decoder.h"
#include "nlmserve_moses_ini.h"
#include "nlmserve_tables.h"
#include "nlmserve_tables_file.h"

namespace {

std::string g_dir;
int g_passed = 0, g_failed = 0, g_file_passed = 0;

void Check(bool ok, const std::string &file, const std::string &what) {
  if (ok) {
    ++g_passed;
    ++g_file_passed;
  } else {
    ++g_failed;
    std::cerr << "contract FAILED: " << file << ": " << what << "\n";
  }
}

std::string ReadAll(const std::string &name) {
  std::ifstream in((g_dir + "/" + name).c_str(), std::ios::binary);
  if (!in) {
    std::cerr << "cannot read " << g_dir << "/" << name << "\n";
    std::exit(2);
  }
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

// The cases of a golden file: its lines that are neither blank nor comments, split at tabs
// (each with `columns` fields; another count is a failure of the file itself).
std::vector<std::vector<std::string> > Cases(const std::string &name, std::size_t columns) {
  std::istringstream in(ReadAll(name));
  std::vector<std::vector<std::string> > out;
  std::string line;
  while (std::getline(in, line)) {
    if (line.find_first_not_of(" \t\r") == std::string::npos || line[0] == '#') continue;
    std::vector<std::string> fields;
    std::size_t start = 0;
    for (;;) {
      const std::size_t tab = line.find('\t', start);
      fields.push_back(line.substr(start, tab == std::string::npos ? std::string::npos : tab - start));
      if (tab == std::string::npos) break;
      start = tab + 1;
    }
    if (fields.size() != columns) {
      std::cerr << name << ": a line of " << fields.size() << " fields, not " << columns << ": " << line << "\n";
      std::exit(2);
    }
    out.push_back(fields);
  }
  if (out.empty()) {
    std::cerr << name << ": no cases\n";
    std::exit(2);
  }
  return out;
}

// The escapes of the golden files: \n \r \t \v \f \\ \xHH.
std::string Unescape(const std::string &text) {
  std::string out;
  for (std::size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '\\' && i + 1 < text.size()) {
      const char c = text[i + 1];
      const char *simple = "n\nr\rt\tv\vf\f\\\\";
      bool done = false;
      for (const char *p = simple; *p; p += 2) {
        if (c == p[0]) {
          out.push_back(p[1]);
          ++i;
          done = true;
          break;
        }
      }
      if (done) continue;
      if (c == 'x' && i + 3 < text.size()) {
        out.push_back(static_cast<char>(std::strtol(text.substr(i + 2, 2).c_str(), nullptr, 16)));
        i += 3;
        continue;
      }
    }
    out.push_back(text[i]);
  }
  return out;
}

std::vector<uint64_t> Numbers(const std::string &text) {
  std::vector<uint64_t> out;
  if (text == "-") return out;
  std::istringstream in(text);
  long long x;
  while (in >> x) out.push_back(static_cast<uint64_t>(x));
  return out;
}

void Begin() { g_file_passed = 0; }

void End(const std::string &file) { std::printf("%s: %d passed\n", file.c_str(), g_file_passed); }

void CanonicalNgrams() {
  const std::string file = "canonical_ngrams.tsv";
  Begin();
  const std::vector<std::vector<std::string> > cases = Cases(file, 4);
  for (std::size_t k = 0; k < cases.size(); ++k) {
    nlmserve::ModelInfo model;
    model.order = static_cast<uint32_t>(std::stoul(cases[k][0]));
    model.vocab_size = static_cast<uint32_t>(std::stoul(cases[k][1]));
    std::vector<uint32_t> ids;
    const std::vector<uint64_t> given = Numbers(cases[k][2]);
    for (std::size_t i = 0; i < given.size(); ++i) ids.push_back(static_cast<uint32_t>(given[i]));
    std::vector<uint32_t> row(model.order, 0xdeadbeefu);
    const nlmserve::NgramError error = nlmserve::CanonicalRow(ids.data(), ids.size(), model, row.data());
    std::string got;
    if (error != nlmserve::NgramError::kNone) {
      got = std::string("error:") + nlmserve::NgramErrorKind(error);
    } else {
      for (std::size_t i = 0; i < row.size(); ++i) got += (i ? " " : "") + std::to_string(row[i]);
    }
    Check(got == cases[k][3], file, cases[k][2] + " -> " + got + ", not " + cases[k][3]);
  }
  End(file);
}

void TokenFiles() {
  const std::string file = "token_files.tsv";
  Begin();
  const std::vector<std::vector<std::string> > cases = Cases(file, 2);
  for (std::size_t k = 0; k < cases.size(); ++k) {
    std::vector<std::string> tokens;
    const int bad = nlmserve::ParseTokens(Unescape(cases[k][0]), &tokens);
    std::string got;
    if (bad > 0) {
      got = "error:line:" + std::to_string(bad);
    } else if (bad < 0) {
      got = "error:no-token";
    } else {
      got = "tokens:";
      for (std::size_t i = 0; i < tokens.size(); ++i) got += (i ? " " : "") + tokens[i];
    }
    Check(got == Unescape(cases[k][1]), file, cases[k][0] + " -> " + got + ", not " + cases[k][1]);
  }
  End(file);
}

void ServerTargets() {
  const std::string file = "server_targets.tsv";
  Begin();
  const std::vector<std::vector<std::string> > cases = Cases(file, 5);
  for (std::size_t k = 0; k < cases.size(); ++k) {
    const std::vector<std::string> &c = cases[k];
    std::string got;
    try {
      const nlmserve::Endpoint e = nlmserve::ParseTarget(Unescape(c[0]));
      std::string replicas;
      for (std::size_t i = 0; i < e.replicas.size(); ++i) replicas += (i ? "," : "") + e.replicas[i];
      got = e.target + "\t" + (replicas.empty() ? "-" : replicas) + "\t" + (e.replicated ? "yes" : "no") + "\t" +
            (e.host_name.empty() ? "-" : e.host_name);
    } catch (const nlmserve::ClientError &) {
      got = "error\t-\t-\t-";
    }
    const std::string want = c[1] + "\t" + c[2] + "\t" + c[3] + "\t" + c[4];
    Check(got == want, file, "'" + c[0] + "' -> " + got + ", not " + want);
  }
  End(file);
}

void Lowercasing() {
  const std::string file = "lowercase.tsv";
  Begin();
  const std::vector<std::vector<std::string> > cases = Cases(file, 2);
  for (std::size_t k = 0; k < cases.size(); ++k) {
    const std::string got = nlmserve::Lowercase(cases[k][0]);
    Check(got == cases[k][1], file, cases[k][0] + " -> " + got + ", not " + cases[k][1]);
  }
  // Bytes that are not UTF-8 pass unchanged (Python's strings hold none).
  Check(nlmserve::Lowercase("\xff" "A\xce") == "\xff" "a\xce", file, "bytes that are not UTF-8 are copied");
  End(file);
}

void FeatureHashes() {
  const std::string file = "feature_hashes.tsv";
  Begin();
  const std::vector<std::vector<std::string> > cases = Cases(file, 7);
  std::map<std::string, uint64_t> constants;
  constants["seed"] = nlmserve::kHashSeed;
  constants["ctx"] = nlmserve::kHashCtx;
  constants["key"] = nlmserve::kHashKey;
  constants["out"] = nlmserve::kHashOut;
  constants["mod"] = nlmserve::kHashMod;
  std::size_t named = 0;
  for (std::size_t k = 0; k < cases.size(); ++k) {
    const std::vector<std::string> &c = cases[k];
    if (c[0] == "constant") {
      ++named;
      Check(constants.count(c[1]) && constants[c[1]] == std::stoull(c[2]), file, "constant " + c[1]);
      continue;
    }
    const uint64_t V = std::stoull(c[1]), y = std::stoull(c[3]);
    const uint32_t size = static_cast<uint32_t>(std::stoul(c[4]));
    const std::vector<uint64_t> context = Numbers(c[2]);
    // As ScoringTables::RowSlots: h_0, then one newer suffix at a time until the no-word.
    std::string got_h, got_s;
    uint64_t h = nlmserve::kHashSeed;
    bool dead = false;
    const uint32_t mask = size > 1 && (size & (size - 1)) == 0 ? size - 1 : 0;
    for (std::size_t l = 0; l <= context.size(); ++l) {
      if (l > 0) {
        const uint64_t w = context[context.size() - l];
        dead = dead || w == V;
        h = nlmserve::NextSuffixHash(h, static_cast<uint32_t>(w));
      }
      got_h += (l ? " " : "") + (dead ? std::string("-1") : std::to_string(h));
      const std::size_t slot = nlmserve::FeatureSlot(h, static_cast<uint32_t>(y), static_cast<std::size_t>(size));
      const uint32_t masked = nlmserve::FeatureSlot(h, static_cast<uint32_t>(y), size, mask);
      Check(dead || slot == masked, file, c[2] + ": the power-of-two slot is the slot");
      got_s += (l ? " " : "") + (dead ? std::string("-") : std::to_string(slot));
    }
    Check(got_h == c[5] && got_s == c[6], file,
          c[2] + " y=" + c[3] + " size=" + c[4] + " -> " + got_h + " / " + got_s + ", not " + c[5] + " / " + c[6]);
  }
  Check(named == constants.size(), file, "every constant named");
  End(file);
}

std::map<std::string, grpc::StatusCode> CodeNames() {
  std::map<std::string, grpc::StatusCode> m;
  m["OK"] = grpc::StatusCode::OK;
  m["CANCELLED"] = grpc::StatusCode::CANCELLED;
  m["UNKNOWN"] = grpc::StatusCode::UNKNOWN;
  m["INVALID_ARGUMENT"] = grpc::StatusCode::INVALID_ARGUMENT;
  m["DEADLINE_EXCEEDED"] = grpc::StatusCode::DEADLINE_EXCEEDED;
  m["NOT_FOUND"] = grpc::StatusCode::NOT_FOUND;
  m["ALREADY_EXISTS"] = grpc::StatusCode::ALREADY_EXISTS;
  m["PERMISSION_DENIED"] = grpc::StatusCode::PERMISSION_DENIED;
  m["RESOURCE_EXHAUSTED"] = grpc::StatusCode::RESOURCE_EXHAUSTED;
  m["FAILED_PRECONDITION"] = grpc::StatusCode::FAILED_PRECONDITION;
  m["ABORTED"] = grpc::StatusCode::ABORTED;
  m["OUT_OF_RANGE"] = grpc::StatusCode::OUT_OF_RANGE;
  m["UNIMPLEMENTED"] = grpc::StatusCode::UNIMPLEMENTED;
  m["INTERNAL"] = grpc::StatusCode::INTERNAL;
  m["UNAVAILABLE"] = grpc::StatusCode::UNAVAILABLE;
  m["DATA_LOSS"] = grpc::StatusCode::DATA_LOSS;
  m["UNAUTHENTICATED"] = grpc::StatusCode::UNAUTHENTICATED;
  return m;
}

bool SameCode(const std::string &name, const std::string &number) {
  const std::map<std::string, grpc::StatusCode> names = CodeNames();
  std::map<std::string, grpc::StatusCode>::const_iterator it = names.find(name);
  return it != names.end() && static_cast<int>(it->second) == std::stoi(number);
}

void RetryCodes() {
  const std::string file = "retry_codes.tsv";
  Begin();
  const std::vector<std::vector<std::string> > cases = Cases(file, 4);
  for (std::size_t k = 0; k < cases.size(); ++k) {
    const std::vector<std::string> &c = cases[k];
    Check(SameCode(c[0], c[1]), file, c[0] + " is code " + c[1]);
    const bool retry = nlmserve::Retryable(std::stoi(c[1]), c[2] == "-" ? std::string() : c[2]);
    Check(retry == (c[3] == "retry"), file, c[0] + " '" + c[2] + "' -> " + (retry ? "retry" : "final"));
  }
  End(file);
}

void StatusCodes() {
  const std::string file = "status_codes.tsv";
  Begin();
  const std::vector<std::vector<std::string> > cases = Cases(file, 3);
  for (std::size_t k = 0; k < cases.size(); ++k) {
    Check(SameCode(cases[k][1], cases[k][2]), file, cases[k][0] + ": " + cases[k][1] + " is code " + cases[k][2]);
  }
  End(file);
}

// Every finite IEEE half as HalfToFloat reads it (an fp16 file's values): sign, exponent and
// mantissa by the standard's formula, normal and subnormal (the writer stores no subnormal,
// but a reader of them stays exact); numpy's float16 is the Python reader's.
void HalvesAsFloats(const std::string &file) {
  int wrong = 0;
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    if (exponent == 0x1f) continue;  // infinities and NaNs: never written
    const double magnitude = exponent ? std::ldexp(1.0 + mantissa / 1024.0, static_cast<int>(exponent) - 15)
                                      : std::ldexp(mantissa / 1024.0, -14);
    const float want = static_cast<float>((h & 0x8000) ? -magnitude : magnitude);
    const float got = nlmserve::HalfToFloat(static_cast<uint16_t>(h));
    if (got != want || std::signbit(got) != std::signbit(want)) ++wrong;
  }
  Check(wrong == 0, file, "every finite half is read as its value (" + std::to_string(wrong) + " are not)");
  Check(nlmserve::HalfToFloat(0x3c00) == 1.f && nlmserve::HalfToFloat(0xc000) == -2.f &&
            nlmserve::HalfToFloat(0x7bff) == 65504.f && nlmserve::HalfToFloat(0x0400) == std::ldexp(1.f, -14) &&
            nlmserve::HalfToFloat(0x3555) == 0.333251953125f,
        file, "1, -2, 65504, 2^-14 and 0.33325 by hand");
}

// A file that is not a tables file of version 2 as written is refused with a line that says
// why: not one, a missing file, version 1 (and how to write version 2), a damaged header, a
// header whose fields do not hold together, a file cut short.
void RefusedTablesFiles(const std::string &file) {
  const std::string good = ReadAll(file);
  char name[] = "/tmp/nlmserve_contract_XXXXXX";
  const int fd = mkstemp(name);
  Check(fd >= 0, file, "a temporary file");
  if (fd < 0) return;
  close(fd);
  struct Case {
    const char *what;
    std::string bytes;
    const char *says;
  };
  std::string v1 = good, damaged = good, apart = good;
  const uint32_t one = 1;
  std::memcpy(&v1[8], &one, 4);
  damaged[20] ^= 0x01;  // dim, under the header's check
  const uint64_t moved = 4096 + 1;  // the position rows off their alignment, the check made again
  std::memcpy(&apart[256], &moved, 8);
  std::memset(&apart[248], 0, 8);
  const uint64_t check = nlmserve::TablesFileKey(apart.data(), 4096);
  std::memcpy(&apart[248], &check, 8);
  const Case cases[] = {
      {"version 1", v1, "version 1, which holds no vocabulary"},
      {"a damaged header", damaged, "its header is damaged"},
      {"a header that does not hold together", apart, "does not hold together (the position section's offset"},
      {"a file cut short", good.substr(0, good.size() - 4), "cut short"},
      {"a header alone", good.substr(0, 100), "cut short"},
  };
  for (const Case &c : cases) {
    std::ofstream(name, std::ios::binary | std::ios::trunc) << c.bytes;
    nlmserve::TablesFile none;
    std::string error;
    const bool mapped = nlmserve::MapTablesFile(name, &none, &error);
    Check(!mapped && !none.tables && error.find(c.says) != std::string::npos &&
              error.find(name) == 0 && error.find('\n') == std::string::npos,
          file, std::string(c.what) + " is refused: " + error);
    if (std::string(c.what) != "a file cut short" && std::string(c.what) != "a header alone") {
      Check(error.find("nlmserve export-tables --model MODEL --out " + std::string(name)) != std::string::npos, file,
            std::string(c.what) + ": the line says how to write it again: " + error);
    }
  }
  std::remove(name);
  std::shared_ptr<const nlmserve::ScoringTables> tables;
  std::string error;
  Check(!nlmserve::MapTablesFile(g_dir + "/scoring_tables.txt", &tables, &error) && !tables &&
            error.find("not an nlmserve export-tables file") != std::string::npos,
        file, "the text fixture is refused: " + error);
  Check(!nlmserve::MapTablesFile(g_dir + "/no-such-file.nlt", &tables, &error) && !tables &&
            error.find("no-such-file.nlt: ") == g_dir.size() + 1,
        file, "a missing file is refused: " + error);
}

// A tiny model's tables as text (`file`) and as tables files of each form (FILE.nlt,
// FILE.fp16.nlt, FILE.int8.nlt): the class model's self-normalised scores, or the tree
// model's exact ones, as nlmserve.lm gives them (quantised: within the bound the file records).
void ScoringFixture(const std::string &file) {
  Begin();
  std::istringstream lines(ReadAll(file));
  std::string line, body;
  while (std::getline(lines, line)) {
    if (!line.empty() && line[0] != '#') body += line + "\n";
  }
  std::istringstream in(body);
  std::map<std::string, std::string> head;
  std::string name, value;
  while (in >> name && name != "floats") {
    in >> value;
    head[name] = value;
  }
  std::size_t n = 0;
  in >> n;
  std::vector<float> data(n);
  for (std::size_t i = 0; i < n; ++i) {  // strtof: the masked <s> has the bias -inf
    std::string text;
    in >> text;
    data[i] = std::strtof(text.c_str(), nullptr);
  }
  std::size_t rows = 0;
  in >> name >> rows;
  const uint32_t order = static_cast<uint32_t>(std::stoul(head["order"]));
  std::vector<uint32_t> ids(rows * order);
  std::vector<double> want_ln(rows), want_log10(rows);
  for (std::size_t r = 0; r < rows; ++r) {
    for (uint32_t j = 0; j < order; ++j) in >> ids[r * order + j];
    in >> want_ln[r] >> want_log10[r];
  }
  Check(!in.fail() && name == "rows" && rows > 0, file, "the fixture reads");
  nlmserve::Activation activation = nlmserve::Activation::kNone;
  Check(nlmserve::ParseActivation(head["activation"], &activation), file, "activation " + head["activation"]);
  nlmserve::ScoringTables::Features features;
  features.order = static_cast<uint32_t>(std::stoul(head["feature_order"]));
  features.class_table = static_cast<uint32_t>(std::stoul(head["class_table"]));
  features.word_table = static_cast<uint32_t>(std::stoul(head["word_table"]));
  nlmserve::ScoringTables::Tree tree;
  tree.nodes = static_cast<uint32_t>(std::stoul(head["tree_nodes"]));
  tree.codes = static_cast<uint32_t>(std::stoul(head["tree_codes"]));
  tree.steps = std::stoull(head["tree_steps"]);
  const bool treed = head["output"] == "tree";
  Check(treed == (tree.nodes > 0) && (treed || head["output"] == "class"), file, "output " + head["output"]);
  nlmserve::ScoringTables tables;
  Check(tables.Set(order, static_cast<uint32_t>(std::stoul(head["vocab_size"])),
                   static_cast<uint32_t>(std::stoul(head["dim"])), activation, "fixture", data, features, tree),
        file, "the tables are taken");
  Check(tables.normalized() == treed, file, treed ? "a tree's scores are exact" : "a class output's are not");
  // All rows in one batch, then each alone: the same scores, those of nlmserve.lm.
  std::vector<float> batch(rows);
  nlmserve::ScoringTables::Scratch scratch;
  tables.Score(ids.data(), rows, batch.data(), &scratch);
  for (std::size_t r = 0; r < rows; ++r) {
    float alone = 0.f;
    nlmserve::ScoringTables::Scratch fresh;
    tables.Score(ids.data() + r * order, 1, &alone, &fresh);
    std::ostringstream what;
    what << "row " << r << ": " << batch[r] << " (alone " << alone << "), nlmserve.lm " << want_ln[r];
    Check(std::fabs(batch[r] - want_ln[r]) <= 1e-5 && alone == batch[r], file, what.str());
    Check(std::fabs(batch[r] / std::log(10.0) - want_log10[r]) <= 1e-5, file, what.str() + " in log10");
  }
  End(file);

  // The same tables as tables files (nlmserve.lm.tables_file), mapped: float32, fp16, int8.
  const std::string stem = file.substr(0, file.size() - 4);  // scoring_tables(_tree)
  const char *const forms[] = {"", ".fp16", ".int8"};
  for (int q = 0; q < 3; ++q) {
    const std::string mapped_file = stem + forms[q] + ".nlt";
    Begin();
    nlmserve::TablesFile mapped;
    std::string error;
    const bool ok = nlmserve::MapTablesFile(g_dir + "/" + mapped_file, &mapped, &error);
    Check(ok, mapped_file, "maps: " + error);
    if (!ok) {
      End(mapped_file);
      continue;
    }
    const nlmserve::TablesFileInfo &info = mapped.info;
    const nlmserve::ScoringTables &t = *mapped.tables;
    Check(info.version == 2 && info.order == order && info.vocab_size == tables.vocab_size() &&
              info.dim == tables.dim() && info.bos_id == 1 && info.eos_id == 2 && info.unk_id == 0 &&
              info.model_hash == "scoring_fixture" && info.lowercase == !treed && info.normalized == treed &&
              info.output == head["output"] && info.activation == head["activation"] &&
              static_cast<int>(info.quantization) == q && (q > 0 || info.error_bound == 0.0) && info.error_bound >= 0.0 &&
              info.sha256.size() == 64,
          mapped_file, "its facts are the fixture's (the class model lowercases, the tree model does not)");
    Check(t.mapped() && t.order() == order && t.vocab_size() == tables.vocab_size() && t.dim() == tables.dim() &&
              t.activation() == activation && t.features().order == features.order &&
              t.features().class_table == features.class_table && t.features().word_table == features.word_table &&
              t.normalized() == treed && t.tree().nodes == tree.nodes && t.tree().codes == tree.codes &&
              t.tree().steps == tree.steps && static_cast<int>(t.quantization()) == q,
          mapped_file, "its tables have the text fixture's shape");
    if (q == 0) Check(t.bytes() == tables.bytes(), mapped_file, "as many floats as the text fixture");
    if (q > 0) Check(t.bytes() < tables.bytes(), mapped_file, "fewer bytes than float32");
    std::vector<float> again(rows);
    nlmserve::ScoringTables::Scratch scratch2;
    t.Score(ids.data(), rows, again.data(), &scratch2);
    for (std::size_t r = 0; r < rows; ++r) {
      std::ostringstream what;
      what << "row " << r << ": " << again[r] << " mapped, " << batch[r] << " from the text, bound "
           << info.error_bound;
      if (q == 0) {
        Check(again[r] == batch[r], mapped_file, what.str());  // float32: the same floats
      } else if (std::isinf(batch[r])) {
        Check(again[r] == batch[r], mapped_file, what.str());  // <s> predicted: -inf in every form
      } else {
        Check(std::fabs(again[r] - want_ln[r]) <= info.error_bound + 1e-5, mapped_file, what.str());
      }
    }
    if (q == 0 && !treed) RefusedTablesFiles(mapped_file);
    if (q == 1 && !treed) HalvesAsFloats(mapped_file);
    End(mapped_file);
  }
}

// The class model's words through both fixture files' vocabularies: lowercased first in
// scoring_tables*.nlt (its model lowercases), as given in scoring_tables_tree*.nlt.
void FixtureWords() {
  const std::string file = "scoring_words.tsv";
  Begin();
  nlmserve::TablesFile lower, cased;
  std::string error;
  Check(nlmserve::MapTablesFile(g_dir + "/scoring_tables.int8.nlt", &lower, &error), file, "maps: " + error);
  Check(nlmserve::MapTablesFile(g_dir + "/scoring_tables_tree.nlt", &cased, &error), file, "maps: " + error);
  const std::vector<std::vector<std::string> > cases = Cases(file, 3);
  for (std::size_t k = 0; k < cases.size(); ++k) {
    const nlmserve::TablesVocabulary *vocabularies[] = {&lower.vocabulary, &cased.vocabulary};
    for (int v = 0; v < 2; ++v) {
      const std::string &want = cases[k][1 + v];
      uint32_t id = 12345;
      const bool known = vocabularies[v]->Find(cases[k][0], &id);
      const uint32_t given = vocabularies[v]->Id(cases[k][0]);
      const bool ok = want == "unknown" ? !known && given == 0 : known && id == std::stoul(want) && given == id;
      Check(ok, file, cases[k][0] + (v ? " (cased)" : " (lowercased)") + " -> " + (known ? std::to_string(id) : "unknown") +
                          ", not " + want);
      if (known) Check(vocabularies[v]->Word(id) == (v ? cases[k][0] : nlmserve::Lowercase(cases[k][0])), file,
                       "the word of id " + std::to_string(id));
    }
  }
  End(file);
}

}  // namespace

// --score FILE and --words FILE (the header's usage).
int ReadTablesFile(const std::string &mode, const std::string &path) {
  nlmserve::TablesFile file;
  std::string error;
  if (!nlmserve::MapTablesFile(path, &file, &error)) {
    std::printf("error %s\n", error.c_str());
    return 1;
  }
  if (mode == "--words") {
    std::string word;
    while (std::getline(std::cin, word)) {
      uint32_t id = 0;
      if (file.vocabulary.Find(word, &id)) {
        std::printf("%u\n", id);
      } else {
        std::printf("unknown\n");
      }
    }
    return 0;
  }
  const uint32_t order = file.info.order;
  std::vector<uint32_t> ids;
  uint32_t id;
  while (std::cin >> id) ids.push_back(id);
  const std::size_t n = ids.size() / order;
  std::vector<float> scores(n);
  nlmserve::ScoringTables::Scratch scratch;
  file.tables->Score(ids.data(), n, scores.data(), &scratch);
  std::printf("ok %zu quantization=%s bound=%.17g lowercase=%d hash=%s normalized=%d\n", n,
              nlmserve::QuantizationName(file.info.quantization), file.info.error_bound, file.info.lowercase ? 1 : 0,
              file.info.model_hash.c_str(), file.info.normalized ? 1 : 0);
  for (float s : scores) std::printf("%.9g\n", s);
  return 0;
}

// Moses' LOWEST_SCORE (moses/TypeDef.h): its FloorScore, which the feature applies to every
// n-gram's score, raises a score below it to it.
const float kMosesLowestScore = -100.0f;

// --nlm0 FILE (the header's usage). A hypothesis decoded phrase by phrase gets from the feature
// (NeuralLMServer.cpp, scoring=local) for each phrase, in float as Moses' score collection adds:
// the phrase's n-grams whose context the phrase holds whole (PhraseRows' complete rows: the
// ngramScore of CalcScore, in EvaluateInIsolation), then the n-grams across its left boundary
// from the up to order-1 words before it, and </s> after the last phrase (BoundaryRows, summed
// by SumScores: EvaluateWhenApplied); each score from the tables (natural log) and floored at
// kMosesLowestScore. The words map to ids as the feature's (FileWordId, no lowercase= option).
int DecoderNlm0(const std::string &path) {
  nlmserve::TablesFile file;
  std::string error;
  if (!nlmserve::MapTablesFile(path, &file, &error)) {
    std::printf("error %s\n", error.c_str());
    return 1;
  }
  const nlmserve::ModelInfo model = nlmserve::ModelInfoOf(file.info);
  const std::size_t order = model.order;
  nlmserve::ScoringTables::Scratch scratch;
  std::vector<uint32_t> ids, rows;
  std::vector<uint8_t> complete;
  std::vector<float> scores, values;
  std::string line;
  for (std::size_t number = 1; std::getline(std::cin, line); ++number) {
    const std::size_t tab = line.find('\t');
    std::istringstream lengths(line.substr(0, tab)), words(tab == std::string::npos ? "" : line.substr(tab + 1));
    std::vector<std::size_t> phrases;
    std::size_t length = 0, total_length = 0;
    while (lengths >> length) {
      phrases.push_back(length);
      total_length += length;
    }
    ids.clear();
    std::string word;
    while (words >> word) ids.push_back(nlmserve::FileWordId(file.vocabulary, word, false));
    if (tab == std::string::npos || total_length != ids.size()) {
      std::printf("error line %zu: phrase lengths summing to %zu for %zu words\n", number, total_length, ids.size());
      return 1;
    }
    float value = 0;
    std::size_t start = 0;
    for (const std::size_t n : phrases) {
      rows.clear();
      complete.clear();
      std::size_t position = 0;
      nlmserve::NgramError failed = nlmserve::PhraseRows(model, ids.data() + start, n, &rows, &complete, nullptr,
                                                         &position);
      scores.resize(complete.size());
      if (failed == nlmserve::NgramError::kNone && !complete.empty()) {
        file.tables->Score(rows.data(), complete.size(), scores.data(), &scratch);
      }
      float ngram = 0;
      for (std::size_t i = 0; i < complete.size(); ++i) {
        if (complete[i]) ngram += std::max(scores[i], kMosesLowestScore);
      }
      value += ngram;
      const std::size_t context = std::min(start, order - 1);
      rows.clear();
      if (failed == nlmserve::NgramError::kNone) {
        failed = nlmserve::BoundaryRows(model, ids.data() + start - context, context, context + n,
                                        start + n == ids.size(), &rows);
      }
      if (failed != nlmserve::NgramError::kNone) {
        std::printf("error line %zu: %s\n", number, nlmserve::NgramErrorKind(failed));
        return 1;
      }
      scores.resize(rows.size() / order);
      if (!scores.empty()) file.tables->Score(rows.data(), scores.size(), scores.data(), &scratch);
      for (float &score : scores) score = std::max(score, kMosesLowestScore);
      value += nlmserve::SumScores(scores.data(), scores.size());
      start += n;
    }
    values.push_back(value);
  }
  std::printf("ok %zu\n", values.size());
  for (const float value : values) std::printf("%.9g\n", value);
  return 0;
}

namespace {

// proto/contract/moses_ini_lines.tsv: the feature's moses.ini lines through the Moses-free
// parser the feature reads its options with (nlmserve::ParseFeatureLine): each accepted line
// with the options read from it, each refused one with its message.
std::string OptionAsRead(const nlmserve::FeatureOptions &o, const std::string &key, const std::string &value) {
  static const char *const kPrefetch[] = {"false", "hypothesis", "stack"};
  bool b = false;
  std::string ignored;
  if (key == "factor") return std::to_string(o.factor);
  if (key == "order") return std::to_string(o.order);
  if (key == "path") return o.path;
  if (key == "tables") return o.tables;
  if (key == "normalized") return o.normalized ? "true" : "false";
  if (key == "lowercase") return o.lowercase ? "true" : "false";
  if (key == "table-prefetch") return o.table_prefetch ? "true" : "false";
  if (key == "cache-size") return std::to_string(o.cache_size);
  if (key == "deadline-ms") return std::to_string(o.deadline_ms);
  if (key == "connect-timeout-ms") return std::to_string(o.connect_timeout_ms);
  if (key == "retries") return std::to_string(o.retries);
  if (key == "on-error") return o.floor_on_error ? "floor" : "fail";
  if (key == "phrase-scores") return o.sentence_phrases ? "sentence" : "load";
  if (key == "scoring") return o.local_scoring ? "local" : o.server_scoring_given ? "server" : "?";
  if (key == "prefetch") return kPrefetch[o.prefetch];
  if (key == "tls-ca") return o.tls_ca;
  if (key == "tls-cert") return o.tls_cert;
  if (key == "tls-key") return o.tls_key;
  if (key == "tls-server-name") return o.tls_server_name;
  if (key == "token-file") return o.token_file;
  if (key == "name") return o.name;
  if (key == "oov-feature" || key == "tuneable") {  // Moses' own booleans: as Moses reads them
    return nlmserve::moses_ini::Bool(key, value, &b, &ignored) ? (b ? "true" : "false") : "?";
  }
  return value;  // Moses' others, as given
}

void MosesIniLines() {
  const std::string file = "moses_ini_lines.tsv";
  Begin();
  int accepted = 0, refused = 0;
  for (const std::vector<std::string> &c : Cases(file, 3)) {
    nlmserve::FeatureOptions options;
    std::string error;
    const bool ok = nlmserve::ParseFeatureLine(c[0], nlmserve::kLargestOrder, &options, &error);
    if (c[1] == "error") {
      ++refused;
      Check(!ok && error == c[2], file, c[0] + ": refused with '" + c[2] + "', got " + (ok ? "ok" : "'" + error + "'"));
      continue;
    }
    ++accepted;
    std::string read;
    std::istringstream words(c[0]);
    std::string word;
    words >> word;
    while (words >> word) {
      const std::size_t eq = word.find('=');
      const std::string key = word.substr(0, eq), value = word.substr(eq + 1);
      read += (read.empty() ? "" : " ") + key + "=" + OptionAsRead(options, key, value);
    }
    Check(c[1] == "ok" && ok && read == c[2], file, c[0] + ": read as '" + c[2] + "', got " + (ok ? "'" + read + "'" : "refused: " + error));
  }
  Check(accepted >= 10 && refused >= 10, file, "accepted and refused lines both");
  End(file);
}

}  // namespace

int main(int argc, char **argv) {
  if (argc == 3 && (std::string(argv[1]) == "--score" || std::string(argv[1]) == "--words")) {
    return ReadTablesFile(argv[1], argv[2]);
  }
  if (argc == 3 && std::string(argv[1]) == "--nlm0") return DecoderNlm0(argv[2]);
  if (argc != 2) {
    std::fprintf(stderr,
                 "usage: %s DIR (the folder of the golden files, proto/contract) | --score FILE | --words FILE | "
                 "--nlm0 FILE\n",
                 argv[0]);
    return 2;
  }
  g_dir = argv[1];
  CanonicalNgrams();
  TokenFiles();
  ServerTargets();
  Lowercasing();
  FeatureHashes();
  RetryCodes();
  StatusCodes();
  ScoringFixture("scoring_tables.txt");
  ScoringFixture("scoring_tables_tree.txt");
  FixtureWords();
  MosesIniLines();
  std::printf("contract: %d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}
