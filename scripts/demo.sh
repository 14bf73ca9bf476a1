#!/usr/bin/env bash
# The demo: a small GPT trained on Python's own documentation (no download) with tensor and
# pipeline parallelism (tp=2 x pp=2) across 4 CPU processes; the loss falls and a sample is printed.
source "$(dirname "$0")/env.sh"
cd "$ROOT"
exec "$PY" -m tessera train --nproc-per-node 4 --config configs/demo.toml "$@"
