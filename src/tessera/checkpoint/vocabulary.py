"""Which tokenizer a checkpoint's model reads, and which ids end its documents: what an export
puts beside the weights, and what generation encodes prompts with and stops at.

The tokenizer, first found of: the one given (``--tokenizer``); the checkpoint's own
``tokenizer.json`` (``tessera checkpoint import`` copies a transformers folder's); the run's
``train.sample_tokenizer``; the ``PREFIX.tokenizer.json`` that ``tessera preprocess`` wrote
beside the run's first indexed dataset; bytes, for the builtin corpus. Synthetic tokens have
none. Paths a run named are relative to where it ran.

The end-of-document ids: an imported model's ``eos_token_id`` (one or several), else the run's
``data.eod_id``, else the builtin corpus's (0), else the tokenizer's own end-of-document token
(the one `tessera preprocess` appends), else none.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tessera.data.indexed_source import BUILTIN_EOD

TOKENIZER = "tokenizer.json"


@dataclass(frozen=True)
class Vocabulary:
    file: str | None  # a tokenizer.json
    byte_tokens: bool  # the builtin corpus's bytes (data/tokenizer.py's ByteTokenizer)
    missing: str | None  # why there is none, where neither
    stop_ids: tuple[int, ...]  # the ids that end a document


def vocabulary(path: str, meta: dict, given: str | None = None) -> Vocabulary:
    """The tokenizer and end-of-document ids of the checkpoint ``path`` (its ``tessera.json``
    ``meta``), or of the tokenizer ``given`` (a tokenizer.json or a folder holding one)."""
    config = meta["config"]
    data = config.get("data", {})
    imported = meta.get("contents") == "weights"
    file, missing = _file(path, config, imported, given)
    byte_tokens = file is None and not imported and data.get("source") == "builtin"
    stops = meta.get("stop_ids") or []
    if not stops and data.get("eod_id", -1) >= 0:
        stops = [data["eod_id"]]
    if not stops and byte_tokens:
        stops = [BUILTIN_EOD]
    if not stops and file is not None:
        from tessera.checkpoint.hf import end_of_document

        eod = end_of_document(file, -1)
        stops = [] if eod is None else [eod]
    return Vocabulary(file, byte_tokens, None if file or byte_tokens else missing, tuple(stops))


def _file(path: str, config: dict, imported: bool, given: str | None) -> tuple[str | None, str | None]:
    if given:
        target = os.path.join(given, TOKENIZER) if os.path.isdir(given) else given
        if not os.path.isfile(target):
            raise ValueError(f"--tokenizer {given}: no such file (a tokenizer.json or a folder holding one)")
        return target, None
    own = os.path.join(path, TOKENIZER)
    if os.path.isfile(own):
        return own, None
    if imported:
        return None, "the imported checkpoint holds no tokenizer.json (its transformers folder had none)"
    spec = config.get("train", {}).get("sample_tokenizer", "")
    if spec:
        target = os.path.join(spec, TOKENIZER) if os.path.isdir(spec) else spec
        return (target, None) if os.path.isfile(target) else (
            None, f"the run's train.sample_tokenizer {spec} is not found from {os.getcwd()}")
    data = config.get("data", {})
    if data.get("source") == "indexed" and data.get("paths"):
        from tessera.data.blend import parse_blend

        beside = parse_blend(data["paths"])[0][1] + ".tokenizer.json"
        return (beside, None) if os.path.isfile(beside) else (None, f"no {beside} from {os.getcwd()}")
    return None, f"the run's data.source={data.get('source')} has no tokenizer"


__all__ = ["TOKENIZER", "Vocabulary", "vocabulary"]
