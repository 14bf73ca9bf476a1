"""``tessera generate`` and ``tessera eval`` (inference/commands.py, loading.py, perplexity.py) on a
checkpoint a run saved: what they print, the run's own validation loss given back, and every
refusal in one line naming the problem and the fix, exit status 2, before any work."""

from __future__ import annotations

import json

import pytest
import torch

from tessera.cli import main
from tessera.config import load_config

RUN = ["model.hidden=32", "model.layers=2", "model.heads=4", "model.seq_len=32", "train.steps=2",
       "train.micro_batch=2", "train.global_batch=4", "train.eval_every=2", "train.eval_batches=2", "train.log_every=1"]


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> str:
    """A weights-only checkpoint with its tokenizer.json (bytes), as an import writes it."""
    from tessera.checkpoint import store
    from tessera.config import ModelConfig
    from tessera.data.tokenizer import ByteTokenizer
    from tessera.models import GPTModel

    folder = tmp_path_factory.mktemp("imported")
    settings = {"hidden": 32, "layers": 2, "heads": 4, "seq_len": 32, "vocab_size": 256}
    model = GPTModel(ModelConfig(**settings))
    model.init_weights(0)
    (folder / "bytes.json").write_text(ByteTokenizer.hf_json())
    whole = {name: p[:256] if "embedding" in name else p for name, p in model.state_dict().items()}
    return store.write_weights(str(folder / "ck"), whole, settings, files={"tokenizer.json": str(folder / "bytes.json")})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A checkpoint of a short run on the builtin corpus (byte tokens), and its metrics."""
    from tessera.training.trainer import train

    folder = tmp_path_factory.mktemp("run")
    history = train(load_config(None, RUN + [f"checkpoint.dir={folder}/ck", f"train.out_dir={folder}/out"]))
    return str(folder / "ck"), history


def _main(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    status = main(list(args))
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.slow
def test_generate_prints_each_completion_and_eval_gives_back_the_runs_validation_loss(run, capsys):
    """Greedy text of two prompts as ``generate()`` draws them from the saved weights (JSON lines
    and plain text), and ``eval --samples`` of the run's validation samples equals the run's own
    last validation loss (the same samples: the run's seed and split)."""
    from tessera.data.tokenizer import ByteTokenizer
    from tessera.inference.generate import generate
    from tessera.inference.loading import check_layout, find_checkpoint, inference_config, load_chunks
    from tessera.topology import Topology

    ck, history = run
    status, out, err = _main(capsys, "generate", "--checkpoint", ck, "--prompt", "The ", "--prompt", "def f(x):",
                             "--max-new-tokens", "12", "--temperature", "0", "--json", "--no-stop")
    assert status == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    path, meta = find_checkpoint(ck)
    chunks = load_chunks(check_layout(inference_config(meta, []), 1), Topology.build(), path)
    byte = ByteTokenizer()
    want = generate(chunks, [byte.encode("The "), byte.encode("def f(x):")], 12, topo=Topology.build())
    assert [line["prompt"] + line["completion"] for line in lines] == [byte.decode(ids) for ids in want]
    assert [line["text"] for line in lines] == [byte.decode(ids) for ids in want]
    assert [len(line["tokens"]) for line in lines] == [12, 12] and lines[0]["stop"] == "length"
    status, out, _ = _main(capsys, "generate", "--checkpoint", ck, "--prompt", "The ", "--max-new-tokens", "12",
                           "--temperature", "0", "--no-stop")
    assert status == 0 and out == byte.decode(want[0]) + "\n"
    status, out, err = _main(capsys, "eval", "--checkpoint", ck, "--samples", "8", "--json")  # (2 batches of 4)
    assert status == 0, err
    figure = json.loads(out)
    assert figure["tokens"] == 8 * 32 and figure["sequences"] == 8
    assert figure["loss"] == pytest.approx(history[-1]["valid_loss"], rel=1e-5)
    status, out, _ = _main(capsys, "eval", "--checkpoint", ck, "--samples", "8")
    assert status == 0 and f"loss {figure['loss']:.6f} per token" in out and "valid split" in out


def test_drawing_at_a_temperature_follows_the_seed(imported, capsys):
    ck = imported
    common = ["generate", "--checkpoint", ck, "--prompt", "The ", "--max-new-tokens", "16", "--top-k", "20",
              "--top-p", "0.9", "--no-stop"]
    first, second, other = (_main(capsys, *common, "--seed", seed)[1] for seed in ("1", "1", "2"))
    assert first == second != other


def _refused(capsys, *args) -> str:
    status, out, err = _main(capsys, *args)
    assert status == 2 and not out, (status, out, err)
    assert len(err.strip().splitlines()) == 1 and err.startswith("tessera: config error: "), err
    return err


def test_refusals_name_the_problem_and_the_fix(imported, capsys, tmp_path):
    """On an imported checkpoint (with its byte tokenizer; eval on the builtin corpus)."""
    ck = imported
    (tmp_path / "bad.jsonl").write_text('{"prompt": "fine"}\n{"text": "no prompt"}\n')
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    cases = {
        ("--checkpoint", str(tmp_path / "nowhere"), "--prompt", "x"): "nowhere does not exist -> give a step_N folder",
        ("--checkpoint", str(tmp_path / "hf"), "--prompt", "x"): f"`tessera checkpoint import {tmp_path / 'hf'} --out DIR`",
        ("--checkpoint", ck, "--prompts", str(tmp_path / "missing.jsonl")): "--prompts: cannot read",
        ("--checkpoint", ck, "--prompts", str(tmp_path / "bad.jsonl")): 'line 2 is not a JSON object with a "prompt" '
                                                                        "string",
        ("--checkpoint", ck, "--prompt", "x" * 33): "the prompt is 33 tokens, longer than the model's seq_len 32 -> "
                                                    "shorten it to at most 32 tokens",
        ("--checkpoint", ck, "--prompt", "ok", "--prompt", ""): "prompt 2 ('') encodes to no tokens",
        ("--checkpoint", ck): "either as --prompt TEXT or in --prompts FILE",
        ("--checkpoint", ck, "--prompt", "x", "--set", "model.layers=3"): "model.layers: the model is the checkpoint's",
        ("--checkpoint", ck, "--prompt", "x", "--set", "parallel.tp=3"): "does not divide the world size 1",
        ("--checkpoint", ck, "--prompt", "x", "--nproc-per-node", "3", "--set", "parallel.tp=3"):
            "heads = 4 is not divisible by tp=3",
        ("--checkpoint", ck, "--prompt", "x", "--nproc-per-node", "2", "--set", "parallel.pp=2", "--cuda-graph"):
            "--cuda-graph: captures the decode step of one pipeline stage",
        ("--checkpoint", ck, "--prompt", "x", "--no-cache", "--compile", "on"):
            "--compile: compiles the decode step of one pipeline stage with the KV cache",
        ("--checkpoint", ck, "--prompt", "x", "--top-p", "0"): "0 < top_p <= 1",
        ("--checkpoint", ck, "--prompt", "x", "--tokenizer", str(tmp_path / "none.json")): "--tokenizer",
    }
    for args, words in cases.items():
        assert words in _refused(capsys, "generate", *args), (args, words)
    (tmp_path / "docs.jsonl").write_text('{"text": "a document"}\n[1, 2]\n')
    assert 'docs.jsonl line 2 is not a JSON object with a "text" string' in _refused(
        capsys, "eval", "--checkpoint", ck, "--jsonl", str(tmp_path / "docs.jsonl"))
    builtin = ["--set", "data.source=builtin"]
    assert "is for --jsonl text" in _refused(capsys, "eval", "--checkpoint", ck, *builtin, "--tokenizer", "x.json")
    assert "the test split of data.split=1,0,0 holds 0 tokens" in _refused(
        capsys, "eval", "--checkpoint", ck, *builtin, "--split", "test", "--set", "data.split=1,0,0")


def test_a_checkpoint_without_a_tokenizer_asks_for_one(capsys, tmp_path):
    """An import from a transformers folder without a tokenizer.json (and synthetic-token runs)
    generate only with --tokenizer; the model's end-of-sequence id comes with the import."""
    from tessera.checkpoint import store
    from tessera.config import ModelConfig
    from tessera.data.tokenizer import ByteTokenizer
    from tessera.models import GPTModel

    settings = {"hidden": 32, "layers": 2, "heads": 4, "seq_len": 16, "vocab_size": 256}
    model = GPTModel(ModelConfig(**settings))
    model.init_weights(0)
    whole = {name: p[:256] if "embedding" in name else p for name, p in model.state_dict().items()}
    store.write_weights(str(tmp_path / "ck"), whole, settings, meta={"stop_ids": [7]})
    err = _refused(capsys, "generate", "--checkpoint", str(tmp_path / "ck"), "--prompt", "x")
    assert "the imported checkpoint holds no tokenizer.json" in err and "give --tokenizer FILE" in err
    assert "is an imported model: it has no run whose data to read" in _refused(
        capsys, "eval", "--checkpoint", str(tmp_path / "ck"))
    (tmp_path / "bytes.json").write_text(ByteTokenizer.hf_json())
    status, out, err = _main(capsys, "generate", "--checkpoint", str(tmp_path / "ck"), "--prompt", "x",
                             "--tokenizer", str(tmp_path / "bytes.json"), "--json", "--max-new-tokens", "40")
    assert status == 0, err
    line = json.loads(out)
    assert (line["stop"] == "end_of_document") == (7 in line["tokens"]) and line["tokens"].count(7) <= 1


def test_the_byte_tokenizer_json_reads_as_bytes():
    """The builtin corpus's byte tokens as a tokenizer.json: the tokenizers library (and so
    transformers' AutoTokenizer) encodes any text to its UTF-8 bytes and decodes as ByteTokenizer."""
    from tokenizers import Tokenizer

    from tessera.data.tokenizer import ByteTokenizer

    ours, theirs = ByteTokenizer(), Tokenizer.from_str(ByteTokenizer.hf_json())
    text = "Plain ASCII, accents: é à ü, \x00 NUL, Ā, 日本語, emoji 🙂, tabs\tand\nnewlines  "
    assert theirs.encode(text).ids == ours.encode(text) and theirs.get_vocab_size() == 256
    ids = list(range(256)) + [0xE6, 0x97, 0xA5]
    assert theirs.decode(ids) == ours.decode(ids)
    assert torch.equal(torch.tensor(theirs.encode(text).ids), torch.tensor(list(text.encode())))


@pytest.mark.slow
def test_a_compiled_decode_step_generates_the_same_text_on_a_cpu(imported, capsys):
    """``--compile on`` on a CPU compiles the decode step with inductor's C++ kernels (no CUDA
    graph there) and prints the greedy text of ``--compile off``."""
    common = ["generate", "--checkpoint", imported, "--prompt", "The ", "--prompt", "a", "--max-new-tokens", "12",
              "--temperature", "0", "--no-stop", "--json"]
    status, out, err = _main(capsys, *common, "--compile", "on")
    assert status == 0, err
    assert out == _main(capsys, *common, "--compile", "off")[1]


def test_decode_is_graphed_by_default_where_measured():
    """--cuda-graph auto replays the decode step on CUDA at tp=1, pp=1 with the KV cache (measured
    15x eager at batch 1), nowhere else; --compile auto compiles nothing (compiling outlasts a short
    generation); on and off are taken as given."""
    from types import SimpleNamespace

    from tessera.inference.commands import decode_compiled, decode_graphed

    def topo(device="cuda", tp=1, pp=1):
        return SimpleNamespace(device=torch.device(device), tp=tp, pp=pp)

    assert decode_graphed("auto", topo(), no_cache=False)
    assert not any(decode_graphed("auto", t, no_cache=False) for t in (topo("cpu"), topo(tp=2), topo(pp=2)))
    assert not decode_graphed("auto", topo(), no_cache=True)
    assert decode_graphed("on", topo(tp=2), no_cache=False) and not decode_graphed("off", topo(), no_cache=False)
    assert not decode_compiled("auto") and decode_compiled("on") and not decode_compiled("off")
