"""A Hugging Face tokenizer from a snapshot's ``tokenizer.json`` + ``tokenizer_config.json``, on the ``tokenizers``
package alone (no transformers): batched encoding to NumPy with padding, decoding, and the special-token map that
chat templates see.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import numpy as np
import tokenizers

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{os.path.basename(path)}: not valid JSON in {path!r} ({e})") from None


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, an AddedToken dict or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"tokenizer_config.json: expected a special token string or {{'content': ...}}, got {value!r}")


def clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization`` (used when ``clean_up_tokenization_spaces`` is true)."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
                 (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


class Tokenizer:
    """``tokenizers.Tokenizer`` plus the settings of ``tokenizer_config.json``.

    ``special_tokens_map``: the non-null ``bos/eos/unk/sep/pad/cls/mask_token`` strings (what transformers passes to
    chat templates); ``padding_side`` (default ``"right"``); ``clean_up_tokenization_spaces``.
    """

    def __init__(self, backend: tokenizers.Tokenizer, config: dict | None = None):
        config = dict(config or {})
        self.backend = backend
        self.config = config
        self.special_tokens_map = {k: t for k in SPECIAL_TOKEN_KEYS if (t := _token_text(config.get(k))) is not None}
        for key, tok in self.special_tokens_map.items():
            if backend.token_to_id(tok) is None:
                raise ValueError(f"tokenizer_config.json: {key} {tok!r} is not in tokenizer.json's vocabulary")
        self.padding_side = config.get("padding_side", "right")
        if self.padding_side not in ("left", "right"):
            raise ValueError(f"tokenizer_config.json: padding_side must be 'left' or 'right', "
                             f"got {self.padding_side!r}")
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self._check_added_tokens(config.get("added_tokens_decoder") or {})

    def _check_added_tokens(self, decoder: dict) -> None:
        for sid, entry in sorted(decoder.items(), key=lambda kv: int(kv[0])):
            content = _token_text(entry)
            have = self.backend.id_to_token(int(sid))
            if have == content:
                continue
            if have is None and int(sid) == self.backend.get_vocab_size(with_added_tokens=True):
                added = tokenizers.AddedToken(content, special=bool(entry.get("special", False)),
                                              normalized=bool(entry.get("normalized", False)),
                                              lstrip=bool(entry.get("lstrip", False)),
                                              rstrip=bool(entry.get("rstrip", False)),
                                              single_word=bool(entry.get("single_word", False)))
                (self.backend.add_special_tokens if entry.get("special") else self.backend.add_tokens)([added])
                continue
            raise ValueError(f"tokenizer_config.json: added token {sid} is {content!r} but tokenizer.json has {have!r}")

    @classmethod
    def from_pretrained(cls, snapshot_dir: str | os.PathLike) -> "Tokenizer":
        """Load ``tokenizer.json`` (required) and ``tokenizer_config.json`` (optional) from a snapshot directory."""
        snapshot_dir = os.fspath(snapshot_dir)
        path = os.path.join(snapshot_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise ValueError(f"snapshot_dir: no tokenizer.json in {snapshot_dir!r}")
        try:
            backend = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # tokenizers raises its own Exception type for bad files
            raise ValueError(f"tokenizer.json: cannot load {path!r} ({e})") from None
        cfg_path = os.path.join(snapshot_dir, "tokenizer_config.json")
        return cls(backend, read_json(cfg_path) if os.path.isfile(cfg_path) else {})

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def special_id(self, key: str) -> int | None:
        """Id of ``special_tokens_map[key]`` (e.g. ``"eos_token"``), or None."""
        tok = self.special_tokens_map.get(key)
        return None if tok is None else self.backend.token_to_id(tok)

    def encode(self, texts: Sequence[str], *, padding: bool | str = False, padding_side: str | None = None,
               add_special_tokens: bool = True) -> dict[str, np.ndarray]:
        """``input_ids`` / ``attention_mask`` int64 [B, L] for B texts; rows of unequal length need ``padding``
        (True / "longest": pad to the longest row with ``pad_token`` on ``padding_side``)."""
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise ValueError("text: expected a list of strings")
        if padding not in (False, True, "longest", "do_not_pad"):
            raise ValueError(f"padding: expected False, True or 'longest', got {padding!r}")
        side = self.padding_side if padding_side is None else padding_side
        if side not in ("left", "right"):
            raise ValueError(f"padding_side: expected 'left' or 'right', got {side!r}")
        rows = [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]
        length = max((len(r) for r in rows), default=0)
        if any(len(r) != length for r in rows) and padding in (False, "do_not_pad"):
            raise ValueError(f"text: rows tokenize to different lengths {[len(r) for r in rows]}; pass padding=True")
        pad_id = self.special_id("pad_token")
        if pad_id is None and any(len(r) != length for r in rows):
            raise ValueError("padding: tokenizer_config.json has no pad_token")
        ids = np.full((len(rows), length), pad_id if pad_id is not None else 0, np.int64)
        mask = np.zeros((len(rows), length), np.int64)
        for i, r in enumerate(rows):
            sl = slice(length - len(r), length) if side == "left" else slice(0, len(r))
            ids[i, sl] = r
            mask[i, sl] = 1
        return {"input_ids": ids, "attention_mask": mask}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """Text of a 1-D sequence of token ids."""
        ids = np.asarray(ids)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"ids: expected a 1-D sequence of ints, got shape {ids.shape} dtype {ids.dtype}")
        text = self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if self.clean_up_tokenization_spaces else text

    def batch_decode(self, sequences, skip_special_tokens: bool = False) -> list[str]:
        """Texts of a [B, L] array or a list of id sequences."""
        return [self.decode(s, skip_special_tokens=skip_special_tokens) for s in sequences]
