// The NeuralLMServer feature's moses.ini line, read without Moses: every option the feature
// knows, its default, the values it takes and the one-line message of a value it refuses.
//
// The contract (the golden file proto/contract/moses_ini_lines.tsv; the one writer of the line
// is the Python nlmserve.moses_plugin.moses_ini, whose lines the file accepts):
//   Line      "NeuralLMServer KEY=VALUE ...", split at white space as Moses' FeatureFunction::
//             ParseLine splits it; each option is KEY=VALUE split at its first '=', a key at
//             most once. name= and num-features= are Moses' own (ParseLine takes them); factor=,
//             order=, path=, oov-feature=, tuneable=, tuneable-components=, verbosity=,
//             filterable= and require-sorting-after-source-context= are Moses' base classes'
//             (checked here, then set there); every other key is the feature's own
//             (SetFeatureOption), listed with its meaning in NeuralLMServer.h.
//   Values    booleans as Moses' Scan<bool> reads them (yes, y, true, 1, no, n, false, 0, in any
//             case); whole numbers in decimal digits (cache-size, retries, factor, order from 0,
//             deadline-ms and connect-timeout-ms from 1); the named choices of each option.
//   Whole     after every option (LineError): tables=FILE or path=HOST:PORT (SourceError), and
//             order= given, from 2 up to the largest the build handles.
//   Errors    one line without the feature's name; the feature prefixes "NeuralLMServer: ".
// Moses-free and header only, C++11: the feature (NeuralLMServer.cpp) parses its options with
// it, and nlmserve_contract_test reads the golden file through it.
#ifndef NLMSERVE_MOSES_INI_H
#define NLMSERVE_MOSES_INI_H

#include <cstddef>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace nlmserve {

// The largest order= the feature handles (NeuralLMServerState holds order-1 words inline).
const std::size_t kLargestOrder = 10;

// The options of one NeuralLMServer line, each with the feature's default.
struct FeatureOptions {
  enum Prefetch { kPrefetchOff, kPrefetchHypothesis, kPrefetchStack };
  // Moses' own: the feature's name (name=, "" when Moses numbers it), its factor, order
  // (0: not given) and path (the server: HOST:PORT, replicas or dns:///NAME:PORT).
  std::string name;
  std::size_t factor = 0;
  std::size_t order = 0;
  std::string path;
  // The feature's own (NeuralLMServer.h gives their meaning).
  bool normalized = true;
  std::size_t cache_size = 1 << 20;
  bool lowercase = false;
  std::size_t deadline_ms = 10000;
  std::size_t connect_timeout_ms = 5000;
  std::size_t retries = 2;
  bool floor_on_error = false;           // on-error=floor
  Prefetch prefetch = kPrefetchStack;
  bool sentence_phrases = false;         // phrase-scores=sentence
  bool table_prefetch = true;
  bool local_scoring = false;            // scoring=local (or tables=FILE, at load)
  bool server_scoring_given = false;     // scoring=server was written (refused beside tables=)
  std::string tables;                    // tables=FILE
  std::string tls_ca, tls_cert, tls_key, tls_server_name, token_file;
};

// Where SetFeatureOption leaves a key.
enum class OptionKind {
  kOwn,      // the feature's own option, set in the options
  kMoses,    // an option of Moses' base classes: checked (and factor, order, path kept), for Moses to set
  kRefused,  // an unknown key or a value refused: *error says why
};

