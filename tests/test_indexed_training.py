"""`tessera train` on Megatron indexed datasets: blended, packed, the same losses on any layout,
and bad data paths refused before anything starts.

The command runs in this process (``cli.main``: its exit status and what it printed) where one
process is enough, and the trainer in rank processes for the other layouts; the rank-local
error is launched through torchrun, whose workers say it."""

import re
import subprocess
import sys

import numpy as np
import pytest

from parity import assert_same_curve
from tessera.cli import main
from tessera.data import IndexedDatasetWriter
from training_runs import TINY, train_histories

EOD = 1


def tessera_train(capsys, sets: list[str]) -> tuple[int, str, str]:
    """``tessera train --set ...`` in this process: its exit status, stdout and stderr."""
    capsys.readouterr()
    code = main(["train", *[a for s in sets for a in ("--set", s)]])
    out, err = capsys.readouterr()
    return code, out, err


def write_corpus(prefix, seed, docs=60):
    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for _ in range(docs):
            n = int(rng.integers(3, 40))
            writer.add_document(np.append(rng.integers(2, 64, n), EOD))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_blended_packed_indexed_data_on_every_layout(tmp_path):
    write_corpus(tmp_path / "a", 1)
    write_corpus(tmp_path / "b", 2)
    data = [f"data.paths=0.7,{tmp_path / 'a'},0.3,{tmp_path / 'b'}", "data.source=indexed", "data.split=90,10,0",
            f"data.cache_dir={tmp_path / 'cache'}", f"data.eod_id={EOD}", "data.reset_position_ids=true",
            "data.reset_attention_mask=true", "data.eod_mask_loss=true", "model.vocab_size=64",
            "model.layers=4", "train.steps=6"]
    (reference,) = train_histories(1, TINY, [data + [f"train.out_dir={tmp_path / 'one'}"]])
    assert reference[-1]["loss"] < reference[0]["loss"]
    assert all(m["tokens"] < 8 * 32 for m in reference), "EOD predictions carry no loss"
    # throughput counts every token processed (global batch 8 x seq 32), not the loss's
    assert all(m["tokens_per_s"] * m["step_time_s"] == pytest.approx(8 * 32) for m in reference)
    (layout,) = train_histories(4, TINY, [data + ["parallel.tp=2", "parallel.pp=2", f"train.out_dir={tmp_path / 'tp2pp2'}"]])
    assert_same_curve(reference, layout)


@pytest.mark.slow
@pytest.mark.parametrize("paths,problem", [
    ("0.5,{a},x,{a}", "weight"),
    ("{missing}", "not found"),
])
def test_bad_data_paths_are_refused_up_front(tmp_path, capsys, paths, problem):
    write_corpus(tmp_path / "a", 1)
    value = paths.format(a=tmp_path / "a", missing=tmp_path / "nope")
    code, _, err = tessera_train(capsys, ["data.source=indexed", f"data.paths={value}", f"train.out_dir={tmp_path}/run"])
    assert code == 2, err
    assert "data.paths" in err and problem in err.lower(), err


@pytest.mark.parametrize("split", ["0,100,0", "1,1000,0"])
def test_a_split_that_leaves_training_no_sample_is_refused_up_front(tmp_path, split):
    from tessera.config import ConfigError, load_config
    from tessera.training.preflight import check_runnable

    write_corpus(tmp_path / "a", 1)
    cfg = load_config(None, ["data.source=indexed", f"data.paths={tmp_path / 'a'}", f"data.split={split}"])
    with pytest.raises(ConfigError) as info:  # (it failed in the data feed, after the model was built)
        check_runnable(cfg, 1)
    assert info.value.key == "data.split" and "too few tokens for a sample" in str(info.value)
    check_runnable(load_config(None, ["data.source=indexed", f"data.paths={tmp_path / 'a'}", "data.split=1,1,0"]), 1)


