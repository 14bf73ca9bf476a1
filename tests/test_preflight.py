"""Preflight: every configuration no layout can run is refused before any process group or
model exists, with the key at fault and the fix (sizes against the world size, pipeline layouts
and schedules, fast paths that cannot act, the data and its tokenizer)."""

import pytest

from tessera.config import ConfigError, load_config
from tessera.training.preflight import check_runnable, validate


def test_dp_derived_from_world():
    cfg = validate(load_config(None, ["parallel.tp=2"]), world_size=8)
    assert cfg.parallel.dp == 4


BAD = [
    # (overrides, world size, key named in the error, words in the message)
    (["model.hiden=3"], 1, "model.hiden", "did you mean 'model.hidden'"),
    (["modle.hidden=3"], 1, "modle", "unknown section -> did you mean 'model.hidden'?"),
    (["trainn.stepz=3"], 1, "trainn", "unknown section -> did you mean 'train'?"),
    (["zzz.q=3"], 1, "zzz", "`tessera config` lists every key"),
    (["checkpoint.save_every=5"], 1, "checkpoint.save_every", "checkpoint.dir is not"),
    (["checkpoint.dir=/tmp/x", "checkpoint.keep=-1"], 1, "checkpoint.keep", "negative"),
    (["model.hidden=big"], 1, "model.hidden", "not an int"),
    (["parallel.sequence_parallel=maybe"], 1, "parallel.sequence_parallel", "not a bool"),
    (["train.dtype=fp8"], 1, "train.dtype", "fp32, bf16, fp16"),
    (["model.family=bert"], 1, "model.family", "gpt2, llama"),
    (["parallel.tp=3"], 4, "parallel.tp", "does not divide the world size 4"),
    (["parallel.tp=2", "parallel.pp=3"], 4, "parallel.tp", "does not divide"),
    (["parallel.tp=2", "model.heads=3", "model.hidden=96"], 2, "model.heads", "not divisible by tp=2"),
    (["parallel.tp=4", "model.family=llama", "model.heads=8", "model.hidden=128", "model.kv_heads=2"], 4,
     "model.kv_heads", "not divisible by tp=4"),
    (["train.global_batch=10", "train.micro_batch=4"], 1, "train.global_batch", "micro_batch*dp"),
    (["train.global_batch=8", "train.micro_batch=4"], 4, "train.global_batch", "micro_batch*dp = 4*4"),
    (["parallel.tp=4", "parallel.sequence_parallel=true", "model.seq_len=18"], 4, "model.seq_len",
     "not divisible by tp=4"),
    (["parallel.dp=3"], 4, "parallel.dp", "not the world size"),
    (["model.dropout=1.5"], 1, "model.dropout", "not in [0, 1)"),
    (["optim.min_lr=1", "optim.lr=0.1"], 1, "optim.min_lr", "not in [0, optim.lr]"),
    (["model.hidden=100", "model.heads=3"], 1, "model.hidden", "not divisible by model.heads"),
    (["train.cuda_graphs=true", "parallel.pp=2"], 2, "train.cuda_graphs", "pp=2 keeps several in flight"),
    (["train.cuda_graphs=true", "parallel.schedule=gpipe"], 1, "train.cuda_graphs", "several forwards"),
    (["train.cuda_graphs=true", "model.dropout=0.1"], 1, "train.cuda_graphs", "dropout"),
    (["train.cuda_graphs=true", "data.reset_attention_mask=true", "data.eod_id=0"], 1, "train.cuda_graphs", "packed sequences"),
    (["train.cuda_graphs=true", "train.compile=true"], 1, "train.cuda_graphs", "run eagerly"),
    (["train.cuda_graphs=true", "train.grad_accum_fusion=true", "parallel.zero=2"], 1, "train.cuda_graphs",
     "zero=2 keeps each bucket's buffer"),
    (["train.cuda_graphs=true", "parallel.zero=3"], 2, "train.cuda_graphs", "zero=3 (FSDP)"),
    (["data.eod_id=256", "model.vocab_size=256"], 1, "data.eod_id", "outside model.vocab_size=256"),
    (["optim.lr=inf"], 1, "optim.lr", "inf is not a finite number"),
    (["optim.eps=nan"], 1, "optim.eps", "nan is not a finite number"),
    (["optim.eps=-1e-8"], 1, "optim.eps", "-1e-08 is not > 0"),
    (["train.timeout_s=1e13"], 1, "train.timeout_s", "not in [1, 1e9]"),
    (["train.timeout_s=0.1"], 1, "train.timeout_s", "not in [1, 1e9]"),
    (["optim.eps=0"], 1, "optim.eps", "0.0 is not > 0"),
    (["model.family=llama", "model.hidden=36", "model.heads=4"], 1, "model.hidden", "= 9 is odd; RoPE"),
    # accepted once, then NaN losses from the first step (eps, theta) or a torch error deep in init (std)
    (["model.norm_eps=-1e-5"], 1, "model.norm_eps", "is not positive"),
    (["model.norm_eps=0"], 1, "model.norm_eps", "is not positive"),
    (["model.norm_eps=1e-50"], 1, "model.norm_eps", "is not positive in fp32"),
    (["model.family=llama", "model.rope_theta=0"], 1, "model.rope_theta", "is not positive"),
    (["model.family=llama", "model.rope_theta=-10000"], 1, "model.rope_theta", "is not positive"),
    (["model.init_std=-0.02"], 1, "model.init_std", "is negative"),
    # accepted once, then a RuntimeError from FSDP: one process runs without a process group
    (["parallel.zero=3"], 1, "parallel.zero", "needs a process group"),
    # accepted once, then training on the builtin corpus instead of the datasets named
    (["data.paths=my-corpus_text_document"], 1, "data.paths", "data.source=builtin reads no datasets"),
    (["data.source=synthetic", "data.paths=0.5,a,0.5,b"], 1, "data.paths", "data.source=synthetic reads no"),
]


