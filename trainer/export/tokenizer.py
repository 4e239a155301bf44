"""The run's tokenizer as a stock fast tokenizer: what ``AutoTokenizer.from_pretrained`` loads from the export.

- A bpe or tokenizer.json tokenizer: the dataset's own ``tokenizer.json``, read bounded and checked against the
  sha256 its manifest records, wrapped as ``PreTrainedTokenizerFast`` with its end-of-text token as eos.
- The byte tokenizer: a byte-level BPE with the 256 bytes as its vocabulary (id = byte) and no merges, which
  encodes as trainpipe's does. Its end-of-text id 0 is the NUL byte, not a token of its own: the generation
  config names it.
"""

from __future__ import annotations

import hashlib
import posixpath
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainpipe.trainer.checkpoint.files import ChecksumMismatch, read_file
from trainpipe.trainer.data.format import files_base, load_manifest
from trainpipe.trainer.data.tokenizer import MAX_TOKENIZER_BYTES
from trainpipe.trainer.errors import DataError
from trainpipe.trainer.store import filesystem


@dataclass(frozen=True)
class ExportedTokenizer:
    """What the export's tokenizer is: its kind, end-of-text id and the sha256 of the tokenizer.json written."""

    kind: str
    eot: int
    vocab_size: int
    sha256: str


def save_tokenizer(dataset_uri: str, out: Path, storage_options: dict[str, Any] | None = None) -> ExportedTokenizer:
    """Write the tokenizer of the dataset at ``dataset_uri`` into the folder ``out`` (``save_pretrained``)."""
    from transformers import PreTrainedTokenizerFast

    manifest = load_manifest(dataset_uri, storage_options)
    entry = manifest["tokenizer"]  # checked by load_manifest: counts, and a file named as a dataset's own
    if "file" in entry:
        tok = _stored(dataset_uri, manifest, storage_options)
        eos = tok.id_to_token(entry["eot"])
        wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=eos, pad_token=eos)
    else:
        wrapped = PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer())
    wrapped.model_max_length = 1 << 30  # the model's context is its config's; the tokenizer does not cut
    wrapped.save_pretrained(str(out))
    body = (out / "tokenizer.json").read_bytes()
    return ExportedTokenizer(
        entry.get("name", "byte"), entry["eot"], entry["vocab_size"], hashlib.sha256(body).hexdigest()
    )


def byte_tokenizer() -> Any:
    """One token per UTF-8 byte, id = the byte's value: trainpipe's byte tokenizer as a tokenizers.Tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _stored(dataset_uri: str, manifest: dict[str, Any], storage_options: dict[str, Any] | None) -> Any:
    from tokenizers import Tokenizer

    entry = manifest["tokenizer"]
    fs, base = filesystem(files_base(dataset_uri, manifest), storage_options)
    rel = posixpath.normpath(entry["file"])
    try:
        body = read_file(fs, base, rel, limit=MAX_TOKENIZER_BYTES, kind="tokenizer.json")
    except (FileNotFoundError, ChecksumMismatch) as exc:
        raise DataError(f"dataset {dataset_uri}: its tokenizer {rel} cannot be read ({exc})") from None
    if hashlib.sha256(body).hexdigest() != entry["sha256"]:
        raise DataError(
            f"dataset {dataset_uri}: its tokenizer {rel} fails its sha256 (altered); re-run `trainpipe shard`"
        )
    try:
        return Tokenizer.from_str(body.decode("utf-8"))
    except Exception as exc:  # noqa: BLE001 - the tokenizers library raises its own kinds
        raise DataError(f"dataset {dataset_uri}: its tokenizer {rel} does not load ({exc})".splitlines()[0]) from None


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte, which the ByteLevel pre-tokenizer maps bytes to."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars
