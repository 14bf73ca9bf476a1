"""Inference: generation with a KV cache and evaluation (perplexity), from a run's checkpoint or
an imported transformers model, on any tp / pp / dp layout (docs/architecture.md, Inference)."""
