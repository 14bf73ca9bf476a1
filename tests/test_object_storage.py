"""Checkpoints in an object store (checkpoint/files.py): against moto's S3 server, started here on
localhost, a run saves to s3://, resumes from its newest complete checkpoint and ends as a local
run does; a save that died (its objects there, no tessera.json: the commit marker, written last)
is never read and is replaced by the next save of its step; checkpoint.keep removes old ones; a
bucket that is not there, or a protocol fsspec cannot open, is refused in words."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto")

from tessera.checkpoint import checkpoints  # noqa: E402
from tessera.config import ConfigError, load_config  # noqa: E402
from tessera.testing import free_port  # noqa: E402

TINY = ["data.source=synthetic", "model.layers=2", "model.hidden=32", "model.heads=2", "model.seq_len=16",
        "model.vocab_size=64", "train.micro_batch=1", "train.global_batch=2", "train.sample_tokens=0",
        "optim.decay_steps=10", "train.device=cpu", "train.log_every=1"]


@pytest.fixture(scope="module")
def s3():
    """moto's S3 server on a free local port; the standard AWS variables point every client at it
    (credentials and endpoint: botocore's own way). Yields a function giving a fresh bucket's URL."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-p", str(port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        deadline = time.monotonic() + 60  # (generous: bounds a server that never starts)
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "moto's server did not start"
                time.sleep(0.2)
        import s3fs

        made = []

        def bucket(name: str) -> str:
            s3fs.S3FileSystem(skip_instance_cache=True).mkdir(name)
            made.append(name)
            return f"s3://{name}"
        yield bucket
    finally:
        server.kill()
        server.wait()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _train(sets):
    from tessera.training.trainer import train

    return train(load_config(None, TINY + sets))


def _fs():
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_saves_to_s3_and_resumes_from_its_newest_complete_checkpoint(s3, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "1")
    url = s3("runs") + "/tiny"
    first = _train(["train.steps=4", "checkpoint.save_every=2", f"checkpoint.dir={url}", f"train.out_dir={tmp_path}/a"])
    assert [step for step, _ in checkpoints(url)] == [2, 4]
    fs = _fs()
    names = sorted(p.rsplit("/", 1)[1] for p in fs.ls("runs/tiny/step_00000004"))
    assert "tessera.json" in names and ".metadata" in names and any(n.endswith(".distcp") for n in names)
    # a save of step 6 that died: its data there, not its tessera.json (the marker is written last)
    for name in names:
        if name != "tessera.json":
            fs.copy(f"runs/tiny/step_00000004/{name}", f"runs/tiny/step_00000006/{name}")
    assert [step for step, _ in checkpoints(url)] == [2, 4]  # (never read)
    resumed = _train(["train.steps=8", "checkpoint.save_every=2", f"checkpoint.dir={url}", f"train.out_dir={tmp_path}/b"])
    assert f"resumed from {url}/step_00000004 at step 4" in capsys.readouterr().out
    assert [step for step, _ in checkpoints(url)] == [2, 4, 6, 8]  # (the dead save's step written anew)
    straight = _train(["train.steps=8", f"train.out_dir={tmp_path}/c", "checkpoint.save_every=2",
                       f"checkpoint.dir={tmp_path}/ck"])
    keys = ("step", "loss", "grad_norm", "lr")
    assert [[m[k] for k in keys] for m in first + resumed] == [[m[k] for k in keys] for m in straight]
    _train(["train.steps=10", "checkpoint.keep=2", f"checkpoint.dir={url}", f"train.out_dir={tmp_path}/d"])
    assert [step for step, _ in checkpoints(url)] == [8, 10]
    assert not fs.exists("runs/tiny/step_00000002")


def test_a_bucket_that_is_not_there_is_refused_before_any_work(s3, tmp_path):
    from tessera.training.preflight import check_runnable

    with pytest.raises(ConfigError) as e:
        check_runnable(load_config(None, TINY + ["checkpoint.dir=s3://no-such-bucket/run", f"train.out_dir={tmp_path}"]), 1)
    assert e.value.key == "checkpoint.dir" and e.value.problem.startswith("cannot write to s3://no-such-bucket/run (")
    with pytest.raises(ConfigError) as e:
        check_runnable(load_config(None, TINY + ["checkpoint.dir=nosuchproto://b/run", f"train.out_dir={tmp_path}"]), 1)
    assert e.value.key == "checkpoint.dir" and "nosuchproto://b/run" in e.value.problem


def test_an_indexed_dataset_in_s3_trains_as_its_local_copy_does(s3, tmp_path, monkeypatch):
    """data.paths=s3://...: the .idx copied into data.cache_dir, the .bin read by ranges through a
    block cache there; the losses are those of the same files on the local disk."""
    import numpy as np

    from tessera.data import IndexedDatasetWriter

    monkeypatch.setenv("WORLD_SIZE", "1")
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(tmp_path / "corpus", np.uint16) as writer:
        for _ in range(300):
            writer.add_document(rng.integers(0, 63, int(rng.integers(5, 60))).tolist() + [63])
    url = s3("data") + "/sets/corpus"
    fs = _fs()
    for suffix in (".bin", ".idx"):
        fs.put_file(str(tmp_path / f"corpus{suffix}"), f"data/sets/corpus{suffix}")
    common = ["data.source=indexed", "train.steps=3", "data.split=90,10,0"]
    remote = _train(common + [f"data.paths={url}", f"data.cache_dir={tmp_path}/cache", f"train.out_dir={tmp_path}/a"])
    local = _train(common + [f"data.paths={tmp_path}/corpus", f"train.out_dir={tmp_path}/b"])
    keys = ("step", "loss", "grad_norm")
    assert [[m[k] for k in keys] for m in remote] == [[m[k] for k in keys] for m in local]
    kept = list((tmp_path / "cache" / "remote").iterdir())
    idx = [p for p in kept if p.name.startswith("corpus.idx-")]
    assert len(idx) == 1 and (idx[0] / "corpus.idx").read_bytes() == (tmp_path / "corpus.idx").read_bytes()
    blocks = [p for p in kept if p.name.startswith("corpus.bin-")]
    assert len(blocks) == 1 and any((blocks[0] / "blocks-rank0").iterdir())  # (read by ranges, kept locally)
    assert not any(p.name == "corpus.bin" for p in (tmp_path / "cache").rglob("*"))  # (never copied whole)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_ranks_save_to_s3_in_the_background_and_resume(s3, tmp_path):
    """Two processes, zero=1, checkpoint.async_save: each rank writes (and checksums) its own
    objects, rank 0 the marker; the job run again resumes from s3 and ends where one run does.
    (The trainer in two rank processes, as each torchrun worker runs it: the launch itself is
    test_cli_launch's and test_checkpoint's.)"""
    from training_runs import train_outputs

    url = s3("ranks") + "/run"
    sets = ["parallel.dp=2", "parallel.zero=1", "checkpoint.async_save=true", "checkpoint.save_every=2"]
    env = {k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
                                       "AWS_ENDPOINT_URL")}
    (first, _), (resumed, out), (straight, _) = train_outputs(2, TINY + sets, [
        ["train.steps=2", f"train.out_dir={tmp_path / 'a'}", f"checkpoint.dir={url}"],
        ["train.steps=4", f"train.out_dir={tmp_path / 'b'}", f"checkpoint.dir={url}"],
        ["train.steps=4", f"train.out_dir={tmp_path / 'c'}", f"checkpoint.dir={tmp_path / 'ck'}"]], env=env)
    assert f"resumed from {url}/step_00000002 at step 2" in out
    assert [step for step, _ in checkpoints(url)] == [2, 4]
    sums = json.loads(_fs().cat_file("ranks/run/step_00000004/tessera.json"))["checksums"]
    assert any(n.startswith("__0_") for n in sums) and any(n.startswith("__1_") for n in sums)
    keys = ("step", "loss", "grad_norm")
    assert [[m[k] for k in keys] for m in first + resumed] == [[m[k] for k in keys] for m in straight]


def test_missing_credentials_are_refused_before_any_work(s3, tmp_path, monkeypatch):
    """No AWS credentials anywhere botocore looks: refused in words naming the key, before training."""
    from tessera.training.preflight import check_runnable

    url = s3("nocreds") + "/run"
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()  # (fsspec keeps the earlier tests' clients, credentials and all)
    try:
        with pytest.raises(ConfigError) as e:
            check_runnable(load_config(None, TINY + [f"checkpoint.dir={url}", f"train.out_dir={tmp_path}"]), 1)
    finally:
        s3fs.S3FileSystem.clear_instance_cache()  # (nor the later tests this one's)
    assert e.value.key == "checkpoint.dir" and "NoCredentialsError" in e.value.problem
    assert "AWS_ACCESS_KEY_ID" in str(e.value)
