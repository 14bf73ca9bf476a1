"""Inference: sampling from a trained model."""
