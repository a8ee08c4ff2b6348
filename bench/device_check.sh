#!/bin/sh
# The accelerator check in one call (bench/device_check.py says what it runs): makes this
# checkout importable as the package `nlmserve` without installing it (a machine with no
# network), then runs the check with the arguments given, e.g. --json $OUT/device-check.json.
set -e
root=$(cd "$(dirname "$0")/.." && pwd)
pkg=$(mktemp -d)
trap 'rm -rf "$pkg"' EXIT
ln -s "$root" "$pkg/nlmserve"
cd "$root"
PYTHONPATH="$pkg:$root${PYTHONPATH:+:$PYTHONPATH}" python3 -m bench.device_check "$@"
