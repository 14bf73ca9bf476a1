"""Every check that can refuse a run, done before any process group or model exists.

``tessera train --nproc-per-node N`` runs :func:`check_runnable` before it starts torchrun, and
every rank runs it again before building anything, so a bad run stops with one line naming the
key and the fix (:class:`~tessera.config.ConfigError`), never a traceback or a hang deep inside.
"""

from __future__ import annotations

import os

from tessera.checkpoint import check_resume
from tessera.checkpoint.files import check_store, is_url
from tessera.config import Config, ConfigError, check
from tessera.data import ByteTokenizer, microbatch_counts, remote, sample_tokenizer
from tessera.data.tokenizer import file_tokenizer
from tessera.optim import LRScheduler, MicroBatchCalculator
from tessera.pipeline_parallel.schedules import SPLIT_BACKWARD, ScheduleError, build_all, check_kind
from tessera.pipeline_parallel.simulator import simulate
from tessera.pipeline_parallel.stage import NAMED, LayoutError, parse_layout, stage_layer_ranges
from tessera.training.launch import check_device
from tessera.training.metrics import check_tensorboard
from tessera.training.plan import check_graphable, choose_schedule, microbatches


def validate(cfg: Config, world_size: int) -> Config:
    """The sizes checked against each other and the world size (each stage's under
    ``parallel.stage_tp`` / ``stage_dp``), then the combinations no layout runs. Returns ``cfg``
    with ``parallel.dp`` resolved."""
    p, t = cfg.parallel, cfg.train
    if p.stage_tp and len(set(p.stage_tp)) == 1 and len(set(p.stage_dp)) == 1 and p.tp in (1, p.stage_tp[0]) \
            and p.dp in (0, p.stage_dp[0]):  # equal grids everywhere: the homogeneous pipeline
        p.tp, p.dp, p.stage_tp, p.stage_dp = p.stage_tp[0], p.stage_dp[0], [], []
    if p.stage_tp:
        validate_stages(cfg, world_size)
    else:
        _validate_sizes(cfg, world_size)
    _check_combinations(cfg, world_size)
    if t.cuda_graphs is True:
        check_graphable(cfg, "none" if p.schedule == "auto" and p.pp == 1 else p.schedule)
    return cfg


