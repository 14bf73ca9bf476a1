"""Hugging Face transformers interchange (checkpoint/hf.py): tessera's GPT-2 and Llama compute what
transformers' GPT2LMHeadModel and LlamaForCausalLM compute on the same weights, both ways: a
trained checkpoint exported to a transformers folder, and a transformers folder imported as a
checkpoint that a run starts from (``checkpoint.finetune``)."""

from __future__ import annotations

import contextlib
import io
import subprocess

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tessera.config import ConfigError, ModelConfig, load_config  # noqa: E402
from tessera.models import GPTModel  # noqa: E402
from parity import tessera_model  # noqa: E402

MODELS = {
    "gpt2": ["model.family=gpt2", "model.hidden=32", "model.layers=2", "model.heads=4", "model.seq_len=16",
             "model.vocab_size=100"],
    "llama": ["model.family=llama", "model.hidden=32", "model.layers=2", "model.heads=4", "model.kv_heads=2",
              "model.seq_len=16", "model.vocab_size=100", "model.tie_embeddings=false", "model.norm_eps=1e-6",
              "model.rope_theta=500000"],
}


def same_logits(ours: GPTModel, theirs, vocab: int) -> None:
    tokens = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = theirs(tokens).logits
        got = ours.full_logits(tokens)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def tessera(*argv) -> subprocess.CompletedProcess:
    """``tessera ARGV`` in this process (``cli.main``): its exit status and what it printed."""
    from tessera.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def cli(*args) -> subprocess.CompletedProcess:
    return tessera("checkpoint", *args)


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("family", list(MODELS))
def test_a_trained_checkpoint_exports_to_transformers(tmp_path, family):
    from tessera.training.trainer import train

    train(load_config(None, MODELS[family] + ["train.steps=3", "train.micro_batch=2", "train.global_batch=4",
                                               "data.source=synthetic", f"checkpoint.dir={tmp_path}/ck",
                                               f"train.out_dir={tmp_path}/out"]))
    done = cli("export", f"{tmp_path}/ck", "--hf", f"{tmp_path}/hf")
    assert done.returncode == 0, done.stderr
    theirs = transformers.AutoModelForCausalLM.from_pretrained(f"{tmp_path}/hf").eval()
    assert type(theirs).__name__ == ("GPT2LMHeadModel" if family == "gpt2" else "LlamaForCausalLM")
    same_logits(tessera_model(f"{tmp_path}/ck/step_00000003"), theirs, 100)
    # bf16: the same weights rounded
    assert cli("export", f"{tmp_path}/ck", "--hf", f"{tmp_path}/hf16", "--dtype", "bf16").returncode == 0
    half = transformers.AutoModelForCausalLM.from_pretrained(f"{tmp_path}/hf16", dtype=torch.bfloat16)
    assert next(half.parameters()).dtype == torch.bfloat16


def _hf_model(family: str):
    torch.manual_seed(1)
    if family == "gpt2":
        config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=16, vocab_size=100,
                                         bos_token_id=None, eos_token_id=None)
        return transformers.GPT2LMHeadModel(config).eval()
    config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=64, vocab_size=100, max_position_embeddings=16,
                                      rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None,
                                      eos_token_id=None, pad_token_id=None)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("family", list(MODELS))
def test_a_transformers_model_imports_and_a_run_starts_from_it(tmp_path, family):
    from tessera.training.preflight import check_runnable
    from tessera.training.trainer import train

    theirs = _hf_model(family)
    with torch.no_grad():  # (random biases and norms: a mapping that mixes them up shows)
        for p in theirs.parameters():
            if p.ndim == 1:
                p.normal_(0.0, 0.1).add_(1.0 if p.shape[0] == 32 else 0.0)
    theirs.save_pretrained(tmp_path / "hf", safe_serialization=True)
    done = cli("import", f"{tmp_path}/hf", "--out", f"{tmp_path}/ck")
    assert done.returncode == 0, done.stderr
    same_logits(tessera_model(f"{tmp_path}/ck/step_00000000"), theirs, 100)
    # the printed settings start a fine-tune from it; without checkpoint.finetune it is refused
    flags = done.stdout.split("start a run from it with: ")[1].splitlines()[0].split()
    sets = [flags[i + 1] for i in range(0, len(flags), 2)]
    assert f"checkpoint.load={tmp_path}/ck/step_00000000" in sets  # (the folder itself: --out may hold others)
    base = sets + ["train.steps=2", "train.micro_batch=2", "train.global_batch=4", "data.source=synthetic",
                   f"train.out_dir={tmp_path}/out", f"checkpoint.dir={tmp_path}/ft", "train.log_every=1"]
    with pytest.raises(ConfigError, match="holds a model's weights only"):
        check_runnable(load_config(None, [s for s in base if s != "checkpoint.finetune=true"]), 1)
    history = train(load_config(None, base))
    fresh = train(load_config(None, [s for s in base if not s.startswith("checkpoint.")]
                              + [f"train.out_dir={tmp_path}/fresh"]))
    assert history[0]["loss"] != fresh[0]["loss"]  # it started from the imported weights
    # and its loss is the imported model's on the first batch (transformers' own figure)
    from tessera.training.data_feed import build_source
    rows = torch.stack([torch.from_numpy(build_source(load_config(None, base))[i].astype("int64")) for i in range(4)])
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(theirs(rows[:, :-1]).logits.reshape(-1, 100), rows[:, 1:].reshape(-1))
    assert history[0]["loss"] == pytest.approx(want.item(), rel=1e-5)


