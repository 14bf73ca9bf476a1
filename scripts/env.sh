# Sourced by demo.sh and test.sh: make an environment where tessera runs, idempotently, and
# set $PY to its python. Where torch is already importable (a GPU machine with its own CUDA
# build, maybe offline) that python is used as it is and torch is never reinstalled; otherwise
# a virtual environment .venv gets the CPU build of torch.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
BASE_PY=${PYTHON:-python3}

"$BASE_PY" -c 'import sys; assert sys.version_info >= (3, 10)' 2>/dev/null || {
    echo "tessera needs Python >= 3.10 (found: $("$BASE_PY" --version 2>&1))" >&2; exit 1; }

if "$BASE_PY" -c 'import torch' 2>/dev/null; then
    PY=$BASE_PY
    # Small, pure-python extras only; never torch. Offline, whatever is missing stays missing.
    "$PY" -c 'import numpy, pytest, tokenizers, tqdm' 2>/dev/null \
        || "$PY" -m pip install -q numpy pytest pytest-timeout tokenizers tqdm || true
else
    PY="$ROOT/.venv/bin/python"
    [ -x "$PY" ] || "$BASE_PY" -m venv "$ROOT/.venv"
    if ! "$PY" -c 'import torch' 2>/dev/null; then
        echo "tessera: installing the CPU build of torch into .venv (once)" >&2
        # PyPI's Linux torch is the CUDA build (several GB of nvidia-* wheels); PyTorch's CPU index
        # has the CPU one (2.13.0+cpu, preferred over 2.13.0 when both are seen). Offered only
        # where it answers within 5 s, so a machine with its own package mirror is not held up.
        CPU_INDEX=https://download.pytorch.org/whl/cpu
        EXTRA=()
        if "$PY" -c "import urllib.request as u; u.urlopen('$CPU_INDEX/torch/', timeout=5)" 2>/dev/null; then
            EXTRA=(--extra-index-url "$CPU_INDEX")
        fi
        "$PY" -m pip install -q --disable-pip-version-check ${EXTRA[@]+"${EXTRA[@]}"} torch==2.13.0
    fi
    if ! "$PY" -c 'import tessera, numpy, pytest, pytest_timeout, matplotlib' 2>/dev/null \
        || [ "$ROOT/pyproject.toml" -nt "$ROOT/.venv/.tessera-installed" ]; then
        "$PY" -m pip install -q --disable-pip-version-check -e "$ROOT[test]"
        touch "$ROOT/.venv/.tessera-installed"
    fi
fi
export PY
