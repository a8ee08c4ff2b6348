#!/bin/sh
# Build OxLM's train_factored_sgd and evaluate for bench/oxlm.py, from a source tree of
# pauldb89/OxLM (last commit c3d73d5) that you exported yourself, e.g.
#
#     git clone https://github.com/pauldb89/OxLM /tmp/oxlm-git
#     git --git-dir=/tmp/oxlm-git/.git archive HEAD | (mkdir -p /tmp/oxlm && tar -x -C /tmp/oxlm)
#     bench/oxlm_build.sh /tmp/oxlm            # -> /tmp/oxlm/bin/{train_factored_sgd,evaluate}
#
# Needs cmake, g++ and Debian's libboost-{date-time,filesystem,program-options,serialization,thread}-dev.
# Two fixes for a current g++ (12), applied in place and only once:
#   * three .cc files use std::mt19937 and friends without including <random>;
#   * operator<<(ostream&, const ModelData&) in config.cc falls off its end without
#     `return out;` (undefined behaviour: `evaluate`, which prints the config, crashes).
# The binaries go to SRC/bin (OxLM's CMakeLists puts them there), the build to SRC/build.
# CXXFLAGS from the environment reach the compiler (OxLM's own flags are -O3 and OpenMP).
set -eu

src=${1:?usage: bench/oxlm_build.sh OXLM_SOURCE_DIR}
jobs=${JOBS:-2}
lbl="$src/src/lbl"
[ -f "$lbl/train_factored_sgd.cc" ] || { echo "$src: not an OxLM source tree (no src/lbl/train_factored_sgd.cc)" >&2; exit 2; }

for f in factored_weights.cc factored_tree_weights.cc source_factored_weights.cc; do
    grep -q '^#include <random>' "$lbl/$f" || sed -i '1i #include <random>' "$lbl/$f"
done
if ! grep -q 'return out;' "$lbl/config.cc"; then
    # The function's last statement prints the closing rule; its "}" follows on the next line.
    perl -0pi -e 's/(  out << "#{32}" << endl;\n)\}\n\n\} \/\/ namespace oxlm/$1  return out;\n}\n\n} \/\/ namespace oxlm/' "$lbl/config.cc"
    grep -q 'return out;' "$lbl/config.cc" || { echo "$lbl/config.cc: could not add 'return out;'" >&2; exit 1; }
fi

mkdir -p "$src/build"
cd "$src/build"
cmake ../src >cmake.log
make -j"$jobs" train_factored_sgd evaluate
ls -l "$src/bin/train_factored_sgd" "$src/bin/evaluate"
