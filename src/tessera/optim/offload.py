"""The offloaded optimizer's gradient staging: each range's fp32 gradient reaches the host through
a bounded pinned buffer, one span at a time, rather than through a host copy of every gradient.

A span is a contiguous part of one optimizer range, cut at parameter boundaries, at most
``parallel.offload_staging`` elements where no single parameter is larger (0: one whole range,
which ``parallel.bucket_size`` bounds). The step walks the spans in order:

1. span k+1's gradient starts down (non-blocking, into the other of two pinned buffers),
2. span k's copy is awaited, AdamW (torch's fused CPU kernel) updates span k's parameters alone,
3. the updated parameters start back up (non-blocking from pinned main parameters).

So the host holds the fp32 main parameters and Adam's moments (12 bytes per element) and two
staging buffers (one where there is a single span), and the copy of span k+1 runs while the CPU
updates span k. AdamW is elementwise and each parameter's step count is its own, so updating the
spans one after another gives the same bits as one update of everything.
"""

from __future__ import annotations

from collections.abc import Sequence


def staging_spans(length: int, fragments: Sequence[tuple[int, int]], cap: int) -> list[tuple[int, int]]:
    """``[a, b)`` spans covering ``[0, length)`` of a range whose parameters occupy ``fragments``
    (sorted ``(start, end)`` pairs), each cut at a parameter's start and at most ``cap`` elements
    unless one parameter (with the padding before it) is longer. ``cap`` <= 0: the whole range."""
    if cap <= 0 or length <= cap:
        return [(0, length)] if length else []
    spans, start = [], 0
    for a, b in fragments:
        if a > start and b - start > cap:  # this parameter would overflow the span: it starts the next one
            spans.append((start, a))
            start = a
    spans.append((start, length))
    return spans


def staging_buffers(spans: int) -> int:
    """Pinned staging buffers the step keeps: two (one filling while the CPU updates from the
    other) where there is more than one span."""
    return 2 if spans > 1 else min(spans, 1)


__all__ = ["staging_spans", "staging_buffers"]
