#!/usr/bin/env bash
# The whole test suite (CPU, gloo); GPU tests run where a GPU is present and are skipped elsewhere.
source "$(dirname "$0")/env.sh"
cd "$ROOT"
exec "$PY" -m pytest -q "$@"
