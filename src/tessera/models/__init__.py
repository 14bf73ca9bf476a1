"""GPT-2 and Llama decoders built from tensor-parallel layers."""

from tessera.models.gpt import GPTModel
from tessera.models.transformer import TPContext

__all__ = ["GPTModel", "TPContext"]
