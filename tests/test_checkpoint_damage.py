"""Damaged inputs refused in one line naming the file and the fix, not a traceback: a checkpoint
data file of the right size with other bytes (checkpoint/checksums.py: its CRC-32, saved in
tessera.json, checked as the load starts), a tessera.json whose model disagrees with the tensors,
a checkpoint saved before checksums whose pickled random streams are damaged, and a Hugging Face
config.json that is not JSON."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tessera.checkpoint import checksums, dcp
from tessera.cli import main

TINY = ["data.source=synthetic", "model.layers=2", "model.hidden=32", "model.heads=2", "model.seq_len=16",
        "model.vocab_size=64", "train.micro_batch=1", "train.global_batch=2", "train.sample_tokens=0",
        "optim.decay_steps=10", "train.device=cpu"]


def _train(args: list[str]) -> int:
    return main(["train", *(a for s in TINY + args for a in ("--set", s))])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of 2 steps, made once for the module's tests (each copies it)."""
    root = tmp_path_factory.mktemp("saved")
    assert _train(["train.steps=2", f"train.out_dir={root}/out", f"checkpoint.dir={root}/ck"]) == 0
    return root / "ck" / "step_00000002"


def _copy(saved, tmp_path):
    shutil.copytree(saved, tmp_path / "ck" / saved.name)
    return tmp_path / "ck" / saved.name


def _flip(path, offset: int, count: int = 16) -> None:
    """Other bytes at ``offset``, the size unchanged."""
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(count)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in old))


def test_every_file_of_a_checkpoint_has_its_checksum_in_tessera_json(saved):
    meta = json.loads((saved / "tessera.json").read_text())
    files = sorted(n for n in os.listdir(saved) if n != "tessera.json")
    assert sorted(meta["checksums"]) == files and ".metadata" in files and len(files) > 2
    for name in files:
        assert meta["checksums"][name] == checksums.crc32(str(saved / name))


def _last_stored(path, name: str) -> tuple[str, int]:
    """The data file and offset of the last item DCP stored for a tensor key starting with ``name``."""
    md = dcp.dcp.FileSystemReader(str(path)).read_metadata()
    info = next(v for k, v in reversed(md.storage_data.items()) if k.fqn.startswith(name))
    return info.relative_path, info.offset + info.length // 2


@pytest.mark.parametrize("where", ["a tensor's numbers", "the random streams"])
def test_a_data_file_with_other_bytes_fails_its_checksum_in_one_line(saved, tmp_path, capsys, where):
    ck = _copy(saved, tmp_path)
    name, offset = _last_stored(ck, "model.layers.1" if where.startswith("a tensor") else "rng.")
    _flip(ck / name, offset)  # (a tensor's bytes changed would otherwise load as other numbers, silently)
    status = _train(["train.steps=4", f"train.out_dir={tmp_path}/out", f"checkpoint.dir={tmp_path}/ck"])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert err.startswith(f"tessera: config error: checkpoint.dir: the checkpoint {ck} is damaged: {name} (CRC-32 ")
    assert err.rstrip().endswith("fails its checksum -> move it out of the way (a run then starts from the one "
                                 "before), or restore it")


def test_a_checkpoint_saved_without_checksums_still_refuses_damaged_objects_in_words(saved, tmp_path, capsys):
    ck = _copy(saved, tmp_path)
    meta = json.loads((ck / "tessera.json").read_text())
    del meta["checksums"]  # (as saved before 2026-12-01)
    (ck / "tessera.json").write_text(json.dumps(meta))
    name, offset = _last_stored(ck, "rng.")
    _flip(ck / name, offset)
    status = _train(["train.steps=4", f"train.out_dir={tmp_path}/out", f"checkpoint.load={ck}"])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert err.startswith(f"tessera: config error: checkpoint.load: the checkpoint {ck} is damaged: its data files "
                          "do not load (")
    assert err.rstrip().endswith("saved without checksums, which would name the file) -> give a whole checkpoint, "
                                 "or restore this one")


