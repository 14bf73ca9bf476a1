"""Configuration: TOML + --set overrides, types checked, and every bad configuration refused
with one clear message that names the key (before any process group or model exists)."""

import contextlib
import subprocess
import sys

import pytest
import torch

from tessera.cli import main
from tessera.config import Config, ConfigError, load_config, validate


def test_defaults_and_contract_names():
    cfg = Config()
    for key in ["parallel.tp", "parallel.pp", "parallel.vpp", "parallel.dp", "parallel.sequence_parallel",
                "train.micro_batch", "train.global_batch", "train.steps", "train.seed", "train.dtype",
                "train.out_dir", "train.log_every", "model.family", "model.vocab_size", "model.hidden",
                "model.layers", "model.heads", "model.kv_heads", "model.ffn_hidden", "model.seq_len",
                "model.tie_embeddings", "model.dropout", "optim.lr", "optim.min_lr", "optim.warmup",
                "optim.weight_decay", "optim.clip_grad", "data.source"]:
        section, name = key.split(".")
        assert hasattr(getattr(cfg, section), name), key
    assert hasattr(cfg, "checkpoint")


def test_toml_and_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[model]\nfamily = "llama"\nhidden = 64\nheads = 4\nkv_heads = 2\n'
                    '[train]\ndtype = "bf16"\nsteps = 7\n[optim]\nlr = 1\n')
    cfg = load_config(path, ["model.layers=3", "parallel.sequence_parallel=true", "optim.min_lr=0.5",
                             "train.out_dir=x/y"])
    assert cfg.model.family == "llama" and cfg.model.hidden == 64 and cfg.model.kv_heads == 2
    assert cfg.model.layers == 3 and cfg.parallel.sequence_parallel is True
    assert cfg.train.dtype == "bf16" and cfg.train.steps == 7 and cfg.train.out_dir == "x/y"
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float) and cfg.optim.min_lr == 0.5


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


def test_bad_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="cannot read .* directory"):
        load_config(tmp_path)
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\nhidden=")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="must look like section.key=value"):
        load_config(None, ["hidden=3"])


def test_cli_prints_one_line_not_a_traceback(monkeypatch, capsys):
    # The check runs before any process group: a 4-rank launch fails the same way on every rank.
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    assert main(["train", "--set", "parallel.tp=3"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("tessera: config error: parallel.tp: tp*pp = 3*1 = 3 does not divide the world "
                           "size 4 -> choose tp and pp whose product divides 4, or launch a multiple of 3 processes")
    monkeypatch.setenv("RANK", "1")  # other ranks stay quiet but stop too
    assert main(["train", "--set", "parallel.tp=3"]) == 2
    assert capsys.readouterr().err == ""


BAD_HEADS = ["--set", "model.heads=3", "--set", "model.hidden=96", "--set", "parallel.tp=2"]
HEADS_MESSAGE = ("tessera: config error: model.heads: 3 heads are not divisible by tp=2 -> "
                 "choose heads as a multiple of parallel.tp")


@pytest.mark.timeout(120)
def test_torchrun_bad_config_stops_every_rank():
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "-m", "tessera", "train", *BAD_HEADS], capture_output=True, text=True, timeout=110)
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if line.startswith("tessera:")]
    assert ours == [HEADS_MESSAGE]  # once, from rank 0; no rank printed a traceback
    assert "[rank0]: Traceback" not in proc.stderr and "[rank1]: Traceback" not in proc.stderr


@pytest.mark.timeout(60)
def test_launcher_refuses_before_starting_processes():
    proc = subprocess.run([sys.executable, "-m", "tessera", "train", "--nproc-per-node", "2", *BAD_HEADS],
                          capture_output=True, text=True, timeout=50)
    assert proc.returncode == 2
    assert proc.stderr.strip() == HEADS_MESSAGE


