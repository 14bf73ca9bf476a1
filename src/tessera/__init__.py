"""tessera: train large transformer language models across many GPUs."""

__version__ = "0.1.0"