def test_a_tessera_json_that_disagrees_with_its_tensors_is_refused_before_the_run(saved, tmp_path, capsys):
    ck = _copy(saved, tmp_path)
    meta = json.loads((ck / "tessera.json").read_text())
    meta["config"]["model"]["hidden"] = 64  # (edited, or copied from another checkpoint)
    (ck / "tessera.json").write_text(json.dumps(meta))
    status = _train(["train.steps=4", "model.hidden=64", f"train.out_dir={tmp_path}/out", f"checkpoint.dir={tmp_path}/ck"])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert err.startswith(f"tessera: config error: checkpoint.dir: the checkpoint {ck} is damaged: its tessera.json "
                          "disagrees with its tensors: tessera.json's model (layers=2, hidden=64, vocab_size=64, ...) "
                          "has model.")
    assert "in .metadata -> move it out of the way" in err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()  # (refused before any work)


@pytest.mark.parametrize("content, words", [("{not json", "is not JSON (Expecting property name enclosed in double "
                                                          "quotes at line 1, column 2)"),
                                            ("[1, 2]", "holds a JSON list, not an object of settings")])
def test_a_hugging_face_config_that_is_not_json_is_refused_naming_the_file(tmp_path, capsys, content, words):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(content)
    assert main(["checkpoint", "import", str(tmp_path / "hf"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"tessera: checkpoint import: {tmp_path}/hf/config.json {words}")
    assert "transformers' save_pretrained" in err


def test_only_the_files_that_differ_are_named(tmp_path):
    for name, text in (("a", "one"), ("b", "two"), ("c", "three")):
        (tmp_path / name).write_text(text)
    expected = checksums.checksums(str(tmp_path), ["a", "b", "c"])
    (tmp_path / "b").write_text("tw0")
    os.remove(tmp_path / "c")
    assert checksums.differing(str(tmp_path), expected) == [f"b (CRC-32 {checksums.crc32(str(tmp_path / 'b'))}, "
                                                            f"saved as {expected['b']})", "c (missing)"]
    # shared out over ranks: each checks every world-th file
    assert [checksums.differing(str(tmp_path), expected, r, 2) for r in range(2)] == \
        [checksums.differing(str(tmp_path), expected)[1:], checksums.differing(str(tmp_path), expected)[:1]]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_each_rank_checksums_its_own_files_and_a_damaged_one_stops_every_rank(tmp_path):
    """2 ranks, zero=1 with a background save: each rank's files are in tessera.json with their
    CRC-32s; one of rank 1's files changed, the job is refused in one line, exit 2 (the workers
    find it, as the load starts: the launcher's preflight does not read whole checkpoints).
    (The save: the trainer in two rank processes; the refused job: launched through torchrun.)"""
    from training_runs import train_histories

    sets = TINY + ["parallel.dp=2", "parallel.zero=1", "checkpoint.async_save=true", f"train.out_dir={tmp_path}/out",
                   f"checkpoint.dir={tmp_path}/ck"]
    assert len(train_histories(2, sets, [["train.steps=2"]])[0]) == 2
    ck = tmp_path / "ck" / "step_00000002"
    sums = json.loads((ck / "tessera.json").read_text())["checksums"]
    assert any(n.startswith("__0_") for n in sums) and any(n.startswith("__1_") for n in sums)
    victim = max((n for n in sums if n.startswith("__1_")), key=lambda n: os.path.getsize(ck / n))
    _flip(ck / victim, os.path.getsize(ck / victim) // 2)
    second = subprocess.run([sys.executable, "-m", "tessera", "train", "--nproc-per-node", "2",
                             *(a for s in sets + ["train.steps=4"] for a in ("--set", s))],
                            capture_output=True, text=True, timeout=240)
    # one line, said once (by rank 0), no traceback; torchrun's own log lines may follow
    ours = [line for line in second.stderr.splitlines() if line.startswith("tessera: ")]
    assert second.returncode == 2 and len(ours) == 1 and "Traceback" not in second.stderr, second.stderr[-3000:]
    assert f"is damaged: {victim} (CRC-32 " in ours[0]
