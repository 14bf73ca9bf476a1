"""Puts src/ on the path of the processes tests start, and skips the gpu-marked tests without
CUDA. How the suite is organised, its markers and the fast subset: tests/README.md."""

import os

import pytest

# Subprocesses (torchrun) must import tessera from this checkout without an install.
_SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
os.environ["PYTHONPATH"] = _SRC + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