namespace moses_ini {

inline std::string Lower(const std::string &s) {
  std::string out(s);
  for (char &c : out) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  return out;
}

// Moses' Scan<bool>: yes, y, true, 1 / no, n, false, 0 in any case.
inline bool Bool(const std::string &key, const std::string &value, bool *out, std::string *error) {
  const std::string v = Lower(value);
  if (v == "yes" || v == "y" || v == "true" || v == "1") {
    *out = true;
  } else if (v == "no" || v == "n" || v == "false" || v == "0") {
    *out = false;
  } else {
    *error = key + " must be true or false, got '" + value + "'";
    return false;
  }
  return true;
}

// A whole number of at most 18 decimal digits, at least `least`.
inline bool Whole(const std::string &key, const std::string &value, std::size_t least, std::size_t *out,
                  std::string *error) {
  const bool digits = !value.empty() && value.size() <= 18 && value.find_first_not_of("0123456789") == std::string::npos;
  std::size_t n = 0;
  for (std::size_t i = 0; digits && i < value.size(); ++i) n = n * 10 + static_cast<std::size_t>(value[i] - '0');
  if (!digits || n < least) {
    *error = key + " must be a whole number" + (least > 0 ? " from " + std::to_string(least) : std::string()) +
             ", got '" + value + "'";
    return false;
  }
  *out = n;
  return true;
}

// value among the `n` names; its index into *out.
inline bool Choice(const std::string &key, const std::string &value, const char *const *names, std::size_t n,
                   const std::string &wording, std::size_t *out, std::string *error) {
  for (std::size_t i = 0; i < n; ++i) {
    if (value == names[i]) {
      *out = i;
      return true;
    }
  }
  *error = key + " must be " + wording + ", got '" + value + "'";
  return false;
}

}  // namespace moses_ini

// Reads the option `key`=`value` of a NeuralLMServer line into *options (the contract above).
inline OptionKind SetFeatureOption(const std::string &key, const std::string &value, FeatureOptions *options,
                                   std::string *error) {
  using namespace moses_ini;
  FeatureOptions &o = *options;
  bool b = false;
  std::size_t i = 0;
  bool ok = true;
  if (key == "factor") {
    return Whole(key, value, 0, &o.factor, error) ? OptionKind::kMoses : OptionKind::kRefused;
  } else if (key == "order") {
    return Whole(key, value, 0, &o.order, error) ? OptionKind::kMoses : OptionKind::kRefused;
  } else if (key == "path") {
    o.path = value;
    return OptionKind::kMoses;
  } else if (key == "oov-feature" || key == "tuneable" || key == "require-sorting-after-source-context") {
    return Bool(key, value, &b, error) ? OptionKind::kMoses : OptionKind::kRefused;
  } else if (key == "verbosity") {
    return Whole(key, value, 0, &i, error) ? OptionKind::kMoses : OptionKind::kRefused;
  } else if (key == "tuneable-components" || key == "filterable") {
    return OptionKind::kMoses;
  } else if (key == "normalized") {
    ok = Bool(key, value, &o.normalized, error);
  } else if (key == "cache-size") {
    ok = Whole(key, value, 0, &o.cache_size, error);
  } else if (key == "lowercase") {
    ok = Bool(key, value, &o.lowercase, error);
  } else if (key == "deadline-ms") {
    ok = Whole(key, value, 1, &o.deadline_ms, error);
  } else if (key == "connect-timeout-ms") {
    ok = Whole(key, value, 1, &o.connect_timeout_ms, error);
  } else if (key == "retries") {
    ok = Whole(key, value, 0, &o.retries, error);
  } else if (key == "phrase-scores") {
    static const char *const kNames[] = {"load", "sentence"};
    ok = Choice(key, value, kNames, 2, "load or sentence", &i, error);
    if (ok) o.sentence_phrases = i == 1;
  } else if (key == "table-prefetch") {
    ok = Bool(key, value, &o.table_prefetch, error);
  } else if (key == "scoring") {
    static const char *const kNames[] = {"server", "local"};
    ok = Choice(key, value, kNames, 2, "server or local", &i, error);
    if (ok) {
      o.local_scoring = i == 1;
      o.server_scoring_given = i == 0;
    }
  } else if (key == "tables") {
    o.tables = value;
  } else if (key == "prefetch") {
    static const char *const kNames[] = {"stack", "true", "hypothesis", "false"};
    static const FeatureOptions::Prefetch kWays[] = {FeatureOptions::kPrefetchStack, FeatureOptions::kPrefetchStack,
                                                     FeatureOptions::kPrefetchHypothesis,
                                                     FeatureOptions::kPrefetchOff};
    ok = Choice(key, value, kNames, 4, "stack, hypothesis or false", &i, error);
    if (ok) o.prefetch = kWays[i];
  } else if (key == "tls-ca") {
    o.tls_ca = value;
  } else if (key == "tls-cert") {
    o.tls_cert = value;
  } else if (key == "tls-key") {
    o.tls_key = value;
  } else if (key == "tls-server-name") {
    o.tls_server_name = value;
  } else if (key == "token-file") {
    o.token_file = value;
  } else if (key == "on-error") {
    static const char *const kNames[] = {"fail", "floor"};
    ok = Choice(key, value, kNames, 2, "fail or floor", &i, error);
    if (ok) o.floor_on_error = i == 1;
  } else {
    *error = "unknown option " + key + "=" + value + " (NeuralLMServer.h lists the options)";
    return OptionKind::kRefused;
  }
  return ok ? OptionKind::kOwn : OptionKind::kRefused;
}

