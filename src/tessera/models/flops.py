"""Model FLOPs per token and MFU, in Megatron's convention (what the peers in benchmarks/ report).

Training does 3 matmul passes per weight (forward, and backward for inputs and for weights): 6
FLOPs per weight per token. Attention scores and their weighted sum add 4 * s * h per token per
layer forward; causal attention computes half of them, so 2 * s * h, times 3 for training:

    flops_per_token = 6 * (matmul weights) + 6 * layers * seq_len * hidden

For GPT-2 (ffn = 4h) this is Megatron's 72 * L * h^2 * (1 + s / (12 h) + V / (12 L h)).
Recomputation and padding are not counted: this is model FLOPs, so MFU compares layouts and
systems fairly.
"""

from __future__ import annotations

from tessera.config import ModelConfig

# Dense bf16 peak per GPU (vendor datasheets, SXM), for MFU.
PEAK_BF16_FLOPS = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}


def layer_matmul_weights(cfg: ModelConfig) -> int:
    """Weights a token passes through a matmul in one transformer layer (attention and MLP)."""
    h, d = cfg.hidden, cfg.head_dim
    attention = h * (cfg.heads + 2 * cfg.num_kv_heads) * d + cfg.heads * d * h
    mlp = (3 if cfg.family == "llama" else 2) * h * cfg.ffn_size
    return attention + mlp


def head_matmul_weights(cfg: ModelConfig) -> int:
    """Weights of the output head (hidden x vocabulary)."""
    return cfg.hidden * cfg.vocab_size


def matmul_weights(cfg: ModelConfig) -> int:
    """Weights every token passes through a matmul: attention, MLP and the output head."""
    return cfg.layers * layer_matmul_weights(cfg) + head_matmul_weights(cfg)


def layer_flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs per token of one transformer layer (its matmuls and causal attention)."""
    return 6.0 * layer_matmul_weights(cfg) + 6.0 * cfg.seq_len * cfg.hidden


def flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs (forward + backward) per token."""
    return cfg.layers * layer_flops_per_token(cfg) + 6.0 * head_matmul_weights(cfg)


def peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU named like torch.cuda.get_device_name(); None if unknown."""
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in device_name), None)
