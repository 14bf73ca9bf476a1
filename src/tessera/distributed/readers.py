"""Which module of a model chunk first reads which parameters in the forward, for forward
pre-hooks that must make parameters ready (a zero 1/2 all-gather, an offloaded update) just
before the first module that reads them, and no earlier."""

from __future__ import annotations

from torch import nn


def forward_readers(chunk: nn.Module) -> list[tuple[nn.Module, set[nn.Parameter]]]:
    """(module, the parameters its forward pre-hook must wait for), in forward order: the chunk
    itself for the parameters registered before its layers (embeddings, which the model may read
    directly rather than through their module), each transformer layer (``chunk.layers``) for
    its own, then every later module with parameters of its own (final norm, output head).
    Modules with nothing to wait for are left out."""
    layers = getattr(chunk, "layers", [])
    layers = list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)
    in_layers = {p for layer in layers for p in layer.parameters()}
    before = set()
    for p in chunk.parameters():
        if p in in_layers:
            break
        before.add(p)
    out = [(chunk, before)] + [(layer, set(layer.parameters())) for layer in layers]
    for module in chunk.modules():
        own = {p for p in module.parameters(recurse=False) if p not in in_layers and p not in before}
        out.append((module, own))
    return [(module, params) for module, params in out if params]


__all__ = ["forward_readers"]
