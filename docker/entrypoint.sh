#!/bin/sh
# Container entry point: environment variables → `nlmserve serve` flags.
set -eu
set -- --model "${NLMSERVE_MODEL}" --host "${NLMSERVE_HOST}" --port "${NLMSERVE_PORT}" \
       --metrics-port "${NLMSERVE_METRICS_PORT}" "$@"
if [ -n "${NLMSERVE_DEVICE:-}" ]; then set -- "$@" --device "${NLMSERVE_DEVICE}"; fi
# shellcheck disable=SC2086  # NLMSERVE_EXTRA_ARGS is a list of flags
exec nlmserve serve "$@" ${NLMSERVE_EXTRA_ARGS:-}