def test_every_field_documented_and_reference_in_sync():
    from pathlib import Path

    from tessera.config import SECTIONS, field_docs, reference_markdown

    docs = field_docs()
    for section, cls in SECTIONS.items():
        for f in __import__("dataclasses").fields(cls):
            assert docs.get(f"{section}.{f.name}"), f"{section}.{f.name} has no docstring"
    path = Path(__file__).parent.parent / "docs" / "configuration.md"
    assert path.read_text().strip() == reference_markdown().strip(), \
        "docs/configuration.md is stale: run `python -m tessera config > docs/configuration.md`"


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
    from tessera.training.trainer import check_runnable

    with pytest.raises(ConfigError) as info:
        check_runnable(load_config(None, overrides), world)
    assert info.value.key == key
    assert words in str(info.value)


def test_auto_schedule_is_the_fastest_valid_one():
    from tessera.training.trainer import choose_schedule

    assert choose_schedule("auto", 1, 1, 4) == "none"
    assert choose_schedule("auto", 2, 2, 4) == "interleaved-zb"  # measured faster than interleaved (session 9)
    assert choose_schedule("auto", 2, 2, 4, zero=2) == "interleaved"  # zero=2 reduces before the deferred W's
    assert choose_schedule("auto", 2, 1, 8, zero=2) == "1f1b"
    assert choose_schedule("auto", 4, 1, 8) == "zb-h1"
    assert choose_schedule("1f1b", 4, 1, 8) == "1f1b"


def test_fast_path_options_refused_where_they_cannot_act():
    from tessera.config import ConfigError, load_config, validate
    cases = [(["parallel.zero=3", "train.grad_accum_fusion=true"], "no main_grad to fuse into"),
             (["parallel.schedule=zb-h1"], "with pp=1 there are none"),
             (["parallel.schedule=zb-h1", "parallel.pp=2", "parallel.zero=3"], "zb-h1 defers weight gradients"),
             (["train.fused_elementwise=true"], "compiles the llama family's RMSNorm")]
    for sets, message in cases:
        with pytest.raises(ConfigError, match=message):
            validate(load_config(None, sets), 2)


@pytest.mark.parametrize("given,expected", [("true", "true"), ("True", "true"), ("1", "true"), ("yes", "true"),
                                            ("false", "false"), ("0", "false"), ("auto", "auto")])
def test_compile_takes_what_a_bool_takes(given, expected):
    from tessera.config import load_config
    assert load_config(None, [f"train.compile={given}"]).train.compile == expected