@pytest.mark.slow
def test_import_refuses_what_it_cannot_read(tmp_path):
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text('{"model_type": "bert"}')
    (tmp_path / "bert" / "model.safetensors").write_bytes(b"")
    done = cli("import", f"{tmp_path}/bert", "--out", f"{tmp_path}/ck")
    assert done.returncode == 2 and "tessera reads gpt2 and llama models" in done.stderr, done.stderr
    done = cli("export", f"{tmp_path}/nowhere", "--hf", f"{tmp_path}/hf")
    assert done.returncode == 2 and "neither a checkpoint" in done.stderr, done.stderr


def test_import_refuses_models_tessera_does_not_compute(tmp_path):
    """Settings of another computation, or weights with no place in tessera's model, are refused
    (never dropped: the logits would be silently wrong); a base model's unprefixed names are read."""
    from tessera.checkpoint import hf

    cases = {
        "attention_bias": ({"attention_bias": True}, "attention_bias = True"),
        "mlp_bias": ({"mlp_bias": True}, "mlp_bias = True"),
        "gelu": ({"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
        "old rope scaling": ({"rope_scaling": {"type": "linear", "factor": 4.0}}, "RoPE scaling 'linear'"),
    }
    llama = _hf_model("llama").config.to_dict()
    for name, (change, words) in cases.items():
        with pytest.raises(ValueError, match=words):
            hf.model_settings(llama | change)
    assert hf.model_settings(llama | {"head_dim": None})["hidden"] == 32
    gpt2 = _hf_model("gpt2").config.to_dict()
    for change, words in (({"activation_function": "relu"}, "activation_function = 'relu'"),
                          ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx")):
        with pytest.raises(ValueError, match=words):
            hf.model_settings(gpt2 | change)
    # GPT-2's exact (erf) GELU is model.gelu=exact, both ways
    assert hf.model_settings(gpt2 | {"activation_function": "gelu"})["gelu"] == "exact"
    assert hf.hf_config(ModelConfig(gelu="exact"))["activation_function"] == "gelu"
    # weights with no place: refused; a base model's names (no "transformer." prefix): read
    model = _hf_model("gpt2")
    settings = ModelConfig(**hf.model_settings(model.config.to_dict()))
    state = model.state_dict()
    with pytest.raises(ValueError, match="no place for"):
        hf.from_hf(state | {"transformer.h.0.attn.extra.weight": torch.zeros(1)}, settings)
    base = {k.removeprefix("transformer."): v for k, v in state.items() if k != "lm_head.weight"}
    whole = hf.from_hf(base, settings)
    assert torch.equal(whole["embedding.weight"], state["transformer.wte.weight"])


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_an_export_carries_the_datas_tokenizer(tmp_path):
    """A run on `tessera preprocess`'d text: the export holds its tokenizer, which transformers'
    AutoTokenizer reads as the same ids, with the end-of-document token as eos."""
    import json

    import pydoc_data.topics
    from tokenizers import Tokenizer

    from tessera.training.trainer import train

    texts = list(pydoc_data.topics.topics.values())[:30]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    done = tessera("preprocess", "--input", str(tmp_path / "docs.jsonl"), "--tokenizer", "bpe:300", "--output-prefix",
                   str(tmp_path / "docs"), "--no-progress")
    assert done.returncode == 0, done.stderr
    train(load_config(None, MODELS["gpt2"] + ["train.steps=2", "train.micro_batch=2", "train.global_batch=4",
                                              "data.source=indexed", f"data.paths={tmp_path / 'docs'}", "data.split=1,0,0",
                                              "model.vocab_size=300", f"checkpoint.dir={tmp_path}/ck",
                                              f"train.out_dir={tmp_path}/out"]))
    done = cli("export", f"{tmp_path}/ck", "--hf", f"{tmp_path}/hf")
    assert done.returncode == 0 and "its tokenizer from" in done.stdout, done.stdout + done.stderr
    ours = Tokenizer.from_file(str(tmp_path / "docs.tokenizer.json"))
    theirs = transformers.AutoTokenizer.from_pretrained(f"{tmp_path}/hf")
    text = "The object of the loop statement"
    assert theirs(text)["input_ids"] == ours.encode(text).ids
    eod = json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"]
    assert eod is not None and theirs.eos_token_id == eod == ours.token_to_id(theirs.eos_token)
    model = transformers.AutoModelForCausalLM.from_pretrained(f"{tmp_path}/hf")
    assert model.config.eos_token_id == eod
    # a folder holding it is taken too; one with more ids than the model is refused
    import shutil
    (tmp_path / "tokdir").mkdir()
    shutil.copyfile(tmp_path / "docs.tokenizer.json", tmp_path / "tokdir" / "tokenizer.json")
    assert cli("export", f"{tmp_path}/ck", "--hf", f"{tmp_path}/hf3", "--tokenizer", f"{tmp_path}/tokdir").returncode == 0
    assert (tmp_path / "hf3" / "tokenizer.json").exists()
    big = tessera("preprocess", "--input", str(tmp_path / "docs.jsonl"), "--tokenizer", "bpe:400", "--output-prefix",
                  str(tmp_path / "big"), "--no-progress")
    assert big.returncode == 0, big.stderr
    done = cli("export", f"{tmp_path}/ck", "--hf", f"{tmp_path}/hf4", "--tokenizer", f"{tmp_path}/big.tokenizer.json")
    assert done.returncode == 2 and "has 400 ids, the model 300" in done.stderr, done.stderr
    # synthetic tokens have no tokenizer: said, the weights written all the same
    train(load_config(None, MODELS["gpt2"] + ["train.steps=1", "train.micro_batch=2", "train.global_batch=4",
                                              "data.source=synthetic", f"checkpoint.dir={tmp_path}/ck2",
                                              f"train.out_dir={tmp_path}/out2"]))
    done = cli("export", f"{tmp_path}/ck2", "--hf", f"{tmp_path}/hf2")
    assert done.returncode == 0 and "no tokenizer" in done.stdout and not (tmp_path / "hf2" / "tokenizer.json").exists()


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_an_export_from_elsewhere_writes_the_weights_and_says_where_it_looked(tmp_path, monkeypatch):
    """A run's tokenizer named relative to where it ran, exported from another folder: the
    weights are written and the line says where the tokenizer was looked for."""
    import json

    from tessera.training.trainer import train

    (tmp_path / "run").mkdir()
    monkeypatch.chdir(tmp_path / "run")
    texts = ["some text here", "and more text there"] * 20
    (tmp_path / "run" / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    done = tessera("preprocess", "--input", "docs.jsonl", "--tokenizer", "bpe:280", "--output-prefix", "docs",
                   "--no-progress")
    assert done.returncode == 0, done.stderr
    train(load_config(None, MODELS["gpt2"] + ["train.steps=1", "train.micro_batch=2", "train.global_batch=4",
                                              "data.source=indexed", "data.paths=docs", "data.split=1,0,0",
                                              "model.vocab_size=300", "checkpoint.dir=ck", "train.out_dir=out"]))
    monkeypatch.chdir(tmp_path)
    done = cli("export", "run/ck", "--hf", "hf")
    assert done.returncode == 0 and (tmp_path / "hf" / "model.safetensors").exists(), done.stderr
    assert f"no tokenizer (no docs.tokenizer.json from {tmp_path}: give --tokenizer)" in done.stdout, done.stdout


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_builtin_corpus_run_exports_its_byte_tokens_and_generates_alike(tmp_path, capsys):
    """A run on the builtin corpus (byte tokens): its export holds a tokenizer.json that
    AutoTokenizer reads as the same bytes, end of document 0; transformers' greedy text from the
    export is what `tessera generate` prints from the checkpoint."""
    import json

    from tessera.cli import main
    from tessera.data.tokenizer import ByteTokenizer
    from tessera.training.trainer import train

    train(load_config(None, MODELS["llama"] + ["model.vocab_size=256", "model.seq_len=32", "train.steps=3",
                                               "train.micro_batch=2", "train.global_batch=4", "optim.lr=1e-2",
                                               f"checkpoint.dir={tmp_path}/ck", f"train.out_dir={tmp_path}/out"]))
    done = cli("export", f"{tmp_path}/ck", "--hf", f"{tmp_path}/hf")
    assert done.returncode == 0 and "byte tokens (end of document: id 0)" in done.stdout, done.stdout + done.stderr
    tokenizer = transformers.AutoTokenizer.from_pretrained(f"{tmp_path}/hf")
    text = "Byte tokens: é, 日本, \x00 and Ā"
    assert tokenizer(text)["input_ids"] == ByteTokenizer().encode(text)
    assert tokenizer.decode(list(range(256))) == ByteTokenizer().decode(list(range(256)))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(f"{tmp_path}/hf").eval()
    ids = torch.tensor([tokenizer("The ")["input_ids"]])
    with torch.no_grad():
        theirs = model.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=0)[0]
    capsys.readouterr()
    assert main(["generate", "--checkpoint", f"{tmp_path}/ck", "--prompt", "The ", "--max-new-tokens", "20",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out == ByteTokenizer().decode(theirs.tolist()[: (theirs.tolist() + [0]).index(0, 4)]) + "\n"
