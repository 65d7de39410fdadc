"""A light tokenizer wrapper over ``tokenizers`` (no ``transformers`` import: cold start matters)."""

from __future__ import annotations

import codecs
import functools
import json
import re
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import DecodeStream

_SPECIAL_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_EXTRA_SPECIAL_KEYS = ("additional_special_tokens", "extra_special_tokens")


LONG_TEXT_CHARS = 4096
"""Texts longer than this are encoded without holding the GIL."""


class Tokenizer:
    """Encode/decode text and render chat templates from a HF-format tokenizer directory."""

    def __init__(self, tokenizer: _HFTokenizer, config: dict[str, Any] | None = None) -> None:
        """Wrap a ``tokenizers.Tokenizer`` with the (optional) ``tokenizer_config.json`` dict."""
        config = config or {}
        self._tok = tokenizer
        self._config = config
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_token: str | None = _token_str(config.get("bos_token"))
        self.eos_token: str | None = _token_str(config.get("eos_token"))
        self.bos_token_id: int | None = self._id_of(self.bos_token)
        self.eos_token_id: int | None = self._id_of(self.eos_token)
        self.all_special_ids: frozenset[int] = self._special_ids()
        self.chat_template: str | None = _pick_template(config.get("chat_template"))
        self._compiled_templates: dict[str, _CompiledTemplate] = {}
        self._texts: dict[int, str] = {}

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` (required) and ``tokenizer_config.json`` (optional).

        A chat template stored in ``chat_template.jinja`` is used when the config has none.
        Raises ``FileNotFoundError`` naming ``tokenizer.json`` if it is missing.
        """
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"tokenizer.json not found in {path}")
        config_file = path / "tokenizer_config.json"
        config = (
            json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        )
        jinja_file = path / "chat_template.jinja"
        if not config.get("chat_template") and jinja_file.is_file():
            config["chat_template"] = jinja_file.read_text(encoding="utf-8")
        return cls(_HFTokenizer.from_file(str(tok_file)), config)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special-token strings in the text map to their ids."""
        if len(text) > LONG_TEXT_CHARS:
            # NOTE: encode_batch releases the GIL, encode does not: 400k characters held every
            # other thread (the server's event loop) for 0.15 s
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """An upper bound on the characters one token stands for: the longest vocabulary entry
        (byte-level entries spell one character per byte, so never fewer than they decode
        to). ``n`` characters are at least ``n / max_token_chars`` tokens."""
        return max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1) or 1

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (any iterable of ints); invalid UTF-8 becomes U+FFFD."""
        return self._tok.decode(list(map(int, ids)), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """``decode([token_id], skip_special_tokens=False)``, cached (logprobs name every top
        token of every step)."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.decode([token_id], skip_special_tokens=False)
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (a token may hold part of a UTF-8 character)."""
        piece = self._tok.id_to_token(int(token_id))
        if piece is None:
            return b""
        if self._byte_level:
            table = _byte_decoder()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
            return piece.encode("utf-8")  # an added token outside the byte alphabet
        byte = _BYTE_FALLBACK.fullmatch(piece)
        if byte:
            return bytes([int(byte.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")  # SentencePiece's word marker

    @functools.cached_property
    def _byte_level(self) -> bool:
        return "ByteLevel" in json.dumps(self._decoder_spec)

    def token_to_id(self, token: str) -> int | None:
        """Id of a token string, or ``None`` if it is not in the vocabulary."""
        return self._tok.token_to_id(token)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` with the chat template, as ``transformers`` does (text, not ids).

        ``template``: another template's source (compiled once, a few kept); extra ``kwargs``
        are passed to the template. Raises ``ValueError`` if there is no template.
        """
        compiled = self._template(template)
        specials = {k: _token_str(self._config.get(k)) for k in _SPECIAL_KEYS}
        context = {"tools": None, "documents": None}
        context.update((k, v) for k, v in specials.items() if v is not None)
        context.update(kwargs)
        return compiled.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **context
        )

    def template_variables(self, template: str | None = None) -> frozenset[str]:
        """The variables a chat template reads from its context (``messages``, ``tools``...)."""
        return self._template(template).variables

    def _template(self, template: str | None):
        source = template if template is not None else self.chat_template
        if source is None:
            raise ValueError("this tokenizer has no chat template (chat_template is not set)")
        if source not in self._compiled_templates:
            if len(self._compiled_templates) >= 8:
                self._compiled_templates.pop(next(iter(self._compiled_templates)))
            self._compiled_templates[source] = _CompiledTemplate(source)
        return self._compiled_templates[source]

    def detokenizer(
        self, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True
    ) -> Detokenizer:
        """A fresh incremental detokenizer for one generated sequence: a table lookup per token
        for a byte-level vocabulary, else ``tokenizers``' ``DecodeStream``.

        ``spaces_between_special_tokens=False`` (with special tokens kept) is vLLM's rule for
        fast tokenizers: an added token right after another added token is its bare content.
        It only matters for decoders that put a separator between tokens (WordPiece-style);
        the byte-level decoder writes every token's bytes as they are, so it is a no-op there.
        """
        if self._decoder_type == "ByteLevel":
            return ByteLevelDetokenizer(self._pieces[skip_special_tokens])
        bare = None if skip_special_tokens or spaces_between_special_tokens else self._added
        return IncrementalDetokenizer(self._tok, skip_special_tokens, bare or None)

    @functools.cached_property
    def _decoder_spec(self) -> dict:
        """The decoder's JSON (only the decoder: serialising the whole tokenizer costs tens of
        milliseconds with a large vocabulary, on the first request)."""
        decoder = self._tok.decoder
        return {} if decoder is None else json.loads(decoder.__getstate__())

    @functools.cached_property
    def _decoder_type(self) -> str | None:
        return self._decoder_spec.get("type")

    @functools.cached_property
    def _added(self) -> dict[int, str]:
        """Added token id -> its content (special or not)."""
        return {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}

    @functools.cached_property
    def _pieces(self) -> dict[bool, _Pieces]:
        special = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        return {True: _Pieces(self.token_bytes, special), False: _Pieces(self.token_bytes, set())}

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def _special_ids(self) -> frozenset[int]:
        ids = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        names = [_token_str(self._config.get(k)) for k in _SPECIAL_KEYS]
        for key in _EXTRA_SPECIAL_KEYS:
            extra = self._config.get(key) or []
            names += [_token_str(t) for t in (extra.values() if isinstance(extra, dict) else extra)]
        ids.update(i for i in map(self._id_of, names) if i is not None)
        return frozenset(ids)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces, exact across multi-byte UTF-8 splits."""

    def __init__(
        self,
        tokenizer: _HFTokenizer,
        skip_special_tokens: bool = True,
        bare_added: dict[int, str] | None = None,
    ) -> None:
        """Use ``Tokenizer.detokenizer()`` rather than constructing this directly.
        ``bare_added``: added token id -> content, written bare after another added token
        (``spaces_between_special_tokens=False``)."""
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._emitted = 0
        """Characters the stream gave (``flush`` compares them with a whole decode)."""
        self._bare = bare_added
        self._after_added = False

    def step(self, token_id: int) -> str:
        """New text since the last call; ``''`` while an incomplete UTF-8 sequence is pending."""
        self._ids.append(int(token_id))
        piece = self._stream.step(self._tok, int(token_id)) or ""
        self._emitted += len(piece)
        if self._bare is not None:
            content = self._bare.get(int(token_id))
            if content is not None and self._after_added:
                piece = content  # NOTE: vLLM: no separator between two added tokens
            self._after_added = content is not None
        return piece

    def flush(self) -> str:
        """At the end of a sequence: the text still held back (e.g. a cut-off character)."""
        rest = self._tok.decode(self._ids, skip_special_tokens=self._skip)[self._emitted :]
        self._emitted += len(rest)
        return rest


