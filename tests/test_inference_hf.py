"""Generation and evaluation against Hugging Face transformers on the same weights: tiny GPT-2 and
Llama (grouped-query attention) models imported with ``tessera checkpoint import``, loaded on
tp=1, tp=2, pp=2 and dp=2, greedy tokens equal to transformers' ``generate`` (batched and one by
one) and the mean loss per token equal to transformers' own loss."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from tessera.cli import main  # noqa: E402
from tessera.inference.generate import generate  # noqa: E402
from tessera.inference.loading import check_layout, find_checkpoint, inference_config, load_chunks  # noqa: E402
from tessera.inference.perplexity import loss_and_tokens  # noqa: E402
from tessera.pipeline_parallel.p2p import P2P  # noqa: E402
from tessera.testing import run_ranks  # noqa: E402
from tessera.topology import Topology  # noqa: E402

PROMPTS = [[5, 17, 3], [40, 2, 9, 77, 1], [8], [60, 61, 62, 63, 64, 65, 66]]  # batched: left-padded to 7
NEW = 8  # (prompt + new <= 16 positions)
ROWS = [np.random.default_rng(i).integers(0, 100, n) for i, n in enumerate((16, 9, 16, 2, 12))]  # (GPT-2: 16 positions)


def _hf_model(family: str):
    torch.manual_seed(3)
    if family == "gpt2":
        config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=16, vocab_size=100,
                                         bos_token_id=None, eos_token_id=None)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=64, vocab_size=100,
                                          max_position_embeddings=16, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                          bos_token_id=None, eos_token_id=None, pad_token_id=None)
        model = transformers.LlamaForCausalLM(config)
    return _spread(model)


def _spread(model):
    """Weights of a larger spread than the initialisation's (clear winners among the logits), and
    random biases and norms (a mapping that mixes them up shows)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.3 if p.ndim == 2 else 0.1)
            if p.ndim == 1 and ("ln_" in name or "norm" in name) and name.endswith("weight"):
                p.add_(1.0)
    return model.eval()


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """family -> (transformers model, imported checkpoint folder)."""
    out = {}
    for family in ("gpt2", "llama"):
        folder = tmp_path_factory.mktemp(family)
        model = _hf_model(family)
        model.save_pretrained(folder / "hf", safe_serialization=True)
        assert main(["checkpoint", "import", str(folder / "hf"), "--out", str(folder / "ck")]) == 0
        out[family] = (model, str(folder / "ck"))
    return out


def _theirs(model, prompt: list[int]) -> list[int]:
    """transformers' greedy continuation, with the margin of each choice checked (no near-ties)."""
    with torch.no_grad():
        done = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                              output_scores=True, return_dict_in_generate=True)
    for scores in done.scores:
        top = scores[0].float().topk(2).values
        assert top[0] - top[1] > 1e-3, "a near-tie: choose other weights"
    return done.sequences[0].tolist()


def _ours(path: str, overrides: list[str], world: int = 1) -> tuple[dict, tuple[float, int]]:
    """This rank's greedy batch, one by one, and the evaluation of ROWS, on the layout of ``overrides``."""
    path, meta = find_checkpoint(path)
    cfg = check_layout(inference_config(meta, overrides), world)
    p = cfg.parallel
    topo = Topology.build(tp=p.tp, pp=p.pp, dp=p.dp)
    chunks = load_chunks(cfg, topo, path)
    p2p = P2P(topo) if topo.pp > 1 else None
    tokens = {"batched": generate(chunks, PROMPTS, NEW, topo=topo, p2p=p2p),
              "one by one": [generate(chunks, [prompt], NEW, topo=topo, p2p=p2p)[0] for prompt in PROMPTS]}
    return tokens, loss_and_tokens(chunks, topo, ROWS, batch=2, p2p=p2p)


def _transformers_loss(model) -> float:
    """transformers' loss over ROWS: each row's mean, weighted by its predicted tokens."""
    total = 0.0
    with torch.no_grad():
        for row in ROWS:
            ids = torch.as_tensor(row)[None]
            total += model(ids, labels=ids).loss.double().item() * (len(row) - 1)
    return total / sum(len(row) - 1 for row in ROWS)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_greedy_tokens_and_the_loss_equal_transformers(imported, family):
    model, path = imported[family]
    tokens, (loss, count) = _ours(path, [])
    want = [_theirs(model, prompt) for prompt in PROMPTS]
    assert tokens == {"batched": want, "one by one": want}
    assert count == sum(len(row) - 1 for row in ROWS)
    assert loss / count == pytest.approx(_transformers_loss(model), rel=1e-5)


def _layout_worker(rank: int, world: int, paths: dict, overrides: list[str]) -> dict:
    return {family: _ours(path, overrides, world) for family, path in paths.items()}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", [["parallel.tp=2"], ["parallel.pp=2"], ["parallel.tp=2", "parallel.sequence_parallel=true"],
                                    []], ids=["tp2", "pp2", "tp2-sp", "dp2"])
