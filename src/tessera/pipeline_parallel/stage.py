"""Cutting the model into pipeline stages: which layers each virtual stage holds.

With ``pp`` ranks and ``vpp`` chunks per rank there are ``pp * vpp`` virtual stages; chunk ``c``
of pipeline rank ``r`` is virtual stage ``c * pp + r``. Layers are split evenly, or by an
explicit layout (``parallel.pp_layout = "3,4,4,3"``: layers per virtual stage, e.g. fewer on the
first and last stages, which also hold the embedding and the head), or ``"balanced"``: by
time, counting the output head as the layers it takes (a pipeline runs at the pace of its
slowest stage). The head's one large GEMM runs at a higher rate than a layer's mix of smaller
GEMMs, attention and memory-bound kernels, so it counts at :data:`HEAD_TIME_PER_FLOP` of its
FLOPs. GPT-1.3B's head (1.9 layers by FLOPs) then gives 13/11 at pp=2 and 7,6,6,5 at vpp=2;
Llama-1B's untied 128k-vocabulary head gives 5,5,4,2 at vpp=2. Megatron offers the same as
``account_for_embedding/loss_in_pipeline_split``, one layer each.

``"auto"`` (the default) is balanced when ``vpp > 1`` and even otherwise: balancing speeds up
interleaved schedules, and at vpp=1 it is no faster (BENCHMARKS.md, Pipeline parallelism).
"""

from __future__ import annotations

from tessera.config import ModelConfig
from tessera.models import GPTModel, TPContext
from tessera.models.flops import head_matmul_weights, layer_flops_per_token


class LayoutError(ValueError):
    pass


HEAD_TIME_PER_FLOP = 0.6  # the head's time per FLOP against a layer's (BENCHMARKS.md, Pipeline parallelism)


def balanced_layout(cfg: ModelConfig, pp: int, vpp: int = 1) -> list[int]:
    """Layers per virtual stage that minimise the busiest stage's time, the last stage carrying
    the output head (its FLOPs times :data:`HEAD_TIME_PER_FLOP`): each layer in turn goes to the
    stage with the least work so far (exact for identical layers), ties to the earlier stage.
    Every stage gets at least one layer (a stage of only the head would be optimal only for toy
    models whose head outweighs layers)."""
    stages = pp * vpp
    if stages > cfg.layers:
        raise LayoutError(f"pp*vpp = {stages} virtual stages for {cfg.layers} layers: every stage needs a layer")
    layer = layer_flops_per_token(cfg)
    counts, work = [1] * stages, [layer] * stages
    work[-1] += HEAD_TIME_PER_FLOP * 6.0 * head_matmul_weights(cfg)
    for _ in range(cfg.layers - stages):
        i = min(range(stages), key=lambda j: (work[j], j))
        counts[i] += 1
        work[i] += layer
    return counts


NAMED = ("auto", "balanced", "even", "")  # the layouts given by name (empty: even)


def parse_layout(text: str, cfg: ModelConfig | None = None, pp: int = 1, vpp: int = 1) -> list[int] | None:
    """``parallel.pp_layout``: None (``"even"`` or empty), ``"balanced"`` (by time, needs ``cfg``),
    ``"auto"`` (balanced when ``vpp > 1``, else even) or the list."""
    name = text.strip().lower()
    if name in ("", "even") or (name == "auto" and vpp == 1):
        return None
    if name in ("auto", "balanced"):
        if cfg is None:
            raise LayoutError(f"pp_layout={text.strip()} needs the model config")
        return balanced_layout(cfg, pp, vpp)
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise LayoutError(f"'{text}' is not a comma-separated list of layer counts") from None


def stage_layer_ranges(layers: int, pp: int, vpp: int = 1, layout: list[int] | None = None) -> list[range]:
    """The (global) layer indices of each virtual stage, in pipeline order."""
    stages = pp * vpp
    if layout is None:
        if pp > layers:
            raise LayoutError(f"pp={pp} stages for {layers} layers: every stage needs at least one layer")
        if layers % stages:
            per_rank = f"{layers // pp} layers per stage" if layers % pp == 0 else f"{layers} layers"
            raise LayoutError(f"{per_rank} cannot be split into vpp={vpp} equal chunks on pp={pp} stages "
                              f"({layers} layers are not divisible by pp*vpp = {stages}); "
                              "set parallel.pp_layout=balanced, or give the layers of each virtual stage")
        layout = [layers // stages] * stages
    if len(layout) != stages:
        raise LayoutError(f"pp_layout has {len(layout)} entries, but pp*vpp = {stages} virtual stages need one each")
    if sum(layout) != layers or min(layout) < 0:
        raise LayoutError(f"pp_layout {layout} must be non-negative and sum to model.layers = {layers}")
    if any(n == 0 for n in layout[1:-1]):
        raise LayoutError(f"pp_layout {layout}: a middle stage with no layers does nothing")
    starts = [sum(layout[:i]) for i in range(stages)]
    return [range(start, start + n) for start, n in zip(starts, layout)]


def build_stage_chunks(cfg: ModelConfig, tp: TPContext, pp_rank: int, pp: int, vpp: int = 1,
                       layout: list[int] | None = None, device=None) -> list[GPTModel]:
    """This rank's model chunks (one per virtual stage it holds), not yet initialised."""
    ranges = stage_layer_ranges(cfg.layers, pp, vpp, layout)
    last = pp * vpp - 1
    chunks = []
    for c in range(vpp):
        stage = c * pp + pp_rank
        chunks.append(GPTModel(cfg, tp, layer_range=ranges[stage], pre_process=stage == 0,
                               post_process=stage == last, device=device))
    return chunks