class _Pieces(dict):
    """token id -> the bytes it adds to the text (empty for a skipped special token), filled
    on first use: ``pieces[id]`` is a C dict lookup once a token has been seen."""

    def __init__(self, token_bytes: Callable[[int], bytes], skipped: set[int]) -> None:
        super().__init__()
        self._token_bytes = token_bytes
        self._skipped = skipped

    def __missing__(self, token_id: int) -> bytes:
        piece = b"" if token_id in self._skipped else self._token_bytes(token_id)
        self[token_id] = piece
        return piece


class ByteLevelDetokenizer:
    """Incremental text of a byte-level BPE vocabulary (GPT-2 style: Llama 3, Qwen, SmolLM):
    each token stands for fixed bytes, and the text is their UTF-8 decoding with invalid
    sequences replaced, which is what ``tokenizers``' ByteLevel decoder computes. Same
    interface as ``IncrementalDetokenizer``, about ten times cheaper per token."""

    def __init__(self, pieces: _Pieces) -> None:
        self._pieces = pieces
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def step(self, token_id: int) -> str:
        """New text since the last call; ``''`` while an incomplete UTF-8 sequence is pending."""
        return self._utf8.decode(self._pieces[token_id])

    def flush(self) -> str:
        """At the end of a sequence: a cut-off character still pending, as U+FFFD."""
        return self._utf8.decode(b"", final=True)


Detokenizer = IncrementalDetokenizer | ByteLevelDetokenizer


def _token_str(value: Any) -> str | None:
    """A special token from a config value: a string or a ``{"content": ...}`` dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _pick_template(value: Any) -> str | None:
    """The template string; a list of ``{"name", "template"}`` picks the ``default`` one."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value}
        return named.get("default")
    return value or None


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _CompiledTemplate:
    """A sandboxed Jinja template and the context variables it reads."""

    def __init__(self, source: str):
        from jinja2 import meta
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self.variables = frozenset(meta.find_undeclared_variables(env.parse(source)))
        self.render = env.from_string(source).render


def _tojson(value: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys=False):
    """HF's ``tojson`` filter: no HTML escaping, unlike jinja's built-in."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """Inverse of the byte-level BPE alphabet: printable bytes stand for themselves, the other
    bytes for the characters 256, 257, ... in order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = [b for b in range(256) if b not in keep]
    table = {chr(b): b for b in keep}
    table.update({chr(256 + i): b for i, b in enumerate(extra)})
    return table