def _validate_sizes(cfg: Config, world_size: int) -> None:
    """One grid of tp x cp x pp x dp: its sizes against the world size, the model and the batch;
    sets ``parallel.dp``."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    mp = p.tp * p.cp * p.pp
    sizes = f"tp*cp*pp = {p.tp}*{p.cp}*{p.pp}" if p.cp > 1 else f"tp*pp = {p.tp}*{p.pp}"
    check(world_size % mp == 0, "parallel.tp" if p.cp == 1 else "parallel.cp",
          f"{sizes} = {mp} does not divide the world size {world_size}",
          f"choose {'tp, cp and pp' if p.cp > 1 else 'tp and pp'} whose product divides {world_size}, or launch a "
          f"multiple of {mp} processes")
    dp = p.dp or world_size // mp
    check(dp * mp == world_size, "parallel.dp", f"{sizes}*dp = {mp}*{p.dp} = {mp * p.dp} is not the world size "
          f"{world_size}", "set parallel.dp=0 to derive it")
    check(m.heads % p.tp == 0, "model.heads", f"{m.heads} heads are not divisible by tp={p.tp}",
          "choose heads as a multiple of parallel.tp")
    check(m.num_kv_heads % p.tp == 0, "model.kv_heads", f"{m.num_kv_heads} kv heads are not divisible by tp={p.tp}",
          "choose kv_heads as a multiple of parallel.tp")
    check(m.ffn_size % p.tp == 0, "model.ffn_hidden", f"{m.ffn_size} is not divisible by tp={p.tp}",
          "choose ffn_hidden as a multiple of parallel.tp")
    check(t.global_batch % (t.micro_batch * dp) == 0, "train.global_batch",
          f"{t.global_batch} is not divisible by micro_batch*dp = {t.micro_batch}*{dp}",
          f"choose a multiple of {t.micro_batch * dp}")
    MicroBatchCalculator.from_config(t, dp)  # every ramp-up batch divides into micro-batches
    check(m.seq_len % (2 * p.cp) == 0, "model.seq_len",
          f"{m.seq_len} is not divisible by 2*cp = {2 * p.cp}: context parallelism cuts each sample in 2*cp chunks",
          f"choose seq_len as a multiple of {2 * p.cp}")
    local = m.seq_len // p.cp  # this rank's tokens of a sample
    check(not p.sequence_parallel or local % p.tp == 0, "model.seq_len",
          f"{m.seq_len}{f' / cp={p.cp} = {local}' if p.cp > 1 else ''} is not divisible by tp={p.tp}, which "
          "sequence parallelism needs", f"choose seq_len as a multiple of {p.tp * p.cp} or turn "
          "parallel.sequence_parallel off")
    p.dp = dp


def _check_combinations(cfg: Config, world_size: int) -> None:
    """The combinations of switches no layout runs (every layout, heterogeneous stages included)."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    tp = max(p.stage_tp) if p.stage_tp else p.tp  # (sequence parallelism: some stage has tp > 1)
    if p.zero == 3 and world_size == 1:
        # FSDP shards over a process group, and a single launched process runs without one
        import torch.distributed as dist
        check(dist.is_available() and dist.is_initialized(), "parallel.zero",
              "zero=3 (FSDP) needs a process group, and a single process runs without one",
              "use parallel.zero=0 (one process has nothing to shard over), or launch several processes")
    # builtin and synthetic data read no datasets: paths given with them would be ignored silently
    check(cfg.data.source == "indexed" or not cfg.data.paths, "data.paths",
          f"data.source={cfg.data.source} reads no datasets, so {cfg.data.paths} would be ignored",
          "set data.source=indexed to train on them, or leave data.paths empty")
    check(p.cp == 1 or m.dropout == 0, "model.dropout", f"{m.dropout} with cp={p.cp}: ring attention has no "
          "attention dropout", "set model.dropout=0 (as LLM pretraining runs) or parallel.cp=1")
    check(t.fp8 == "none" or t.dtype != "fp16", "train.fp8", f"{t.fp8} with train.dtype=fp16: the fp8 GEMMs run "
          "inside bf16 (or fp32) layers", "set train.dtype=bf16")
    check(p.cp == 1 or t.compile is not True, "train.compile", f"true with cp={p.cp}: ring attention's exchanges "
          "run in eager layers", "leave train.compile at auto (off with cp) or set parallel.cp=1")
    check(not p.sequence_parallel or tp > 1, "parallel.sequence_parallel",
          "sequence parallelism needs tp > 1", "set parallel.tp >= 2 (or a stage's tp) or turn it off")
    check(p.vpp == 1 or p.pp > 1, "parallel.vpp", "vpp > 1 needs pp >= 2 (model chunks interleave over stages)",
          "set parallel.vpp=1 or parallel.pp >= 2")
    check(p.pp <= m.layers, "parallel.pp", f"pp={p.pp} exceeds model.layers={m.layers}",
          "use at most one stage per layer")
    split = p.schedule in SPLIT_BACKWARD
    check(not (split and p.pp < 2), "parallel.schedule", f"{p.schedule} fills pipeline bubbles; with pp=1 there "
          "are none", "use parallel.schedule=none (or auto) with pp=1")
    check(not (p.zero == 3 and split), "parallel.schedule",
          f"{p.schedule} defers weight gradients past the backward that FSDP (zero=3) reduces them in",
          "use parallel.schedule=1f1b or interleaved with zero=3, or zero <= 1")
    check(not (p.zero == 2 and split), "parallel.schedule",
          f"{p.schedule} holds every zero=2 gradient bucket open from a micro-batch's I step to its W step, "
          "which needs more gradient memory than zero=1",
          f"use parallel.schedule=1f1b or interleaved with zero=2, or zero=1 with {p.schedule}")
    check(not (t.grad_accum_fusion is True and p.zero == 3), "train.grad_accum_fusion",
          "zero=3 (FSDP) owns the gradients; there is no main_grad to fuse into",
          "set train.grad_accum_fusion=false with parallel.zero=3")
    check(t.grad_dtype == "fp32" or p.zero < 3, "train.grad_dtype",
          "bf16 gradients are a bucket option (zero 0-2); FSDP reduces in fp32",
          "set train.grad_dtype=fp32 with parallel.zero=3")
    check(t.fused_elementwise is not True or m.family == "llama", "train.fused_elementwise",
          "compiles the llama family's RMSNorm, RoPE and SwiGLU; gpt2's LayerNorm and GELU are one "
          "kernel each already", "set train.fused_elementwise=false for model.family=gpt2")
    check(cfg.data.eod_id < m.vocab_size, "data.eod_id", f"{cfg.data.eod_id} is outside model.vocab_size={m.vocab_size}",
          "give the end-of-document id your preprocessing appended (`tessera preprocess` prints it)")


