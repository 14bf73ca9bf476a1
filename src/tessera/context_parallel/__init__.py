"""Context parallelism: each sample's sequence split over the cp ranks in the zigzag layout
(chunks.py), attention computed by passing K/V blocks around the ring (ring.py)."""

from tessera.context_parallel.chunks import positions, unzigzag, zigzag
from tessera.context_parallel.ring import ring_attention

__all__ = ["positions", "ring_attention", "unzigzag", "zigzag"]