@pytest.mark.slow
def test_token_ids_past_the_model_vocabulary_stop_the_run(tmp_path, capsys):
    """The corpus holds ids up to 63; a 32-id model would otherwise train on zero embeddings
    under a vocab-parallel layout (no rank owns the id) or fail on one device."""
    write_corpus(tmp_path / "a", 1)
    code, _, err = tessera_train(capsys, [
        "data.source=indexed", f"data.paths={tmp_path / 'a'}", "data.split=1,0,0", "model.vocab_size=32",
        "model.layers=1", "train.steps=2", f"train.out_dir={tmp_path}/run"])
    assert code == 2, err
    assert "model.vocab_size: sample" in err and "outside the model's vocabulary [0, 32)" in err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_bad_id_in_one_ranks_share_is_said_by_that_rank(tmp_path):
    """One document holds id 200; with this seed its sample falls in dp rank 1's share, so
    only rank 1 finds it and must say it (rank 0 only sees its peer gone)."""
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(tmp_path / "bad", np.uint16) as writer:
        for d in range(200):
            doc = rng.integers(1, 100, size=40)
            doc[5] = 200 if d == 150 else doc[5]
            writer.add_document(doc)
    proc = subprocess.run([sys.executable, "-m", "tessera", "train", "--nproc-per-node", "2", *[a for s in (
        "model.layers=1", "model.hidden=32", "model.heads=2", "model.seq_len=16", "train.steps=40",
        "model.vocab_size=128", "data.source=indexed", f"data.paths={tmp_path / 'bad'}", "train.seed=1",
        "data.split=1,0,0", f"train.out_dir={tmp_path}/run") for a in ("--set", s)]],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0
    assert "tessera: rank 1: config error: model.vocab_size: sample 92 holds token id 200" in proc.stderr, proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_jsonl_to_training(tmp_path, capsys):
    """The whole pipeline: text -> `tessera preprocess` (a BPE trained on it) -> `tessera train`."""
    import json

    pytest.importorskip("tokenizers")

    import pydoc_data.topics

    texts = list(pydoc_data.topics.topics.values())[:40]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    assert main(["preprocess", "--input", str(tmp_path / "docs.jsonl"), "--key", "text", "--tokenizer", "bpe:500",
                 "--output-prefix", str(tmp_path / "docs"), "--no-progress"]) == 0
    code, out, err = tessera_train(capsys, TINY + [
        "data.source=indexed", f"data.paths={tmp_path / 'docs'}", "model.vocab_size=512", "train.steps=4",
        "data.split=1,0,0", "train.sample_tokens=8", "train.sample_prompt=The object", f"train.out_dir={tmp_path}/run"])
    assert code == 0, err
    curve = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(curve) == 4 and curve[-1]["loss"] < curve[0]["loss"]
    # the sample is encoded and decoded with the data's own BPE (docs.tokenizer.json), not bytes
    from tessera.data import FileTokenizer

    tokenizer = FileTokenizer(str(tmp_path / "docs.tokenizer.json"))
    sample = out.split("sample: ", 1)[1].rstrip("\n")
    assert sample.startswith("The object") and len(tokenizer.encode(sample)) >= 8, sample
    # the data's tokenizer has 500 ids: refused up front, with or without a sample (it was found
    # only when a rank read such an id, after the launch)
    for sample_tokens in (8, 0):
        code, _, err = tessera_train(capsys, TINY + [
            "data.source=indexed", f"data.paths={tmp_path / 'docs'}", "model.vocab_size=256", "data.split=1,0,0",
            f"train.sample_tokens={sample_tokens}", f"train.out_dir={tmp_path}/small"])
        assert code == 2 and re.search(r"model.vocab_size: 256 is smaller than the 500 ids of .*docs\.tokenizer\.json",
                                       err), err


def test_a_blend_of_two_vocabularies_is_refused_up_front(tmp_path):
    """Two corpora each with its own trained BPE: the same id is other text in each."""
    import json

    pytest.importorskip("tokenizers")
    import pydoc_data.topics

    from tessera.config import ConfigError, load_config
    from tessera.data.preprocess import preprocess
    from tessera.training.preflight import check_runnable

    texts = list(pydoc_data.topics.topics.values())
    for name, part in (("a", texts[:20]), ("b", texts[20:40])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
    preprocess(tmp_path / "a.jsonl", tmp_path / "a", "bpe:400", progress=False)
    preprocess(tmp_path / "b.jsonl", tmp_path / "b", "bpe:400", progress=False)
    blend = ["data.source=indexed", f"data.paths=0.5,{tmp_path / 'a'},0.5,{tmp_path / 'b'}", "model.vocab_size=512"]
    with pytest.raises(ConfigError) as info:
        check_runnable(load_config(None, blend), 1)
    assert info.value.key == "data.paths" and "different vocabularies" in str(info.value)
    assert f"--tokenizer {tmp_path / 'a'}.tokenizer.json" in info.value.fix
    preprocess(tmp_path / "b.jsonl", tmp_path / "b", str(tmp_path / "a.tokenizer.json"), progress=False,
               overwrite=True)  # the fix the error names
    check_runnable(load_config(None, blend), 1)


def test_an_eod_id_no_document_ends_with_is_refused_up_front(tmp_path):
    """Packing with data.eod_id=5 on documents that end with 1: refused, naming the id to use
    (before, every token 5 cut a document and the real boundaries were not seen)."""
    from tessera.config import ConfigError, load_config
    from tessera.training.preflight import check_runnable

    write_corpus(tmp_path / "a", 1)
    data = ["data.source=indexed", f"data.paths={tmp_path / 'a'}", "data.reset_attention_mask=true",
            "model.vocab_size=64", f"data.cache_dir={tmp_path / 'cache'}"]
    with pytest.raises(ConfigError, match=r"data.eod_id: 5, but no document sampled from .* ends with it "
                                          r"\(they all end with 1\) -> set data.eod_id=1"):
        check_runnable(load_config(None, data + ["data.eod_id=5"]), 1)
    check_runnable(load_config(None, data + [f"data.eod_id={EOD}"]), 1)
    check_runnable(load_config(None, data[:2] + data[3:] + ["data.eod_id=5"]), 1)  # no packing: not needed



def test_documents_stored_as_fixed_length_rows_pass_the_eod_check(tmp_path):
    """Packed corpora stored as fixed-length rows (EOD inside rows, rarely at a row's end): the
    id occurs, so it is taken (only an id that never occurs, or one other end everywhere, is refused)."""
    from tessera.config import ConfigError, load_config
    from tessera.training.preflight import check_runnable

    rng = np.random.default_rng(3)
    stream = np.concatenate([np.append(rng.integers(2, 64, int(n)), EOD) for n in rng.integers(200, 400, 40)])
    with IndexedDatasetWriter(tmp_path / "rows", np.uint16) as writer:
        for start in range(0, len(stream) - 129, 129):
            writer.add_document(stream[start:start + 129])
    data = ["data.source=indexed", f"data.paths={tmp_path / 'rows'}", "data.reset_attention_mask=true",
            "model.vocab_size=64", f"data.cache_dir={tmp_path / 'cache'}"]
    check_runnable(load_config(None, data + [f"data.eod_id={EOD}"]), 1)
    with pytest.raises(ConfigError, match="data.eod_id: 0, but no document sampled"):
        check_runnable(load_config(None, data + ["data.eod_id=0"]), 1)


def test_a_dataset_in_a_read_only_folder_needs_a_cache_dir(tmp_path, monkeypatch):
    """The default index cache goes beside the dataset: where that folder cannot be written, the
    run is refused up front naming data.cache_dir (it failed when rank 0 built the indices).
    (A folder is made unwritable by os.access here: root, as CI runs, writes into any folder.)"""
    import os

    from tessera.config import ConfigError, load_config
    from tessera.training.preflight import check_runnable

    (tmp_path / "ro").mkdir()
    write_corpus(tmp_path / "ro" / "a", 1)
    data = ["data.source=indexed", f"data.paths={tmp_path / 'ro' / 'a'}", "model.vocab_size=64"]
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: real(path, mode) and str(path) != str(tmp_path / "ro"))
    with pytest.raises(ConfigError, match="data.cache_dir: empty, so the sample indices go beside .* is not writable"):
        check_runnable(load_config(None, data), 1)
    check_runnable(load_config(None, data + [f"data.cache_dir={tmp_path / 'cache'}"]), 1)
    (tmp_path / "ro" / "index-cache").mkdir()  # one there already may hold the indices: no refusal
    check_runnable(load_config(None, data), 1)