def test_cuda_graphs_accepts_what_it_can_capture():
    sp = ["parallel.tp=2", "parallel.sequence_parallel=true"]
    for sets, world in ((sp, 2), (sp + ["parallel.tp_comm_overlap=true"], 2), ([], 2),
                        (["parallel.zero=1", "parallel.overlap_param_gather=false"], 2), (["parallel.zero=1"], 1),
                        (["parallel.zero=1"], 2), (["parallel.zero=2"], 2)):  # gather hooks lifted for capture
        validate(load_config(None, ["train.cuda_graphs=true", *sets]), world)


def test_cuda_graphs_on_cpu_is_refused_before_any_work(monkeypatch):
    from tessera.training.trainer import train
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match="CUDA graphs need a CUDA device"):
        train(load_config(None, ["train.cuda_graphs=true", "train.device=cpu", "data.source=synthetic"]))


@pytest.mark.parametrize("overrides,world,key,words", BAD, ids=[b[2] + ":" + b[3][:20] for b in BAD])
def test_bad_config_is_refused_with_key_and_fix(overrides, world, key, words):
    with pytest.raises(ConfigError) as info:
        validate(load_config(None, overrides), world)
    assert info.value.key == key
    assert words in str(info.value)
    assert info.value.fix, "every error says how to fix it"


