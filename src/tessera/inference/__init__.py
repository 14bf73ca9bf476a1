"""Inference: sampling (KV cache and fast paths come with the inference issue)."""