def validate_stages(cfg: Config, world_size: int) -> Config:
    """A heterogeneous layout (``parallel.stage_tp`` / ``stage_dp``): each stage's grid checked
    against the model, the grids against the world size, and what the bridge does not carry
    refused (the general checks follow in :func:`validate`). Then ``parallel.dp`` is the largest
    stage dp: a pipeline micro-batch is train.micro_batch x that many samples, split over each
    stage's dp replicas."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    given = f"stage_tp={p.stage_tp} stage_dp={p.stage_dp}"
    check(p.tp == 1 and p.dp in (0, max(p.stage_dp)), "parallel.tp" if p.tp != 1 else "parallel.dp",
          f"tp={p.tp} dp={p.dp} with {given}: the stage lists set each stage's sizes",
          "leave parallel.tp=1 and parallel.dp=0 with parallel.stage_tp / stage_dp")
    ranks = [tp * dp for tp, dp in zip(p.stage_tp, p.stage_dp)]
    check(sum(ranks) == world_size, "parallel.stage_dp", f"{given} needs {'+'.join(map(str, ranks))} = "
          f"{sum(ranks)} ranks (stage_tp[s]*stage_dp[s] per stage), not the world size {world_size}",
          f"give stages whose ranks sum to {world_size}, or launch {sum(ranks)} processes")
    for s, tp in enumerate(p.stage_tp):
        for key, n in (("model.heads", m.heads), ("model.kv_heads", m.num_kv_heads), ("model.ffn_hidden", m.ffn_size)):
            check(n % tp == 0, key, f"{n} is not divisible by stage {s}'s tp={tp} (parallel.stage_tp)",
                  "choose stage tp sizes that divide model.heads, kv_heads and ffn_hidden")
        check(not p.sequence_parallel or tp == 1 or m.seq_len % tp == 0, "model.seq_len",
              f"{m.seq_len} is not divisible by stage {s}'s tp={tp}, which sequence parallelism needs",
              "choose seq_len as a multiple of every stage's tp, or turn parallel.sequence_parallel off")
    rows = t.micro_batch * max(p.stage_dp)  # one pipeline micro-batch
    for s, dp in enumerate(p.stage_dp):
        check(rows % dp == 0, "train.micro_batch", f"a pipeline micro-batch of micro_batch*max(stage_dp) = "
              f"{t.micro_batch}*{max(p.stage_dp)} = {rows} samples does not split over stage {s}'s dp={dp}",
              "choose stage dp sizes that divide the largest one, or a micro_batch that makes them divide")
    check(t.global_batch % rows == 0, "train.global_batch", f"{t.global_batch} is not divisible by the pipeline "
          f"micro-batch micro_batch*max(stage_dp) = {rows}", f"choose a multiple of {rows}")
    check(p.cp == 1, "parallel.cp", f"cp={p.cp} with {given}: the bridge re-splits batch and sequence, not "
          "context-parallel chunks", "set parallel.cp=1 with heterogeneous stages")
    check(p.vpp == 1, "parallel.vpp", f"vpp={p.vpp} with {given}: the bridge joins neighbouring stages only",
          "set parallel.vpp=1 with heterogeneous stages")
    check(p.zero < 3, "parallel.zero", f"3 with {given}: FSDP shards over a dp device mesh, and stages on grids "
          "of their own have none", "set parallel.zero=0, 1 or 2")
    check(not m.tie_embeddings or (p.stage_tp[0], p.stage_dp[0]) == (p.stage_tp[-1], p.stage_dp[-1]),
          "model.tie_embeddings", f"true with {given}: the tied copies on the first and last stage are summed "
          "rank by rank, which needs the two stages on equal grids", "set model.tie_embeddings=false, or give "
          "the first and last stage the same tp and dp")
    check(not p.optimizer_offload, "parallel.optimizer_offload", f"true with {given}: the offloaded update is "
          "not proven on heterogeneous stages", "set parallel.optimizer_offload=false with heterogeneous stages")
    check(t.cuda_graphs is not True, "train.cuda_graphs", f"true with {given}: graphed layers are captured "
          "for one tp size", "leave train.cuda_graphs at auto (off here)")
    check(p.schedule in ("auto", "1f1b", "gpipe", "zb-h1"), "parallel.schedule",
          f"{p.schedule} with {given}", "use parallel.schedule=1f1b, gpipe, zb-h1 or auto")
    check(t.sample_tokens == 0, "train.sample_tokens", f"{t.sample_tokens} with {given}: generation has no path "
          "through the bridge yet", "set train.sample_tokens=0, or sample from the checkpoint with `tessera generate`")
    MicroBatchCalculator.from_config(t, max(p.stage_dp))  # every ramp-up batch divides into micro-batches
    p.dp = max(p.stage_dp)
    return cfg


def step_microbatch_counts(cfg: Config) -> list[int]:
    """Every per-rank micro-batch count the run's steps will use (several during a ramp-up)."""
    return microbatch_counts(MicroBatchCalculator.from_config(cfg.train, cfg.parallel.dp), cfg.train.steps)