def test_fast_paths_auto_resolve_by_device_layout_and_schedule():
    """(compiled, fused weight gradients, CUDA-graphed layers) as trainer.fast_paths resolves
    them for a validated configuration."""
    import torch
    from tessera.config import load_config
    from tessera.training.trainer import fast_paths
    cuda, cpu = torch.device("cuda"), torch.device("cpu")

    def resolved(sets, schedule="none", device=cuda):
        cfg = load_config(None, sets)
        p = cfg.parallel
        return fast_paths(validate(cfg, p.tp * p.pp * max(p.dp, 1)), schedule, device)

    assert resolved([]) == (False, True, False)  # GPT at tp=1: fused weight gradients, eager layers
    assert resolved(["model.family=llama"]) == (True, True, False)  # llama at tp=1: compiled layers, fused W
    assert resolved(["model.family=llama"], "1f1b") == (True, True, False)
    assert resolved(["model.family=llama", "parallel.dp=2", "parallel.zero=1"]) == (True, True, False)
    assert resolved(["model.family=llama", "parallel.dp=2", "parallel.zero=3"]) == (True, False, False)  # FSDP: no fusion
    assert resolved(["model.family=llama", "parallel.pp=2"], "zb-h1") == (False, True, False)  # no graph breaks around deferred W
    # tp > 1: graphed eager layers where they can be captured; fusion measured slower, compiled slower
    assert resolved(["parallel.tp=2"]) == (False, False, True)
    assert resolved(["parallel.tp=2", "parallel.sequence_parallel=true", "model.family=llama"]) == (False, False, True)
    assert resolved(["parallel.tp=2", "model.dropout=0.1"]) == (False, False, False)  # not capturable: eager
    assert resolved(["parallel.tp=2", "parallel.pp=2"], "1f1b") == (False, False, False)
    # graphs with the overlapped gather's hooks lifted for capture (GPU test passed, session 12)
    assert resolved(["parallel.tp=2", "parallel.dp=2", "parallel.zero=1"]) == (False, False, True)
    assert resolved(["parallel.tp=2", "parallel.dp=2", "parallel.zero=2"]) == (False, False, True)
    assert resolved(["parallel.tp=2", "parallel.dp=2", "parallel.zero=3"]) == (False, False, False)  # gather-and-free hooks
    assert resolved(["parallel.tp=2", "parallel.dp=2", "parallel.zero=1", "train.cuda_graphs=true"]) \
        == (False, False, True)
    assert resolved(["parallel.tp=2", "parallel.dp=2", "parallel.zero=1", "parallel.overlap_param_gather=false"]) \
        == (False, False, True)
    assert resolved(["parallel.tp=2", "train.cuda_graphs=false"]) == (False, False, False)
    # the backward comm overlap: auto with graphed layers only; explicit choices stand
    from tessera.training.trainer import tp_comm_overlap
    for sets, device, on in ((["parallel.tp=2"], cuda, True), (["parallel.tp=2"], cpu, False),
                             (["parallel.tp=2", "train.cuda_graphs=false"], cuda, False),
                             (["parallel.tp=2", "train.compile=true"], cuda, False), ([], cuda, False),
                             (["parallel.tp=2", "parallel.tp_comm_overlap=true"], cpu, True),
                             (["parallel.tp=2", "parallel.tp_comm_overlap=false"], cuda, False)):
        cfg = load_config(None, sets)
        assert tp_comm_overlap(cfg, resolved(sets, device=device)[2]) is on, (sets, device)
    assert resolved(["parallel.tp=2", "parallel.tp_comm_overlap=true"]) == (False, False, True)  # GPU test passed (session 9)
    assert resolved(["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.tp_comm_overlap=true"]) \
        == (False, False, True)
    # fused weight gradients asked for at tp > 1: captured in the graphs (opt-in until measured)
    assert resolved(["parallel.tp=2", "train.grad_accum_fusion=true"]) == (False, True, True)
    assert resolved(["train.cuda_graphs=true", "train.grad_accum_fusion=true"]) == (False, True, True)
    assert resolved(["parallel.tp=2", "train.grad_accum_fusion=true", "parallel.zero=2"]) == (False, True, False)
    assert resolved(["parallel.tp=2", "train.compile=true"]) == (True, False, False)
    assert resolved(["parallel.dp=2"]) == (False, True, False)
    assert resolved(["parallel.pp=2"], "zb-h1") == (False, True, False)
    assert resolved(["parallel.dp=2", "parallel.zero=3"]) == (False, False, False)
    assert resolved(["model.family=llama", "train.grad_accum_fusion=true"]) == (True, True, False)
    assert resolved(["model.family=llama", "train.grad_accum_fusion=false"]) == (True, False, False)
    assert resolved(["train.compile=true"]) == (True, False, False)
    assert resolved(["train.compile=true", "train.grad_accum_fusion=true"]) == (True, True, False)
    assert resolved(["train.compile=false", "train.grad_accum_fusion=false"]) == (False, False, False)
    assert resolved(["train.cuda_graphs=true"]) == (False, False, True)  # graphed layers: eager, autograd weight grads
    assert resolved(["train.cuda_graphs=true", "model.family=llama"]) == (False, False, True)
    for sets in ([], ["parallel.tp=2"], ["model.family=llama"]):
        assert resolved(sets, device=cpu) == (False, False, False)
    assert resolved(["train.compile=true", "train.grad_accum_fusion=true"], device=cpu) == (True, True, False)