def test_every_layout_loads_the_import_and_generates_and_evaluates_alike(imported, layout):
    """The imported checkpoint loaded at tp=2 (with and without SP), pp=2 and dp=2 (two replicas,
    each its share of the evaluation): the tokens and the loss of one process."""
    one = {family: _ours(path, []) for family, (_, path) in imported.items()}
    paths = {family: path for family, (_, path) in imported.items()}
    for out in run_ranks(_layout_worker, 2, paths, layout, timeout=240):
        for family in paths:
            assert out[family][0] == one[family][0], (family, layout)
            assert out[family][1][1] == one[family][1][1]
            assert out[family][1][0] == pytest.approx(one[family][1][0], rel=1e-6), (family, layout)


def _command_worker(rank: int, world: int, argv: list[str]) -> str:
    """``tessera ARGV`` on this rank, as a torchrun worker runs it: what it printed."""
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(argv) == 0
    return printed.getvalue()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tessera_generate_and_eval_on_an_imported_model_with_its_tokenizer(tmp_path, capsys):
    """The commands end to end on a transformers folder with a tokenizer.json (byte tokens) and
    an end-of-sequence id: ``tessera generate`` prints what transformers generates, stopping
    where it stops; ``tessera eval --jsonl`` prints transformers' loss; both at tp=2 x pp=2 and
    dp=2 too. (One process in this one; tp=2 x pp=2 in four rank processes, as torchrun's workers
    run the command; dp=2 generation launched with --nproc-per-node 2, through torchrun, the
    launcher's path for both commands; dp=2 evaluation in two rank processes.)"""
    import subprocess
    import sys

    from tessera.data.tokenizer import ByteTokenizer

    torch.manual_seed(5)
    config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=64, vocab_size=256, max_position_embeddings=32,
                                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = _spread(transformers.LlamaForCausalLM(config))
    prompts = ["The cat", "Once upon a time, "]
    bytes_of = ByteTokenizer()
    free = [model.generate(torch.tensor([bytes_of.encode(t)]), max_new_tokens=10, do_sample=False,
                           pad_token_id=0)[0].tolist() for t in prompts]
    eos = free[0][len(bytes_of.encode(prompts[0])) + 3]  # the 4th token drawn for the first prompt
    model.config.eos_token_id = model.generation_config.eos_token_id = eos
    theirs = [model.generate(torch.tensor([bytes_of.encode(t)]), max_new_tokens=10, do_sample=False,
                             pad_token_id=0)[0].tolist() for t in prompts]
    assert len(theirs[0]) == len(bytes_of.encode(prompts[0])) + 4 and theirs[0][-1] == eos
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    (tmp_path / "hf" / "tokenizer.json").write_text(ByteTokenizer.hf_json())
    assert main(["checkpoint", "import", str(tmp_path / "hf"), "--out", str(tmp_path / "ck")]) == 0
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": t}) + "\n" for t in prompts))
    texts = ["A sentence to score, with some words.", "And another, longer one: " + "la " * 20]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    commands = {"generate": ["generate", "--checkpoint", str(tmp_path / "ck"), "--prompts", str(tmp_path / "prompts.jsonl"),
                             "--max-new-tokens", "10", "--temperature", "0", "--json"],
                "eval": ["eval", "--checkpoint", str(tmp_path / "ck"), "--jsonl", str(tmp_path / "docs.jsonl"), "--json"]}

    def printed(command: str, launch: str) -> str:
        """What ``command`` printed: one process, tp2 x pp2 (four ranks) or dp2 (two ranks; torchrun
        for generate)."""
        if launch == "one process":
            capsys.readouterr()
            assert main(commands[command]) == 0
            return capsys.readouterr().out
        if launch == "tp2 x pp2":
            argv = commands[command] + ["--set", "parallel.tp=2", "--set", "parallel.pp=2"]
            return run_ranks(_command_worker, 4, argv, timeout=240)[0]
        if command == "eval":
            return run_ranks(_command_worker, 2, commands[command], timeout=240)[0]
        done = subprocess.run([sys.executable, "-m", "tessera", *commands[command], "--nproc-per-node", "2"],
                              capture_output=True, text=True, timeout=200)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    for launch in ("one process", "tp2 x pp2", "dp2"):  # (two replicas: a prompt each)
        lines = [json.loads(line) for line in printed("generate", launch).splitlines()]
        assert [line["prompt"] for line in lines] == prompts, launch
        assert [bytes_of.encode(t) + line["tokens"] for t, line in zip(prompts, lines)] == theirs, launch
        assert lines[0]["stop"] == "end_of_document" and lines[1]["stop"] == "length"
        assert lines[1]["text"] == bytes_of.decode(theirs[1])
        figure = json.loads(printed("eval", launch))
        ids = [bytes_of.encode(t) for t in texts]
        windows = [row[i: i + 33] for row in ids for i in range(0, len(row) - 1, 32)]
        with torch.no_grad():
            want = sum(model(torch.tensor([w]), labels=torch.tensor([w])).loss.item() * (len(w) - 1) for w in windows)
        assert figure["tokens"] == sum(len(w) - 1 for w in windows)
        assert figure["loss"] == pytest.approx(want / figure["tokens"], rel=1e-5), launch
