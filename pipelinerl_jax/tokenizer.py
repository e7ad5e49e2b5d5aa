"""Tokenizers: one small interface, a fixed character vocabulary and a local HF wrapper.

`encode(text)` never adds special tokens; `encode_prompt` prepends BOS (when the tokenizer
has one) and `encode_completion` appends EOS, which is how prompts and supervised targets
are built everywhere. `decode(ids)` drops pad/BOS/EOS ids and, with `stop_at_eos=True`,
ends at the first EOS, so `decode(encode(t)) == t` for any text the vocabulary covers.

`CharTokenizer` is the default for tiny models trained from scratch: one token per
character, vocabulary (``CHAR_VOCAB``, 56 entries, ids fixed forever)::

    0 <pad>   1 <bos>   2 <eos>   3 ' '   4 '\\n'
    5..30  a-z          31..40 0-9
    41..47 + - * / ( ) =          48 #     49..55 . , : ; ? ! '

Characters outside the vocabulary raise `ValueError` naming the character and its position
(there is no unknown token: a silent <unk> would corrupt rewards that compare text).

`HFTokenizer` wraps a Hugging Face tokenizer directory on local disk; nothing is ever
downloaded. Pad falls back to EOS when the tokenizer has no pad token.
"""
from __future__ import annotations

import abc
import os
from typing import Any, Optional, Sequence

import ml_collections

from pipelinerl_jax.config_checks import ConfigError, check_keys

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
CHAR_VOCAB: tuple[str, ...] = (
    (PAD, BOS, EOS, " ", "\n")
    + tuple("abcdefghijklmnopqrstuvwxyz")
    + tuple("0123456789")
    + tuple("+-*/()=")
    + ("#",)
    + tuple(".,:;?!'")
)


class Tokenizer(abc.ABC):
    """What the engine, the rollout worker and the learner need from a tokenizer."""

    name: str
    vocab_size: int
    eos_id: int
    pad_id: int
    bos_id: Optional[int]

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without any special token."""

    @abc.abstractmethod
    def _decode_plain(self, ids: Sequence[int]) -> str:
        """Text of ids that contain no pad/BOS/EOS."""

    def decode(self, ids: Sequence[int], stop_at_eos: bool = False) -> str:
        """Text of `ids` with pad/BOS/EOS dropped; with `stop_at_eos`, ends at the first EOS."""
        special = {self.pad_id, self.eos_id} | ({self.bos_id} if self.bos_id is not None else set())
        kept = []
        for i in ids:
            i = int(i)
            if stop_at_eos and i == self.eos_id:
                break
            if i not in special:
                kept.append(i)
        return self._decode_plain(kept)

    def encode_prompt(self, text: str) -> list[int]:
        """Prompt ids: BOS (when the tokenizer has one) followed by `encode(text)`."""
        return ([self.bos_id] if self.bos_id is not None else []) + self.encode(text)

    def encode_completion(self, text: str) -> list[int]:
        """Target ids for supervised training: `encode(text)` followed by EOS."""
        return self.encode(text) + [self.eos_id]

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size}, "
                f"eos_id={self.eos_id}, pad_id={self.pad_id}, bos_id={self.bos_id})")


class CharTokenizer(Tokenizer):
    """One token per character over the fixed `CHAR_VOCAB` (see the module docstring)."""

    def __init__(self):
        self.name = "char"
        # The special tokens are vocabulary entries, never characters of a text.
        self._id_of = {c: i for i, c in enumerate(CHAR_VOCAB) if i >= 3}
        self.vocab_size = len(CHAR_VOCAB)
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2

    def encode(self, text: str) -> list[int]:
        ids = []
        for pos, ch in enumerate(text):
            i = self._id_of.get(ch)
            if i is None:
                raise ValueError(f"CharTokenizer: character {ch!r} (U+{ord(ch):04X}) at position "
                                 f"{pos} is not in the vocabulary {''.join(CHAR_VOCAB[3:])!r}")
            ids.append(i)
        return ids

    def _decode_plain(self, ids: Sequence[int]) -> str:
        for i in ids:
            if not 0 <= i < self.vocab_size:  # negative ids must not index from the end
                raise ValueError(f"CharTokenizer: id {i} is outside the vocabulary "
                                 f"[0, {self.vocab_size})")
        return "".join(CHAR_VOCAB[i] for i in ids)


class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizer loaded from a local directory (`local_files_only=True`)."""

    def __init__(self, path: str):
        if not os.path.isdir(path):
            raise FileNotFoundError(f"HFTokenizer: tokenizer directory {path!r} does not exist")
        import transformers  # heavy import; only HF users pay for it

        try:
            self._tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as e:  # transformers raises OSError/ValueError with varied texts
            raise ValueError(f"HFTokenizer: cannot load a tokenizer from {path!r}: {e}") from e
        if self._tok.eos_token_id is None:
            raise ValueError(f"HFTokenizer: the tokenizer in {path!r} has no eos token; "
                             "generation needs one")
        self.name = f"hf:{os.path.basename(os.path.normpath(path))}"
        self.path = path
        self.vocab_size = len(self._tok)  # includes added tokens, unlike tok.vocab_size
        self.eos_id = int(self._tok.eos_token_id)
        pad = self._tok.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.eos_id
        bos = self._tok.bos_token_id
        self.bos_id = int(bos) if bos is not None else None

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def _decode_plain(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False,
                                clean_up_tokenization_spaces=False)


# --- config ---------------------------------------------------------------------------

def tokenizer_config() -> ml_collections.ConfigDict:
    """`kind`: 'char' (CharTokenizer) or 'hf' (HFTokenizer); `path`: local HF directory."""
    return ml_collections.ConfigDict({"kind": "char", "path": ""})


def validate_tokenizer_config(cfg: Any, prefix: str = "tokenizer") -> None:
    """Raises ConfigError naming the key (`tokenizer.kind`, `tokenizer.path`)."""
    check_keys(cfg, prefix, ("kind", "path"))
    try:
        kind, path = cfg["kind"], cfg["path"]
    except KeyError as e:
        raise ConfigError(f"{prefix}.{e.args[0]}", "is missing from the config") from None
    if kind not in ("char", "hf"):
        raise ConfigError(f"{prefix}.kind", f"must be one of ['char', 'hf'], got {kind!r}")
    if kind == "hf":
        if not isinstance(path, str) or not path:
            raise ConfigError(f"{prefix}.path", "must name a local tokenizer directory when "
                                                f"{prefix}.kind='hf', got {path!r}")
        if not os.path.isdir(path):
            raise ConfigError(f"{prefix}.path", f"directory {path!r} does not exist")


def get_tokenizer(cfg: Any, prefix: str = "tokenizer") -> Tokenizer:
    """Builds the tokenizer of a `tokenizer_config()` section (validated first)."""
    validate_tokenizer_config(cfg, prefix)
    if cfg["kind"] == "char":
        return CharTokenizer()
    try:
        return HFTokenizer(cfg["path"])
    except ValueError as e:  # unloadable or without EOS: still a config problem
        raise ConfigError(f"{prefix}.path", str(e)) from e