def check_pipeline(cfg: Config) -> None:
    """The layout and the schedule: every micro-batch count the run passes through is valid for
    the schedule, and its action lists are proven free of deadlock by the simulator."""
    p, m = cfg.parallel, cfg.model
    try:
        stage_layer_ranges(m.layers, p.pp, p.vpp, parse_layout(p.pp_layout, m, p.pp, p.vpp))
    except LayoutError as e:
        named = p.pp_layout.strip().lower() in NAMED
        stages = p.pp * p.vpp
        fix = ("change parallel.pp / parallel.vpp, or set parallel.pp_layout=balanced or a list" if named else
               f"give {stages} layer counts (one per virtual stage, pp*vpp) that sum to model.layers={m.layers}, "
               "or set parallel.pp_layout=balanced")
        if named and stages > m.layers:  # (no named layout gives more virtual stages than layers)
            fix = f"use at most model.layers={m.layers} virtual stages: lower parallel.pp / parallel.vpp"
        raise ConfigError("parallel.pp_layout" if not named else "parallel.vpp" if p.vpp > 1 else "parallel.pp",
                          str(e), fix) from None
    count = microbatches(cfg)
    try:
        kind = choose_schedule(p.schedule, p.pp, p.vpp, count, p.zero)
        for count in step_microbatch_counts(cfg):  # every count a batch ramp-up passes through
            check_kind(kind, p.pp, p.vpp, count)
            simulate(build_all(kind, p.pp, p.vpp, count), p.vpp)  # proves it cannot hang
    except ScheduleError as e:
        raise ConfigError("parallel.schedule", f"{e} (with {count} micro-batches per step)",
                          "choose another parallel.schedule, or change parallel.pp / vpp / train.global_batch"
                          " / train.batch_rampup") from None


