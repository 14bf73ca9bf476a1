"""Low-precision compute: the FP8 linear layers (``train.fp8``)."""

from tessera.precision.fp8 import Float8Recipe, fp8_linear

__all__ = ["Float8Recipe", "fp8_linear"]
