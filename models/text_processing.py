"""``TextProcessor``: the tokenizer and chat template of a text-only snapshot (Llama, Qwen3), NumPy outputs
with transformers' keys (``input_ids``, ``attention_mask``)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from models import chat_template as templates
from models.snapshot import resolve_snapshot
from models.tokenizer import Tokenizer


class TextProcessor:
    """Tokenizer + chat template of one snapshot; ``eos_token_id`` / ``pad_token_id`` from the tokenizer config."""

    def __init__(self, tokenizer: Tokenizer, chat_template: str | dict[str, str] | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.eos_token_id = tokenizer.special_id("eos_token")
        self.pad_token_id = tokenizer.special_id("pad_token")

    @classmethod
    def from_pretrained(cls, snapshot_dir: str | os.PathLike) -> "TextProcessor":
        """Load ``tokenizer.json`` (+ ``tokenizer_config.json``) and the chat template from a snapshot directory
        or a hub-cache model tree."""
        d = resolve_snapshot(snapshot_dir, marker="tokenizer.json")
        return cls(Tokenizer.from_pretrained(d), templates.load_chat_template(d))

    def __call__(self, text: str | Sequence[str], images=None, videos=None, *, video_metadata=None,
                 padding: bool | str = False, padding_side: str | None = None, add_special_tokens: bool = True,
                 return_tensors: str | None = None) -> dict[str, np.ndarray]:
        """``input_ids`` / ``attention_mask`` int64 [B, L] of one text (B = 1) or a batch, as the HF tokenizer
        gives them (``add_special_tokens``: e.g. Llama's BOS). ``return_tensors``: None or "np". ``images`` /
        ``videos`` / ``video_metadata`` (the VLM processors' arguments) must be None: a ValueError otherwise."""
        for name, value in (("images", images), ("videos", videos), ("video_metadata", video_metadata)):
            if value is not None:
                raise ValueError(f"{name}: a text-only model's processor takes text only")
        if return_tensors not in (None, "np"):
            raise ValueError(f"return_tensors: only NumPy outputs (None or 'np'), got {return_tensors!r}")
        texts = [text] if isinstance(text, str) else list(text)
        if not texts or not all(isinstance(t, str) for t in texts):
            raise ValueError("text: expected a string or a non-empty list of strings")
        return self.tokenizer.encode(texts, padding=padding, padding_side=padding_side,
                                     add_special_tokens=add_special_tokens)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tokenize: bool = False, *,
                            chat_template: str | None = None, tools=None, documents=None, **variables):
        """Render a conversation (list of ``{"role", "content"}`` dicts) or a batch of them with the snapshot's
        chat template as transformers does (the template sees the special tokens, e.g. ``bos_token``, and extra
        ``variables``). ``add_generation_prompt`` defaults to True (mmjax renders prompts to answer them).
        ``tokenize=True`` returns the ids (int64 [L], or [B, L] padded for a batch) without adding special
        tokens again, as transformers' ``apply_chat_template(tokenize=True)``."""
        return templates.apply_chat_template(
            self.chat_template, chat_template, self.tokenizer, messages, add_generation_prompt=add_generation_prompt,
            tokenize=tokenize, add_special_tokens=False, tools=tools, documents=documents, **variables)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Text of a 1-D sequence of token ids (special tokens skipped by default)."""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences, skip_special_tokens: bool = True) -> list[str]:
        """Texts of a [B, L] array or a list of id sequences (special tokens skipped by default)."""
        return self.tokenizer.batch_decode(sequences, skip_special_tokens=skip_special_tokens)