def check_datasets(data, vocab_size: int | None = None, validates: bool = False) -> None:
    """data.paths and data.split parse, every dataset opens (its files are whole), its training
    split (and with ``validates``, its validation split) holds a sample, the blend has one
    vocabulary, which fits ``vocab_size``."""
    from tessera.data import IndexedDataset, IndexedDatasetError, parse_blend, split_documents
    from tessera.data.indexed import document_ends, token_occurs

    try:
        blend = parse_blend(data.paths)
        split_documents(1000, data.split)
    except ValueError as e:
        if "split" in str(e):
            raise ConfigError("data.split", str(e), "give train, valid and test weights, e.g. data.split=969,30,1") from None
        raise ConfigError("data.paths", str(e), "give one prefix, or weights and prefixes, "
                          "e.g. data.paths=0.7,prefixA,0.3,prefixB") from None
    packing = data.reset_position_ids or data.reset_attention_mask or data.eod_mask_loss
    for _, prefix in blend:
        try:
            dataset = IndexedDataset(prefix, data.cache_dir)
            lengths = dataset.sequence_lengths
        except IndexedDatasetError as e:
            raise ConfigError("data.paths", str(e), "preprocess the data with `tessera preprocess`, or fix the path") from None
        except ImportError as e:  # (a URL whose fsspec implementation is not installed)
            raise ConfigError("data.paths", f"{prefix}: fsspec cannot open it here ({e})",
                              "pip install s3fs (s3://) or gcsfs (gs://)") from None
        except (OSError, ValueError) as e:  # (a store that refuses: no bucket, no credentials, an unknown protocol)
            raise ConfigError("data.paths", f"{prefix} cannot be read ({type(e).__name__}: {e})",
                              "check the URL and the store's credentials (for S3: AWS_PROFILE or "
                              "AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL)") from None
        if packing:  # a wrong data.eod_id packs nothing apart, or cuts documents at an ordinary token
            ends = document_ends(dataset)
            if ends and data.eod_id not in ends and (len(ends) == 1 or not token_occurs(dataset, data.eod_id)):
                said = f"they all end with {next(iter(ends))}" if len(ends) == 1 else "they end with no one id"
                raise ConfigError("data.eod_id", f"{data.eod_id}, but no document sampled from {prefix} ends with "
                                  f"it ({said})", f"set data.eod_id={next(iter(ends))}, the id preprocessing appended"
                                  if len(ends) == 1 else "give the id that ends each document, or preprocess the data "
                                  "with `tessera preprocess` (it appends one)")
        parts = split_documents(len(lengths), data.split)
        for part, name in ((0, "training"), (1, "validation"))[:2 if validates else 1]:
            docs = parts[part]
            if int(lengths[docs.start:docs.stop].sum(dtype="int64")) < 2:
                raise ConfigError("data.split", f"{data.split} leaves {prefix}'s {name} part documents {docs.start} to "
                                  f"{docs.stop} of {len(lengths)}, with too few tokens for a sample",
                                  f"give the {name} part more weight (data.split is train,valid,test), "
                                  f"or more documents" + (", or set train.eval_every=0" if part else ""))
    check_data_tokenizers([prefix for _, prefix in blend], vocab_size, data.cache_dir)


def check_data_tokenizers(prefixes: list[str], vocab_size: int | None, cache_dir: str = "") -> None:
    """Where datasets have their ``PREFIX.tokenizer.json`` (written by ``tessera preprocess``;
    datasets made elsewhere are not checked): ``vocab_size`` holds its ids, and a blend shares one
    vocabulary (the same id would mean other text in each)."""
    seen: dict[str, dict[str, int]] = {}
    for prefix in prefixes:
        path = f"{prefix}.tokenizer.json"
        if remote.is_url(path):  # (copied into the local cache, where there is one)
            path = remote.local_copy(path, cache_dir) or path
        if not os.path.isfile(path):
            continue
        tokenizer = file_tokenizer(path, "data.paths", "preprocess the dataset again, or remove the broken file")
        if vocab_size is not None and tokenizer.vocab_size > vocab_size:
            raise ConfigError("model.vocab_size", f"{vocab_size} is smaller than the {tokenizer.vocab_size} ids of "
                              f"{path}, the data's tokenizer", f"set model.vocab_size >= {tokenizer.vocab_size}")
        vocabulary = tokenizer.vocabulary()
        for other, theirs in seen.items():
            if theirs != vocabulary:
                raise ConfigError("data.paths", f"the blend's datasets have different vocabularies: {other}.tokenizer.json "
                                  f"and {path} differ (an id would mean other text in each)",
                                  f"preprocess them with one tokenizer, e.g. --tokenizer {other}.tokenizer.json")
        seen[prefix] = vocabulary