def test_graphed_layer_call_refuses_what_its_graph_cannot_replay():
    """The wrapper around a graphed layer (no CUDA needed to check it): in training the model's
    empty PackedSequence passes, packed positions and another input shape or dtype are refused
    (the graph would broadcast or cast into its static input); eval runs the layer's own forward."""
    import torch

    from tessera.models.packed import PackedSequence
    from tessera.training.cuda_graphs import _accept_unpacked_sequence

    class Twice(torch.nn.Module):
        def forward(self, x, seq=None):
            return 2 * x if seq is None or seq.position_ids is None else 3 * x

    layer = Twice()
    _accept_unpacked_sequence(layer, torch.Size([4, 2, 8]), torch.float32)
    x = torch.ones(4, 2, 8)
    assert torch.equal(layer(x, PackedSequence()), 2 * x) and torch.equal(layer(x), 2 * x)
    with pytest.raises(ValueError, match="unpacked sequences only"):
        layer(x, PackedSequence(position_ids=torch.zeros(2, 4, dtype=torch.long)))
    with pytest.raises(ValueError, match=r"captured for \(4, 2, 8\) torch.float32 inputs, got \(4, 1, 8\)"):
        layer(torch.ones(4, 1, 8))
    with pytest.raises(ValueError, match="got \\(4, 2, 8\\) torch.bfloat16"):
        layer(x.bfloat16())
    layer.eval()  # the layer's own forward, packed sequences included
    assert layer(torch.ones(3, 1, 8)).shape == (3, 1, 8)
    assert torch.equal(layer(x, PackedSequence(position_ids=torch.zeros(2, 4, dtype=torch.long))), 3 * x)


def test_released_layer_graphs_restore_the_eager_forward_and_free_each_graph_once():
    """LayerGraphs.release (run by the trainer before the process group goes: a live graph with
    captured NCCL work hangs destroy_process_group) puts the layer's own forward back and resets
    every graph it was given, once."""
    import torch

    from tessera.training.cuda_graphs import LayerGraphs, _accept_unpacked_sequence

    class Twice(torch.nn.Module):
        def forward(self, x, seq=None):
            return 2 * x

    class Graph:
        resets = 0

        def reset(self):
            self.resets += 1

    layer, graphs = Twice(), [Graph(), Graph()]
    _accept_unpacked_sequence(layer, torch.Size([4, 2, 8]), torch.float32)
    with pytest.raises(ValueError, match="captured for"):
        layer(torch.ones(3, 2, 8))
    handle = LayerGraphs([layer], graphs)
    handle.release()
    handle.release()
    assert [g.resets for g in graphs] == [1, 1]
    assert layer(torch.ones(3, 2, 8)).shape == (3, 2, 8) and "forward" not in layer.__dict__



def test_layer_graphs_are_freed_even_when_the_device_sync_fails(monkeypatch):
    """A sticky CUDA error in release's synchronize must not leave the graphs alive."""
    import torch

    from tessera.training.cuda_graphs import LayerGraphs

    class Graph:
        resets = 0

        def reset(self):
            self.resets += 1

    def failing_sync():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", failing_sync)
    graphs = [Graph(), Graph()]
    with pytest.raises(RuntimeError, match="illegal memory access"):
        LayerGraphs([], graphs).release()
    assert [g.resets for g in graphs] == [1, 1]


