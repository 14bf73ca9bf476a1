"""Preprocessing JSON lines into a .bin/.idx pair: round trip through a BPE trained on the input,
.gz and directory inputs, workers, errors naming file:line, the CLI, and no pair after a failure."""

from __future__ import annotations

import gzip
import json
import os
import shutil

import numpy as np
import pytest

pytest.importorskip("tokenizers")  # installed with tessera; a GPU box without network may lack it

from tessera.cli import main
from tessera.data import preprocess as pre
from tessera.data.indexed import IndexedDataset, IndexedDatasetWriter
from tessera.data.preprocess import PreprocessError, preprocess

TEXTS = [
    "Hello world! Hello tessera.",
    "Ünïcödé, ελληνικά, 中文 and 🙂 survive byte-level BPE.",
    "",
    "  leading spaces\n\ttabs and\nnew lines\n",
    "the quick brown fox jumps over the lazy dog " * 5,
    'quotes " and backslashes \\ too',
]


def jsonl(path, texts, key="text", opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"id": i, key: t}) + "\n")
    return path


def decoded(prefix, tokenizer_path):
    """Each document decoded with the saved tokenizer; asserts it ends with the one EOD token."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    eod = tok.token_to_id("<|endoftext|>")
    ds = IndexedDataset(prefix)
    assert len(ds) == ds.num_documents
    out = []
    for i in range(len(ds)):
        ids = ds[i].tolist()
        assert ids[-1] == eod and eod not in ids[:-1]
        out.append(tok.decode(ids[:-1]))
    return out


def test_bpe_round_trip(tmp_path):
    src = jsonl(tmp_path / "in.jsonl", TEXTS)
    r = preprocess(src, tmp_path / "out" / "ds", "bpe:300", progress=False)
    assert (r.documents, r.vocab_size, r.dtype) == (len(TEXTS), 300, np.uint16)
    assert r.tokenizer_path == str(tmp_path / "out" / "ds.tokenizer.json")
    assert decoded(tmp_path / "out" / "ds", r.tokenizer_path) == TEXTS
    ds = IndexedDataset(tmp_path / "out" / "ds")
    assert ds.num_tokens == r.tokens and ds.dtype == np.uint16
    assert int(max(ds[i].max() for i in range(len(ds)))) < 300
    assert ds[2].tolist() == [r.eod_id]  # an empty text is a document of just the EOD


def test_gzip_and_directory_inputs(tmp_path):
    plain = jsonl(tmp_path / "plain.jsonl", TEXTS)
    jsonl(tmp_path / "zipped.jsonl.gz", TEXTS, opener=gzip.open)
    r = preprocess(plain, tmp_path / "p", "bpe:300", progress=False)
    preprocess(tmp_path / "zipped.jsonl.gz", tmp_path / "z", r.tokenizer_path, progress=False)
    assert (tmp_path / "p.bin").read_bytes() == (tmp_path / "z.bin").read_bytes()
    assert (tmp_path / "p.idx").read_bytes() == (tmp_path / "z.idx").read_bytes()

    folder = tmp_path / "corpus"
    folder.mkdir()
    jsonl(folder / "b.jsonl.gz", ["second file"], opener=gzip.open)
    jsonl(folder / "a.jsonl", ["first file", "still first"])
    jsonl(folder / "c.jsonl", ["third file"])
    (folder / "notes.txt").write_text("not an input")
    (folder / "d.json").write_text("{}")
    r = preprocess(folder, tmp_path / "dir", "bpe:300", progress=False)
    assert decoded(tmp_path / "dir", r.tokenizer_path) == ["first file", "still first", "second file", "third file"]


def test_given_tokenizer_file_or_folder_and_workers(tmp_path):
    src = jsonl(tmp_path / "in.jsonl", TEXTS * 3)
    r = preprocess(src, tmp_path / "one", "bpe:300", progress=False)
    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(r.tokenizer_path, folder / "tokenizer.json")
    pre_chunk = pre.CHUNK_LINES
    pre.CHUNK_LINES = 4  # several chunks, so the two workers' results must come back in order
    try:
        r2 = preprocess(src, tmp_path / "two", str(folder), workers=2, progress=False)
    finally:
        pre.CHUNK_LINES = pre_chunk
    assert r2.documents == len(TEXTS) * 3
    # the given tokenizer is saved beside the pair as the data's own
    assert r2.tokenizer_path == str(tmp_path / "two") + ".tokenizer.json"
    from tokenizers import Tokenizer
    assert Tokenizer.from_file(r2.tokenizer_path).to_str() == Tokenizer.from_file(r.tokenizer_path).to_str()
    assert (tmp_path / "one.bin").read_bytes() == (tmp_path / "two.bin").read_bytes()
    assert (tmp_path / "one.idx").read_bytes() == (tmp_path / "two.idx").read_bytes()


def test_blank_lines_are_skipped_and_vocab_size_picks_dtype(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "a b"}\n\n   \n{"text": "c"}\n')
    r = preprocess(path, tmp_path / "d", "bpe:300", vocab_size=128256, progress=False)
    assert r.documents == 2 and r.dtype == np.int32 and IndexedDataset(tmp_path / "d").dtype == np.int32
    with pytest.raises(PreprocessError, match=r"--vocab-size 100 is smaller than the tokenizer's 258 ids"):
        preprocess(path, tmp_path / "e", r.tokenizer_path, vocab_size=100, progress=False)


@pytest.mark.parametrize("lines,message", [
    ('{"text": "ok"}\n{"text": "ok"}\nnot json\n', r"in\.jsonl:3: not valid JSON"),
    ('{"text": "ok"}\n{"body": "x"}\n', r"in\.jsonl:2: no key 'text' \(found keys \['body'\]\)"),
    ('{"text": 5}\n', r"in\.jsonl:1: 'text' is an int, expected a string"),
    ('[1, 2]\n', r"in\.jsonl:1: an array, not an object; the input is JSON Lines"),
    ('"just text"\n', r"in\.jsonl:1: a string, not an object"),
])
def test_bad_lines_name_file_and_line(tmp_path, lines, message):
    (tmp_path / "in.jsonl").write_text(lines)
    for tokenizer in ("bpe:300", None):  # while training and while encoding
        if tokenizer is None:
            jsonl(tmp_path / "good.jsonl", TEXTS)
            tokenizer = preprocess(tmp_path / "good.jsonl", tmp_path / "good", "bpe:300",
                                   progress=False).tokenizer_path
        with pytest.raises(PreprocessError, match=message):
            preprocess(tmp_path / "in.jsonl", tmp_path / "out", tokenizer, progress=False)
        assert not IndexedDataset.exists(tmp_path / "out")


def test_bad_inputs_and_tokenizers(tmp_path):
    with pytest.raises(PreprocessError, match="nope.jsonl: no such file"):
        preprocess(tmp_path / "nope.jsonl", tmp_path / "o", "bpe:300")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PreprocessError, match=r"empty: no \*\.jsonl"):
        preprocess(tmp_path / "empty", tmp_path / "o", "bpe:300")
    src = jsonl(tmp_path / "in.jsonl", TEXTS)
    with pytest.raises(PreprocessError, match=r"missing[/\\]tokenizer\.json: no such tokenizer file"):
        os.mkdir(tmp_path / "missing")
        preprocess(src, tmp_path / "o", str(tmp_path / "missing"))
    with pytest.raises(PreprocessError, match="at least 257 ids"):
        preprocess(src, tmp_path / "o", "bpe:100")
    with pytest.raises(PreprocessError, match="expected bpe:V"):
        preprocess(src, tmp_path / "o", "bpe:lots")
    with pytest.raises(PreprocessError, match="--vocab-size must be >= 1, got 0"):
        preprocess(src, tmp_path / "o", "bpe:300", vocab_size=0)
    (tmp_path / "junk.json").write_text("{not a tokenizer")
    with pytest.raises(PreprocessError, match="junk.json: not a Hugging Face tokenizers file"):
        preprocess(src, tmp_path / "o", str(tmp_path / "junk.json"))


def test_tokenizer_without_eod(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2, "[END]": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "words.json"))
    src = jsonl(tmp_path / "in.jsonl", ["hello world", "world"])
    with pytest.raises(PreprocessError, match="no end-of-document token .*--eod-token"):
        preprocess(src, tmp_path / "o", str(tmp_path / "words.json"), progress=False)
    preprocess(src, tmp_path / "o", str(tmp_path / "words.json"), eod_token="[END]", progress=False)
    assert [x.tolist() for x in IndexedDataset(tmp_path / "o")] == [[0, 1, 3], [1, 3]]


def test_failure_midway_leaves_no_pair(tmp_path, monkeypatch):
    # Chunks of one line: the first documents are already written when line 4 fails.
    monkeypatch.setattr(pre, "CHUNK_LINES", 1)
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b"}\n{"text": "c"}\n{"oops": 1}\n')
    tok = preprocess(jsonl(tmp_path / "good.jsonl", TEXTS), tmp_path / "old", "bpe:300", progress=False).tokenizer_path
    old = (tmp_path / "old.bin").read_bytes()
    with pytest.raises(PreprocessError, match=r"in\.jsonl:4"):
        preprocess(path, tmp_path / "new", tok, progress=False)
    with pytest.raises(PreprocessError, match=r"in\.jsonl:4"):
        preprocess(path, tmp_path / "old", tok, progress=False, overwrite=True)  # over an existing pair
    assert not os.path.exists(tmp_path / "new.bin") and not os.path.exists(tmp_path / "new.idx")
    assert (tmp_path / "old.bin").read_bytes() == old
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_existing_outputs_are_kept_unless_overwrite(tmp_path):
    src = jsonl(tmp_path / "in.jsonl", TEXTS)
    r = preprocess(src, tmp_path / "ds", "bpe:300", progress=False)
    saved = {p: (tmp_path / p).read_bytes() for p in ("ds.bin", "ds.idx", "ds.tokenizer.json")}
    with pytest.raises(PreprocessError, match=r"ds\.bin, .*ds\.idx, .*ds\.tokenizer\.json already exist; .*--overwrite"):
        preprocess(jsonl(tmp_path / "other.jsonl", ["something else"]), tmp_path / "ds", "bpe:300", progress=False)
    with pytest.raises(PreprocessError, match=r"ds\.bin, .*ds\.idx, .*ds\.tokenizer\.json already exist"):
        preprocess(src, tmp_path / "ds", r.tokenizer_path, progress=False)  # a given tokenizer
    (tmp_path / "lone.tokenizer.json").write_text("precious")
    with pytest.raises(PreprocessError, match=r"lone\.tokenizer\.json already exists"):
        preprocess(src, tmp_path / "lone", "bpe:300", progress=False)
    assert {p: (tmp_path / p).read_bytes() for p in saved} == saved
    assert (tmp_path / "lone.tokenizer.json").read_text() == "precious"
    r2 = preprocess(jsonl(tmp_path / "two.jsonl", TEXTS[:2]), tmp_path / "ds", "bpe:300", progress=False,
                    overwrite=True)
    assert r2.documents == 2 and len(IndexedDataset(tmp_path / "ds")) == 2
    # overwritten with a given tokenizer: the old trained one beside the pair is replaced too
    other = preprocess(jsonl(tmp_path / "o.jsonl", ["zzz yyy xxx"] * 9), tmp_path / "o", "bpe:260", progress=False)
    preprocess(src, tmp_path / "ds", other.tokenizer_path, progress=False, overwrite=True)
    assert (tmp_path / "ds.tokenizer.json").read_bytes() == (tmp_path / "o.tokenizer.json").read_bytes()


def test_a_failed_run_leaves_no_trained_tokenizer(tmp_path):
    """The BPE trains on the input before a bad line is met while encoding (an EOD name the
    tokenizer lacks here): neither the pair nor PREFIX.tokenizer.json is left behind."""
    src = jsonl(tmp_path / "in.jsonl", TEXTS)
    with pytest.raises(PreprocessError, match="no end-of-document token"):
        preprocess(src, tmp_path / "ds", "bpe:300", eod_token="<nope>", progress=False)
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": 5}\n')
    with pytest.raises(PreprocessError, match=r"bad\.jsonl:2"):
        preprocess(tmp_path / "bad.jsonl", tmp_path / "ds", "bpe:300", progress=False)
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl", "in.jsonl"]


def test_an_unpaired_surrogate_names_file_and_line(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "fine \\u00e9 \\ud83d\\ude00"}\n{"text": "half \\ud83d here"}\n')
    for tokenizer in ("bpe:300", str(tmp_path / "tok")):
        if tokenizer != "bpe:300":
            shutil.copy(preprocess(jsonl(tmp_path / "good.jsonl", TEXTS), tmp_path / "good", "bpe:300",
                                   progress=False).tokenizer_path, tokenizer)
        with pytest.raises(PreprocessError, match=r"in\.jsonl:2: 'text' holds an unpaired surrogate"):
            preprocess(path, tmp_path / "out", tokenizer, progress=False)
    path.write_bytes(b'{"text": "ok"}\n{"text": "raw \xed\xa0\xbd bytes"}\n')  # a surrogate as CESU-8 bytes
    with pytest.raises(PreprocessError, match=r"in\.jsonl:2: not valid JSON"):
        preprocess(path, tmp_path / "out", "bpe:300", progress=False)
    path.write_text('{"text": "fine \\u00e9 \\ud83d\\ude00"}\n')  # a pair is one character
    r = preprocess(path, tmp_path / "out", "bpe:300", progress=False)
    assert r.documents == 1


def test_cli_preprocess_and_inspect(tmp_path, capsys):
    src = jsonl(tmp_path / "in.jsonl", TEXTS)
    prefix = str(tmp_path / "ds")
    assert main(["preprocess", "--input", str(src), "--key", "text", "--tokenizer", "bpe:300",
                 "--output-prefix", prefix, "--workers", "1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"{len(TEXTS)} documents" in out and "uint16" in out and "ds.tokenizer.json" in out
    eod = int(out.split("eod ")[1].split(")")[0])

    assert main(["data", "inspect", prefix]) == 0  # (with the id data.eod_id needs for packing)
    ds = IndexedDataset(prefix)
    assert capsys.readouterr().out.strip() == (f"{prefix}: documents {len(TEXTS)}, sequences {len(TEXTS)}, "
                                               f"tokens {ds.num_tokens}, dtype uint16, eod {eod} "
                                               "(every document sampled ends with it)")
    with IndexedDatasetWriter(tmp_path / "plain", np.uint16) as w:  # documents without a common end
        w.add_document([5, 6])
        w.add_document([6, 5])
    assert main(["data", "inspect", str(tmp_path / "plain")]) == 0
    assert capsys.readouterr().out.strip().endswith("tokens 4, dtype uint16")
    assert main(["data", "inspect", prefix, "--show", "1"]) == 0
    assert json.loads(capsys.readouterr().out) == ds[1].tolist()

    assert main(["data", "inspect", prefix, "--show", str(len(TEXTS))]) == 2
    assert "out of range" in capsys.readouterr().err
    assert main(["data", "inspect", str(tmp_path / "missing")]) == 2
    assert "missing.idx and" in capsys.readouterr().err

    (tmp_path / "bad.jsonl").write_text('{"text": "x"}\n{"body": "y"}\n')
    assert main(["preprocess", "--input", str(tmp_path / "bad.jsonl"), "--tokenizer", "bpe:300",
                 "--output-prefix", str(tmp_path / "bad"), "--no-progress"]) == 2
    assert "bad.jsonl:2: no key 'text'" in capsys.readouterr().err


@pytest.mark.parametrize("workers", [1, 2])
def test_an_eod_name_in_the_text_is_text_not_a_document_end(tmp_path, workers):
    """A document quoting ``<|endoftext|>`` stays one document: the EOD id only at its end."""
    texts = ["GPT-2 ends documents with <|endoftext|> between them.", "<|endoftext|>", "plain"]
    src = jsonl(tmp_path / "in.jsonl", texts)
    r = preprocess(src, tmp_path / "ds", "bpe:300", progress=False, workers=workers)
    assert decoded(tmp_path / "ds", r.tokenizer_path) == texts  # asserts one EOD, at the end
    # the saved tokenizer is the library's own, special tokens as usual for other uses
    from tokenizers import Tokenizer

    assert Tokenizer.from_file(r.tokenizer_path).encode("<|endoftext|>").ids == [r.eod_id]


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_an_input_without_documents_is_refused(tmp_path, content):
    (tmp_path / "in.jsonl").write_text(content)
    with pytest.raises(PreprocessError, match=r"in\.jsonl: no documents"):
        preprocess(tmp_path / "in.jsonl", tmp_path / "ds", "bpe:300", progress=False)
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


def test_overwrite_that_cannot_save_the_tokenizer_keeps_the_old_outputs_together(tmp_path, monkeypatch):
    """--overwrite, and the disk fills as the tokenizer is saved: the old pair must not be replaced
    by the new one while the old tokenizer stays beside it (ids decoded with the wrong tokenizer)."""
    src = jsonl(tmp_path / "in.jsonl", TEXTS)
    preprocess(src, tmp_path / "ds", "bpe:300", progress=False)
    saved = {p: (tmp_path / p).read_bytes() for p in ("ds.bin", "ds.idx", "ds.tokenizer.json")}
    other = preprocess(jsonl(tmp_path / "o.jsonl", ["zzz yyy xxx"] * 9), tmp_path / "o", "bpe:260",
                       progress=False).tokenizer_path
    real_load = pre.load_tokenizer

    class DiskFull:
        def __init__(self, tok):
            object.__setattr__(self, "tok", tok)

        def __getattr__(self, name):
            return getattr(self.tok, name)

        def __setattr__(self, name, value):
            setattr(self.tok, name, value)

        def save(self, path):
            open(path, "w").close()
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(pre, "load_tokenizer", lambda spec: DiskFull(real_load(spec)))
    with pytest.raises(OSError, match="No space left"):
        preprocess(src, tmp_path / "ds", other, progress=False, overwrite=True)
    assert {p: (tmp_path / p).read_bytes() for p in saved} == saved
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]
