#!/usr/bin/env bash
# The whole test suite (CPU, gloo); GPU tests run where a GPU is present and are skipped elsewhere.
# --fast: the fast subset instead (the tests not marked slow: unit tests and the quickest
# multi-rank ones, under 2 minutes on 2 cores). Other arguments go to pytest.
source "$(dirname "$0")/env.sh"
cd "$ROOT"
args=()
for arg in "$@"; do
    if [ "$arg" = "--fast" ]; then args+=(-m "not slow"); else args+=("$arg"); fi
done
exec "$PY" -m pytest -q ${args[@]+"${args[@]}"}