// Where a feature finds its model, from its options: `path` (path=: `nlmserve serve`'s
// HOST:PORT, replicas or dns:///NAME:PORT), `tables` (tables=: a tables file of `nlmserve
// export-tables`), and whether scoring=server was written. A tables file holds the vocabulary,
// the model's facts and its scoring tables, so a feature with tables= and no path= needs no
// server: it constructs no client and opens no connection, as Moses' KENLM with its file.
// With both, the file scores and maps the words, and the server is asked once, at load, which
// model it serves (TablesMismatch). "" when the options hold together, else why the decoder
// must stop.
inline std::string SourceError(const std::string &path, const std::string &tables, bool scoring_server) {
  if (path.empty() && tables.empty()) {
    return "needs tables=FILE (a tables file of `nlmserve export-tables`: no server) or path=HOST:PORT of "
           "`nlmserve serve` (or A:1,B:2 or dns:///NAME:PORT)";
  }
  if (!tables.empty() && scoring_server) return "tables=FILE scores in the decoder: drop scoring=server";
  return std::string();
}

// The checks of the whole line, once every option is read: "" when it holds together, else
// why the decoder must stop. `largest_order`: the longest n-gram the build handles.
inline std::string LineError(const FeatureOptions &o, std::size_t largest_order) {
  const std::string sources = SourceError(o.path, o.tables, o.server_scoring_given);
  if (!sources.empty()) return sources;
  if (o.order == 0) return "needs order= (the served model's order)";
  if (o.order < 2) return "order must be at least 2, got " + std::to_string(o.order);
  if (o.order > largest_order) {
    return "order " + std::to_string(o.order) + " is above the largest this build handles (" +
           std::to_string(largest_order) + ")";
  }
  return std::string();
}

// A whole line ("NeuralLMServer KEY=VALUE ..."), as the feature reads it inside Moses:
// true with *options set, or false with *error the first reason to refuse it.
inline bool ParseFeatureLine(const std::string &line, std::size_t largest_order, FeatureOptions *options,
                             std::string *error) {
  *options = FeatureOptions();
  std::istringstream words(line);
  std::string word;
  if (!(words >> word) || word != "NeuralLMServer") {
    *error = "not a NeuralLMServer line";
    return false;
  }
  std::set<std::string> keys;
  while (words >> word) {
    const std::size_t eq = word.find('=');
    if (eq == std::string::npos) {
      *error = "not KEY=VALUE: " + word;
      return false;
    }
    const std::string key = word.substr(0, eq), value = word.substr(eq + 1);
    if (!keys.insert(key).second) {
      *error = "duplicate key " + key;
      return false;
    }
    if (key == "name") {
      options->name = value;
    } else if (key != "num-features" && SetFeatureOption(key, value, options, error) == OptionKind::kRefused) {
      return false;
    }
  }
  *error = LineError(*options, largest_order);
  return error->empty();
}

}  // namespace nlmserve

#endif  // NLMSERVE_MOSES_INI_H