def _check_data(cfg: Config) -> None:
    """The datasets open and split as asked, the builtin corpus fits, the index cache is writable."""
    m, t, d = cfg.model, cfg.train, cfg.data
    if d.source == "indexed":
        check_datasets(d, m.vocab_size, validates=t.eval_every > 0)
    if d.source == "builtin" and t.eval_every:
        import pydoc_data.topics  # (the demo corpus: one document per topic)

        from tessera.data import split_documents
        if not split_documents(len(pydoc_data.topics.topics), d.split)[1]:
            raise ConfigError("data.split", f"{d.split} leaves the builtin corpus's "
                              f"{len(pydoc_data.topics.topics)} documents no validation part",
                              "give the validation part more weight (data.split is train,valid,test, e.g. 90,10,0), "
                              "or set train.eval_every=0")
    if d.cache_dir and d.source != "synthetic":
        check_writable_dir(d.cache_dir, "data.cache_dir")
    elif d.source == "indexed":  # the default: an index-cache folder beside each dataset
        from tessera.data import parse_blend
        from tessera.data.indexed_source import index_cache_beside
        for _, prefix in parse_blend(d.paths):
            cache = index_cache_beside(prefix)
            if not os.path.isdir(cache):  # (one there already may hold the indices: read, not written)
                try:
                    check_writable_dir(cache, "data.cache_dir")
                except ConfigError as e:
                    raise ConfigError("data.cache_dir", f"empty, so the sample indices go beside {prefix}: {e.problem}",
                                      "set data.cache_dir to a folder you can write") from None
    if d.source == "builtin" and m.vocab_size < ByteTokenizer.vocab_size:
        raise ConfigError("model.vocab_size", f"{m.vocab_size} is smaller than the byte "
                          f"tokenizer's {ByteTokenizer.vocab_size} ids of the builtin corpus",
                          "set model.vocab_size >= 256")


def check_runnable(cfg: Config, world_size: int) -> Config:
    """Every check that can refuse the run, done before any process group or model exists."""
    validate(cfg, world_size)
    t = cfg.train
    check_pipeline(cfg)
    LRScheduler(cfg.optim, t.steps)  # refuses a wsd decay longer than the steps after warmup
    _check_data(cfg)
    if t.sample_tokens:
        sample_tokenizer(t.sample_tokenizer, cfg.data, cfg.model.vocab_size, t.sample_prompt)
    check_writable_dir(t.out_dir, "train.out_dir")
    if t.tensorboard:
        check_tensorboard()
    c = cfg.checkpoint
    if c.load and is_url(c.load):
        check_store(c.load, "checkpoint.load", write=False)
    if c.dir and is_url(c.dir):  # (one rank writes the probe: a thousand ranks' PUTs would say nothing more)
        check_store(c.dir, "checkpoint.dir", write=os.environ.get("RANK", "0") == "0")
    elif c.dir:
        check_writable_dir(c.dir, "checkpoint.dir")
    check_resume(cfg)
    check_device(t.device, t.cuda_graphs, t.fp8)
    return cfg


def check_writable_dir(path: str, key: str) -> None:
    """``path``, or the nearest folder above it that exists, is a directory this process may write."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(key, f"{existing} is a file, not a directory ({key}={path})", "give a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(key, f"{existing} is not writable ({key}={path})", "give a directory you can write")


__all__ = ["check_runnable", "validate", "check_pipeline", "check_datasets", "check_writable_dir"]
