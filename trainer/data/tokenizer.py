"""The tokenizers the shard stage encodes with (``data.tokenizer``).

- ``byte``: one token per UTF-8 byte (0..255); the end-of-text token is 0, the NUL byte.
- ``bpe``: a byte-level BPE of ``data.vocab_size`` tokens trained on the corpus with Hugging Face
  ``tokenizers`` (deterministic: the same texts give the same tokenizer).
- a path or URI: a ``tokenizer.json`` the ``tokenizers`` library loads.

A bpe or file tokenizer is stored as ``tokenizer.json`` in the dataset folder, so a dataset carries the
tokenizer its tokens came from. Torch-free: the orchestrator shards without importing torch.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

import numpy as np

from trainpipe.trainer import store as st
from trainpipe.trainer.config import BYTE_VOCAB, DataConfig
from trainpipe.trainer.data.sources import NotRegularFile, amount, read_bounded
from trainpipe.trainer.errors import DataError

if TYPE_CHECKING:
    from collections.abc import Iterable

TOKENIZER_FILE = "tokenizer.json"
MAX_TOKENIZER_BYTES = 256 << 20


class Tokenizer(Protocol):
    kind: str  # "byte", "bpe" or "file"
    vocab_size: int
    eot: int

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each text (no special tokens added), as unsigned integer arrays."""
        ...

    def to_json(self) -> str | None:
        """The tokenizer.json to store with the dataset; None for the byte tokenizer."""
        ...


class ByteTokenizer:
    kind, vocab_size, eot = "byte", BYTE_VOCAB, 0

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def to_json(self) -> None:
        return None


class HFTokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` under the protocol above."""

    def __init__(self, tokenizer, kind: str, eot_token: str, where: str):
        eot = tokenizer.token_to_id(eot_token)
        if eot is None:
            raise DataError(
                f"tokenizer {where} has no token {eot_token!r}; set data.eot_token to its end-of-text token "
                "(e.g. </s> or <|end_of_text|>)"
            )
        # A special token's text in a document is text, not the token: a corpus cannot end documents early.
        tokenizer.encode_special_tokens = True
        self.tok, self.kind, self.eot = tokenizer, kind, eot
        # The highest id + 1, not the number of tokens: a tokenizer.json's ids may have gaps.
        self.vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.uint32) for e in self.tok.encode_batch_fast(texts, add_special_tokens=False)]

    def to_json(self) -> str:
        return self.tok.to_str()


TokenDtype = Literal["uint16", "uint32"]


def token_dtype(vocab_size: int) -> TokenDtype:
    """The narrowest unsigned type that holds every token id: uint16 up to 65,536 tokens, else uint32."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def read_tokenizer_file(uri: str, storage_options: dict | None) -> str:
    """The text of the tokenizer.json at ``uri`` (a local path or fsspec URI)."""
    fs, path = st.filesystem(uri, storage_options)
    too_big = f"data.tokenizer {uri}: larger than {amount(MAX_TOKENIZER_BYTES)}, not a tokenizer.json"
    try:
        if (fs.size(path) or 0) > MAX_TOKENIZER_BYTES:  # refused before a byte is fetched, when the size says so
            raise DataError(too_big)
        # The size alone is not trusted: /dev/zero reports 0, a FIFO waits for a writer, /proc files report 0.
        body = read_bounded(fs, path, MAX_TOKENIZER_BYTES)
        if body is None:
            raise DataError(too_big)
        return body.decode("utf-8")
    except NotRegularFile as exc:
        raise DataError(
            f"data.tokenizer {uri}: not a regular file ({exc.what}); give 'byte', 'bpe' or the path of a tokenizer.json"
        ) from None
    except FileNotFoundError:
        raise DataError(
            f"data.tokenizer {uri!r}: no such file; give 'byte', 'bpe' or the path/URI of a tokenizer.json"
        ) from None
    except UnicodeDecodeError:
        raise DataError(f"data.tokenizer {uri}: not a tokenizer.json (not UTF-8 text)") from None
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot read data.tokenizer {uri} ({exc.__class__.__name__}: {exc})") from None


def from_json(text: str, kind: str, eot_token: str, where: str) -> HFTokenizer:
    from tokenizers import Tokenizer as HFTok

    try:
        tok = HFTok.from_str(text)
    except Exception as exc:  # noqa: BLE001 - the Rust side raises plain Exception for every malformed file
        reason = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
        raise DataError(
            f"data.tokenizer {where}: not a tokenizer.json the tokenizers library loads ({reason})"
        ) from None
    return HFTokenizer(tok, kind, eot_token, where)


@dataclass(frozen=True)
class TokenizerSpec:
    """The tokenizer a dataset is made with, as the shard tasks receive it: its kind and, for a bpe or file
    tokenizer, its tokenizer.json. ``identity`` is what ``dataset_id`` and every piece's key hash: the kind and
    the tokenizer.json's sha256 (a trained bpe is identified by what training produced)."""

    kind: str  # "byte", "bpe" or "file"
    json: str | None = None
    eot_token: str = ""

    @functools.cached_property
    def sha256(self) -> str | None:
        return None if self.json is None else hashlib.sha256(self.json.encode()).hexdigest()

    @functools.cached_property
    def identity(self) -> dict:
        if self.json is None:
            return {"kind": "byte"}
        return {"kind": self.kind, "sha256": self.sha256, "eot_token": self.eot_token}

    def load(self) -> Tokenizer:
        """The tokenizer itself; loaded once per process (a shard worker runs many pieces)."""
        return _loaded(self)


@functools.lru_cache(maxsize=4)
def _loaded(spec: TokenizerSpec) -> Tokenizer:
    if spec.json is None:
        return ByteTokenizer()
    return from_json(spec.json, spec.kind, spec.eot_token, spec.kind)


def file_tokenizer(data: DataConfig, storage_options: dict | None) -> TokenizerSpec | None:
    """The spec of a tokenizer.json ``data.tokenizer`` names, checked to load; None for byte and bpe."""
    if data.tokenizer in ("byte", "bpe"):
        return None
    text = read_tokenizer_file(data.tokenizer, storage_options)
    from_json(text, "file", data.eot_token, data.tokenizer)  # one line now when it does not load
    return TokenizerSpec("file", text, data.eot_token)


def check_tokenizer(data: DataConfig, storage_options: dict | None, model_vocab: int) -> None:
    """DataError when a tokenizer.json does not load or has more tokens than the model has rows (bpe and byte
    are checked with the profile)."""
    spec = file_tokenizer(data, storage_options)
    tok = spec.load() if spec is not None else None
    if tok is not None and model_vocab < tok.vocab_size:
        raise DataError(
            f"model.vocab_size {model_vocab} is below the {tok.vocab_size} tokens of data.tokenizer "
            f"{data.tokenizer}: set model.vocab_size: {tok.vocab_size}"
        )


def train_bpe(texts: Iterable[str], vocab_size: int, eot_token: str) -> TokenizerSpec:
    """A byte-level BPE (GPT-2 style pre-tokenization, every byte in the base alphabet) trained on ``texts``."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eot_token],  # id 0, as the byte tokenizer's end-of-text
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return TokenizerSpec("bpe", tok.to_str(), eot_token)


def manifest_entry(spec: TokenizerSpec, file: str | None) -> dict:
    """What the dataset manifest records about its tokenizer (its tokenizer.json stored as ``file``)."""
    tok = spec.load()
    entry = {"name": spec.kind, "vocab_size": tok.vocab_size, "eot": tok.eot}
    if spec.json is not None and file is not None:
        entry |= {"file": file, "sha256": spec.sha256}
    return entry
