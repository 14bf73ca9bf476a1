"""Configuration: TOML + --set overrides, every value checked against its field's type, unknown
and removed keys named, the reference in sync with the dataclasses, and a bad configuration
stopping every rank with one line (the CLI)."""

import subprocess
import sys
import time

import pytest
import torch

from tessera.cli import main
from tessera.config import Config, ConfigError, load_config


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
    monkeypatch.setenv("RANK", "1")  # other ranks stay quiet but stop too, after giving rank 0 3 s to say it
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    assert main(["train", "--set", "parallel.tp=3"]) == 2
    assert capsys.readouterr().err == "" and slept == [3]


BAD_HEADS = ["--set", "model.heads=3", "--set", "model.hidden=96", "--set", "parallel.tp=2"]


HEADS_MESSAGE = ("tessera: config error: model.heads: 3 heads are not divisible by tp=2 -> "
                 "choose heads as a multiple of parallel.tp")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_torchrun_bad_config_stops_every_rank():
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "-m", "tessera", "train", *BAD_HEADS], capture_output=True, text=True, timeout=110)
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if line.startswith("tessera:")]
    assert ours == [HEADS_MESSAGE]  # once, from rank 0; no rank printed a traceback
    assert "[rank0]: Traceback" not in proc.stderr and "[rank1]: Traceback" not in proc.stderr


@pytest.mark.timeout(60)
def test_launcher_refuses_before_starting_processes(capsys):
    # (in this process: had the refusal not come first, main would have started torchrun)
    assert main(["train", "--nproc-per-node", "2", *BAD_HEADS]) == 2
    assert capsys.readouterr().err.strip() == HEADS_MESSAGE


def test_every_field_documented_and_reference_in_sync():
    from pathlib import Path

    from tessera.config import SECTIONS
    from tessera.config.reference import field_docs, reference_markdown

    docs = field_docs()
    for section, cls in SECTIONS.items():
        for f in __import__("dataclasses").fields(cls):
            assert docs.get(f"{section}.{f.name}"), f"{section}.{f.name} has no docstring"
    path = Path(__file__).parent.parent / "docs" / "configuration.md"
    assert path.read_text().strip() == reference_markdown().strip(), \
        "docs/configuration.md is stale: run `python -m tessera config > docs/configuration.md`"


@pytest.mark.parametrize("given,expected", [("true", True), ("True", True), ("1", True), ("yes", True),
                                            ("false", False), ("0", False), ("no", False), ("auto", "auto"),
                                            ("AUTO", "auto")])
def test_a_switch_takes_what_a_bool_takes_or_auto(given, expected):
    assert load_config(None, [f"train.compile={given}"]).train.compile is expected or \
        load_config(None, [f"train.compile={given}"]).train.compile == expected == "auto"


def test_a_switch_in_toml_is_a_boolean_or_auto(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[train]\ncompile = true\ncuda_graphs = "auto"\ngrad_accum_fusion = false\n')
    t = load_config(path).train
    assert t.compile is True and t.cuda_graphs == "auto" and t.grad_accum_fusion is False


def test_a_removed_key_says_why_it_went():
    for key, words in (("parallel.tp_microbatch_pairs=true", "could hang"), ("parallel.tp_async=p2p", "slower"),
                       ("train.gc_interval=5", "cost more than it saved"),
                       ("parallel.grad_reduce_dtype=bf16", "train.grad_dtype=bf16")):
        with pytest.raises(ConfigError, match=words) as info:
            load_config(None, [key])
        assert info.value.key == key.split("=")[0] and info.value.fix == "delete the setting"
    with pytest.raises(ConfigError, match="parallel.schedule: zb-h2 was removed: it measured slower than zb-h1"):
        load_config(None, ["parallel.schedule=zb-h2"])


def test_an_earlier_runs_config_toml_still_loads(tmp_path):
    """Every run writes its whole config; one written before options were removed holds them at
    the values that asked for nothing, and loads."""
    path = tmp_path / "config.toml"
    path.write_text('[parallel]\ntp_microbatch_pairs = "auto"\ntp_pairs_backward = "threads"\ntp_async = "false"\n'
                    'grad_reduce_dtype = "fp32"\n[train]\ngc_interval = 0\ncompile = "auto"\nsteps = 3\n')
    assert load_config(path).train.steps == 3
    path.write_text('[train]\ngc_interval = 10\n')
    with pytest.raises(ConfigError, match="train.gc_interval: removed"):
        load_config(path)


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
    assert info.value.key == "train.compile" and info.value.fix == "choose true, false or auto"


@pytest.mark.parametrize("key, value", [("data.cache_dir", "file:///tmp/cache"), ("train.out_dir", "s3://b/runs"),
                                        ("train.sample_tokenizer", "s3://b/tokenizer.json")])
def test_a_url_where_tessera_takes_local_paths_is_refused_in_words(key, value):
    """s3://b/runs would otherwise be a local folder named "s3:" (Python's file functions); checkpoints
    and datasets take URLs (tests/test_object_storage.py)."""
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{key}={value}"])
    assert e.value.key == key and "is a URL; tessera reads and writes local (or mounted) paths there" in e.value.problem