def test_trainer_releases_the_layer_graphs_after_training_and_after_an_error(monkeypatch, tmp_path):
    """Whatever ends the run, the trainer frees the captured graphs before returning (the CLI
    then destroys the process group, which hangs while graphs with NCCL work live). Capture is
    stood in for on CPU; the GPU tests run the real one."""
    from tessera.training import trainer

    log = []

    class Recorded:
        released = 0

        def release(self):
            Recorded.released += 1
            log.append("released")

    @contextlib.contextmanager
    def step_stream(device):  # (the capture and the steps run on a stream of their own)
        log.append("stream")
        try:
            yield
        finally:
            log.append("stream put back")

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(trainer, "fast_paths", lambda cfg, schedule, device: (False, False, True))
    monkeypatch.setattr(trainer, "step_stream", step_stream)
    monkeypatch.setattr(trainer, "graph_stage",
                        lambda chunks, cfg, data_parallel=None, fused=False: log.append("captured") or [Recorded()])
    sets = ["train.device=cpu", "data.source=synthetic", "model.layers=2", "model.hidden=32", "model.heads=2",
            "model.seq_len=16", "model.vocab_size=64", "train.steps=2", "train.micro_batch=1",
            "train.global_batch=2", "train.sample_tokens=0", f"train.out_dir={tmp_path}"]
    history = trainer.train(load_config(None, sets))
    assert len(history) == 2 and Recorded.released == 1
    assert log == ["stream", "captured", "released", "stream put back"]
    assert all(m["step_time_s"] > 0 for m in history)  # the real step on the host clock

    def broken(*args):
        raise RuntimeError("a step failed")

    monkeypatch.setattr(trainer, "_run", broken)
    with pytest.raises(RuntimeError, match="a step failed"):
        trainer.train(load_config(None, sets))
    assert Recorded.released == 2 and log[4:] == ["stream", "captured", "released", "stream put back"]

    class Failing(Recorded):  # (a CUDA error in its synchronize)
        def release(self):
            super().release()
            raise RuntimeError("a release failed")

    # two sets: the second is released although the first's release failed
    monkeypatch.setattr(trainer, "graph_stage", lambda chunks, cfg, data_parallel=None, fused=False: [Failing(), Recorded()])
    monkeypatch.setattr(trainer, "_run", lambda *args: [])
    with pytest.raises(RuntimeError, match="a release failed"):
        trainer.train(load_config(None, sets))
    assert Recorded.released == 4


def test_trainer_reads_each_step_after_launching_the_next(monkeypatch, tmp_path):
    """The host never waits for step k before step k+1 is queued: the trainer reads a step's
    figures (which waits for its GPU work) only after launching the next, and still logs every
    step with its own learning rate."""
    from tessera.training import trainer

    events = []

    class Result:
        skipped, ready = False, None

        def __init__(self, step):
            self.step, self.finished_at = step, float(step + 1)  # each step "took" one second

        @property
        def tokens(self):
            events.append(f"read {self.step}")
            return 4

        loss = 1.0
        grad_norm = 0.5

    def fake_step(optimizer, micro_batches, *args, **kwargs):
        step = sum(e.startswith("launch") for e in events)
        events.append(f"launch {step}")
        return Result(step)

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(trainer, "train_step", fake_step)
    sets = ["train.device=cpu", "data.source=synthetic", "model.layers=1", "model.hidden=32", "model.heads=2",
            "model.seq_len=16", "model.vocab_size=64", "train.steps=3", "train.micro_batch=1",
            "train.global_batch=2", "train.sample_tokens=0", "optim.warmup=3", f"train.out_dir={tmp_path}"]
    history = trainer.train(load_config(None, sets))
    assert events == ["launch 0", "launch 1", "read 0", "launch 2", "read 1", "read 2"]
    assert [m["step"] for m in history] == [1, 2, 3]
    assert [m["step_time_s"] for m in history[1:]] == [1.0, 1.0]  # from one step's end to the next's
    assert history[0]["lr"] < history[1]["lr"] < history[2]["lr"]  # warm-up: each step logs its own


def test_a_failing_step_still_logs_the_step_before_it(monkeypatch, tmp_path):
    """Step k is read after step k+1 is launched; if that launch fails, step k's line is
    written before the error goes up."""
    import json

    from tessera.training import trainer

    class Result:
        skipped, ready, loss, grad_norm, tokens = False, None, 1.0, 0.5, 4

        def __init__(self, step):
            self.finished_at = float(step + 1)

    launches = []

    def fake_step(*args, **kwargs):
        launches.append(len(launches))
        if len(launches) == 3:
            raise RuntimeError("step 3 failed")
        return Result(len(launches) - 1)

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(trainer, "train_step", fake_step)
    sets = ["train.device=cpu", "data.source=synthetic", "model.layers=1", "model.hidden=32", "model.heads=2",
            "model.seq_len=16", "model.vocab_size=64", "train.steps=5", "train.micro_batch=1",
            "train.global_batch=2", "train.sample_tokens=0", f"train.out_dir={tmp_path}"]
    with pytest.raises(RuntimeError, match="step 3 failed"):
        trainer.train(load_config(None, sets))
    logged = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1, 2]


