#!/usr/bin/env bash
# How long a checkpoint of a benchmark model takes to save and load on this machine, and that the
# resumed run continues the straight one's losses (one GPU, bf16, synthetic data):
#   [EXTRA="checkpoint.async_save=true ..."] bash benchmarks/checkpoint_time.sh [gpt-1.3b|llama-1b] [CKPT_ROOT]
# Run 1 trains 6 steps, saving after steps 3 and 6 (the "tessera: saved" lines: size and seconds;
# the step after a save shows what it cost the run); run 2 resumes from step 3 (the "resumed" line:
# the load's seconds) and trains steps 4-9 (its first three LOSSES are run 1's last three). Writes two checkpoints of ~12 bytes per parameter.
set -euo pipefail
model=${1:-gpt-1.3b}; root=${2:-/tmp/tessera_ckpt_time}
rm -rf "$root"; mkdir -p "$root"
cd "$(dirname "$0")/.."
python3 benchmarks/quick_train.py "$model" train.steps=6 optim.decay_steps=9 train.log_every=1 \
    checkpoint.dir="$root/ck" checkpoint.save_every=3 ${EXTRA:-}
python3 benchmarks/quick_train.py "$model" train.steps=9 optim.decay_steps=9 train.log_every=1 \
    checkpoint.load="$root/ck/step_00000003" ${EXTRA:-}
du -sh "$root/ck"/*
rm -rf "$root"
