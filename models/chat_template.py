"""Chat templates from a snapshot, rendered with jinja2 the way transformers renders them.

Same environment as transformers' ``apply_chat_template``: an immutable sandbox with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, a ``{% generation %}`` block (rendered as its body), a ``tojson``
filter that does not escape HTML (``ensure_ascii=False``, ``indent``, ``separators``, ``sort_keys``), and the
globals ``raise_exception``, ``strftime_now``, ``dict`` and ``namespace`` (no underscore attributes). Messages are
copied to plain JSON data first (arrays, images and other objects become ``"<TypeName>"`` placeholders; keys
whose value is None are dropped; OpenAI ``image_url`` blocks become ``{"type": "image", "url": ...}``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Mapping
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from models.tokenizer import read_json


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for masks; here it renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    def __init__(*args, **kwargs):  # noqa: N805 - jinja's Namespace signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat template: namespace attribute {name!r} starts with '_'")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_template(template: str) -> jinja2.Template:
    """The compiled template (cached); raises ``ValueError`` for a template that does not parse."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=dict, namespace=_Namespace)
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"chat_template: does not parse ({e})") from None


def plain_data(value):
    """A copy of ``value`` made of JSON types only; anything else becomes ``"<TypeName>"``."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, np.generic):
        return plain_data(value.item())
    if isinstance(value, Mapping):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_data(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return f"<{type(value).__name__}>"


def normalize_conversation(messages) -> list[dict]:
    """Drop None-valued keys and turn OpenAI ``image_url`` blocks into ``{"type": "image", "url": ...}``."""
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, Mapping) for m in messages):
        raise ValueError("messages: expected a list of message dicts (or a list of such lists)")
    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        content = message.get("content")
        if isinstance(content, list):
            blocks = []
            for block in content:
                if isinstance(block, Mapping) and block.get("type") == "image_url" and "image_url" in block:
                    info = block["image_url"]
                    blocks.append({"type": "image", "url": info.get("url", "") if isinstance(info, Mapping) else info})
                else:
                    blocks.append(block)
            message["content"] = blocks
        out.append(message)
    return out


def render(template: str, messages, *, add_generation_prompt: bool = False, tools=None, documents=None,
           **variables) -> str:
    """Render one conversation (a list of ``{"role", "content"}`` dicts) with ``template``."""
    chat = plain_data(normalize_conversation(messages))
    try:
        return compile_template(template).render(messages=chat, tools=plain_data(tools),
                                                 documents=plain_data(documents),
                                                 add_generation_prompt=add_generation_prompt, **plain_data(variables))
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"chat_template: {e}") from None


def render_batch(template: str, messages, *, add_generation_prompt: bool, tools=None, documents=None,
                 **variables) -> tuple[list[str], bool]:
    """Render one conversation or a batch (a list of conversations): (rendered texts, batched)."""
    batched = isinstance(messages, (list, tuple)) and len(messages) > 0 and isinstance(messages[0], (list, tuple))
    conversations = list(messages) if batched else [messages]
    return [render(template, c, add_generation_prompt=add_generation_prompt, tools=tools, documents=documents,
                   **variables) for c in conversations], batched


def apply_chat_template(templates: str | dict[str, str] | None, chat_template: str | None, tokenizer, messages, *,
                        add_generation_prompt: bool, tokenize: bool, media_tokens: tuple[str, ...] = (),
                        add_special_tokens: bool = True, tools=None, documents=None, **variables):
    """The processors' ``apply_chat_template``: one conversation or a batch rendered with the snapshot's
    template (`resolve` of ``templates`` / ``chat_template``; the template also sees ``tokenizer``'s special
    tokens and ``variables``): the text (a list for a batch), or with ``tokenize`` its ids (int64 [L], or
    [B, L] padded for a batch). A conversation whose text holds one of ``media_tokens`` (image / video
    placeholders) cannot be tokenized here: ValueError naming the processor call to make instead."""
    rendered, batched = render_batch(resolve(templates, chat_template), messages,
                                     add_generation_prompt=add_generation_prompt, tools=tools, documents=documents,
                                     **{**tokenizer.special_tokens_map, **variables})
    if not tokenize:
        return rendered if batched else rendered[0]
    if any(token in r for token in media_tokens for r in rendered):
        raise ValueError("tokenize: the conversation has images or videos; call processor(text=rendered, "
                         "images=..., videos=...) instead")
    ids = tokenizer.encode(rendered, padding=batched, add_special_tokens=add_special_tokens)["input_ids"]
    return ids if batched else ids[0]


def load_chat_template(snapshot_dir: str | os.PathLike) -> str | dict[str, str] | None:
    """The chat template(s) of a snapshot, looked up as transformers 5 does for a processor:
    ``chat_template.json`` (legacy, ``{"chat_template": ...}``), else ``chat_template.jinja`` plus any
    ``chat_templates/*.jinja`` (a dict by name when there are several; "default" is ``chat_template.jinja``),
    else ``processor_config.json``'s ``chat_template``, else ``tokenizer_config.json``'s ``chat_template``.
    None when there is none.
    """
    d = os.fspath(snapshot_dir)
    legacy = os.path.join(d, "chat_template.json")
    extra_dir = os.path.join(d, "chat_templates")
    extra = {}
    if os.path.isdir(extra_dir):
        for name in sorted(os.listdir(extra_dir)):
            if name.endswith(".jinja"):
                with open(os.path.join(extra_dir, name), encoding="utf-8") as f:
                    extra[name[: -len(".jinja")]] = f.read()
    if os.path.isfile(legacy):
        if extra:
            raise ValueError(f"snapshot_dir: {d!r} has both chat_template.json and chat_templates/*.jinja; "
                             "expected one of them")
        template = read_json(legacy).get("chat_template")
        if not isinstance(template, (str, dict)):
            raise ValueError(f"chat_template.json: expected a 'chat_template' string in {legacy!r}")
        return template
    templates = dict(extra)
    raw = os.path.join(d, "chat_template.jinja")
    if os.path.isfile(raw):
        with open(raw, encoding="utf-8") as f:
            templates["default"] = f.read()
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    for name in ("processor_config.json", "tokenizer_config.json"):
        path = os.path.join(d, name)
        if os.path.isfile(path):
            template = read_json(path).get("chat_template")
            if isinstance(template, list):  # tokenizer_config.json may hold [{"name": ..., "template": ...}]
                template = {t["name"]: t["template"] for t in template}
            if template:
                return template
    return None


def resolve(templates: str | dict[str, str] | None, chat_template: str | None = None) -> str:
    """The template to render: ``chat_template`` (a name in ``templates`` or a template string), or the default."""
    if chat_template is not None:
        if isinstance(templates, dict) and chat_template in templates:
            return templates[chat_template]
        return chat_template
    if isinstance(templates, dict):
        if "default" in templates:
            return templates["default"]
        raise ValueError(f"chat_template: the snapshot has several templates {sorted(templates)} and none is named "
                         "'default'; pass chat_template=NAME")
    if templates is None:
        raise ValueError("chat_template: the snapshot has no chat template (chat_template.json, chat_template.jinja "
                         "or tokenizer_config.json)")
    return templates