PIPELINE_BAD = [
    (["parallel.pp=4", "model.layers=2"], 4, "parallel.pp", "exceeds model.layers=2"),
    (["parallel.pp=2", "parallel.vpp=3", "model.layers=4", "parallel.pp_layout=even"], 2, "parallel.vpp",
     "not divisible by pp*vpp = 6"),
    (["parallel.pp=2", "parallel.vpp=3", "model.layers=4"], 2, "parallel.vpp", "6 virtual stages for 4 layers"),
    (["parallel.pp=2", "parallel.vpp=3", "model.layers=4"], 2, "parallel.vpp",
     "-> use at most model.layers=4 virtual stages: lower parallel.pp / parallel.vpp"),
    (["parallel.pp=2", "model.layers=5"], 2, "parallel.pp", "cannot be split into vpp=1 equal chunks"),
    (["parallel.pp=2", "parallel.pp_layout=1,2", "model.layers=4"], 2, "parallel.pp_layout", "sum to model.layers = 4"),
    (["parallel.pp=2", "parallel.pp_layout=2,2,0", "model.layers=4"], 2, "parallel.pp_layout", "3 entries"),
    (["parallel.pp=2", "parallel.pp_layout=1,2", "model.layers=4"], 2, "parallel.pp_layout",
     "-> give 2 layer counts (one per virtual stage, pp*vpp) that sum to model.layers=4"),
    (["optim.decay_style=wsd", "optim.warmup=20", "optim.wsd_decay_steps=5", "train.steps=20"], 1, "optim.warmup",
     "20 warmup steps leave no steps to decay"),
    (["parallel.pp=2", "parallel.pp_layout=a,b"], 2, "parallel.pp_layout", "not a comma-separated list"),
    (["parallel.pp=2", "parallel.schedule=none"], 2, "parallel.schedule", "needs pp=1"),
    (["parallel.pp=2", "parallel.schedule=1f1b", "parallel.vpp=2"], 2, "parallel.schedule", "use 'interleaved'"),
    (["parallel.pp=2", "parallel.schedule=interleaved"], 2, "parallel.schedule", "needs vpp >= 2"),
    (["parallel.vpp=2"], 1, "parallel.vpp", "vpp > 1 needs pp >= 2"),
    (["train.sample_tokens=5", "data.source=synthetic"], 1, "train.sample_tokenizer", "has no text"),
    (["train.sample_tokens=5", "train.sample_prompt="], 1, "train.sample_prompt", "encodes to no tokens"),
    (["train.sample_tokens=5", "train.sample_tokenizer=/nowhere/tok.json"], 1, "train.sample_tokenizer",
     "/nowhere/tok.json: no such file (a tokenizer.json or a folder holding one)"),
]


@pytest.mark.parametrize("overrides,world,key,words", PIPELINE_BAD, ids=[b[3][:24] for b in PIPELINE_BAD])
def test_bad_pipeline_layout_is_refused_before_training(overrides, world, key, words):
    with pytest.raises(ConfigError) as info:
        check_runnable(load_config(None, overrides), world)
    assert info.value.key == key
    assert words in str(info.value)


def test_fast_path_options_refused_where_they_cannot_act():
    cases = [(["parallel.zero=3", "train.grad_accum_fusion=true"], "no main_grad to fuse into"),
             (["parallel.schedule=zb-h1"], "with pp=1 there are none"),
             (["parallel.schedule=zb-h1", "parallel.pp=2", "parallel.zero=3"], "zb-h1 defers weight gradients"),
             (["train.fused_elementwise=true"], "compiles the llama family's RMSNorm")]
    for sets, message in cases:
        with pytest.raises(ConfigError, match=message):
            validate(load_config(None, sets), 2)


def test_a_broken_tokenizer_beside_the_data_is_a_config_error(tmp_path):
    import numpy as np

    from tessera.config import DataConfig
    from tessera.data import IndexedDatasetWriter, sample_tokenizer

    with IndexedDatasetWriter(tmp_path / "ds", np.uint16) as writer:
        writer.add_document(np.array([1, 2, 3]))
    data = DataConfig(source="indexed", paths=[str(tmp_path / "ds")])
    with pytest.raises(ConfigError, match=r"train.sample_tokenizer: .*ds\.tokenizer\.json \(`tessera preprocess`"):
        sample_tokenizer("", data, 512, "The ")
    (tmp_path / "ds.tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"train.sample_tokenizer: .*ds\.tokenizer\.json: not a Hugging Face"):
        sample_tokenizer("", data, 512, "The ")