def test_released_graphs_give_their_fused_weights_back_to_eager_counting():
    """After LayerGraphs.release (end of training, a failed capture) the layers' weights leave
    DataParallel.graph_fused: an eager backward must count their gradients again."""
    import types

    import torch

    from tessera.training.cuda_graphs import LayerGraphs

    layer, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    dp = types.SimpleNamespace(graph_fused={layer.weight, layer.bias, other.weight})
    LayerGraphs([layer], [], dp).release()
    assert dp.graph_fused == {other.weight}


def test_graph_stage_releases_what_it_captured_when_a_later_chunk_fails(monkeypatch):
    """A capture that fails part-way frees the graphs already taken (they would hang the
    process group's destruction) and raises."""
    from tessera.config import load_config
    from tessera.training import cuda_graphs

    released = []

    class Taken:
        def release(self):
            released.append(self)

    calls = []

    def capture(chunk, micro_batch, seq_len, data_parallel=None, fused=False):
        calls.append((micro_batch, seq_len))
        if len(calls) == 2:
            raise RuntimeError("capture failed")
        return Taken()

    monkeypatch.setattr(cuda_graphs, "graph_layers", capture)
    cfg = load_config(None, ["parallel.tp=2", "parallel.sequence_parallel=true", "model.seq_len=64",
                             "train.micro_batch=2"])
    with pytest.raises(RuntimeError, match="capture failed"):
        cuda_graphs.graph_stage(["chunk0", "chunk1"], cfg)
    assert calls == [(2, 32), (2, 32)] and len(released) == 1  # per-rank sequence under SP


def test_a_broken_tokenizer_beside_the_data_is_a_config_error(tmp_path):
    from tessera.data import IndexedDatasetWriter, sample_tokenizer
    from tessera.config import DataConfig

    import numpy as np

    with IndexedDatasetWriter(tmp_path / "ds", np.uint16) as writer:
        writer.add_document(np.array([1, 2, 3]))
    data = DataConfig(source="indexed", paths=[str(tmp_path / "ds")])
    with pytest.raises(ConfigError, match=r"train.sample_tokenizer: .*ds\.tokenizer\.json \(`tessera preprocess`"):
        sample_tokenizer("", data, 512, "The ")
    (tmp_path / "ds.tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"train.sample_tokenizer: .*ds\.tokenizer\.json: not a Hugging Face"):
        sample_tokenizer("", data, 512, "The ")


def test_more_local_ranks_than_gpus_refused(monkeypatch):
    """Local rank 2 on a machine with 2 GPUs does not wrap onto GPU 0 (two ranks on one GPU);
    with one visible GPU (a launcher gave each process its own), every local rank takes it."""
    from tessera.training import launch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    assert launch.pick_device("auto", 1) == torch.device("cuda", 1)
    with pytest.raises(RuntimeError, match=r"local rank 2 \(LOCAL_RANK\) but sees 2 CUDA devices.*--nproc-per-node"):
        launch.pick_device("cuda", 2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # each process given its own GPU
    assert launch.pick_device("cuda", 3) == torch.device("cuda", 0)


def test_cuda_device_without_cuda_is_a_config_error(monkeypatch, capsys):
    """train.device=cuda on a machine without CUDA: the CLI's one line naming the key, status 2
    (it was a RuntimeError traceback on every rank)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert main(["train", "--set", "train.device=cuda", "--set", "data.source=synthetic"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tessera: config error: train.device: ") and len(err.splitlines()) == 1


def test_a_choice_of_the_wrong_toml_type_lists_the_choices(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[train]\ncompile = 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(path), [])
    assert info.value.key == "train.compile" and info.value.fix == "choose one of auto, true, false"
