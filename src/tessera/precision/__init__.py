"""Low-precision compute: the FP8 maths of the linear layers (``train.fp8``; the layers'
autograd function: tensor_parallel/fp8_linear.py)."""

from tessera.precision.fp8 import (
    Float8Recipe,
    Float8WeightCache,
    quantize,
    scaled_matmul,
)

__all__ = ["Float8Recipe", "Float8WeightCache", "quantize", "scaled_matmul"]
