"""Grammar-constrained decoding (``StructuredOutputs``) on xgrammar.

A ``GrammarBackend`` compiles specs for one tokenizer (cached by spec, bounded in count and
bytes: ``CACHE_GRAMMARS``, ``CACHE_BYTES``; run compiles through ``grammar_compiles`` to bound
their time); a ``GrammarMatcher`` tracks one sequence and fills its row of a packed token
bitmask (``grammar_bitmask``, whose ``apply_bitmask`` turns the disallowed tokens into
``-inf`` logits).

xgrammar is imported lazily (first ``GrammarBackend``) so that importing this module costs only
what the engine pays anyway (torch); see ``xgrammar_import`` for how its ``transformers``
import is avoided.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from warmboot.device.grammar_bitmask import allow_only
from warmboot.device.xgrammar_import import import_xgrammar
from warmboot.sampling_params import StructuredOutputs

CACHE_GRAMMARS = 256
CACHE_BYTES = 64 << 20
"""The compiled-grammar cache's default bounds. A typical schema compiles to 10-300 KB (the
demo's 49k vocabulary: 256 of them take a few MB), so the count binds first; the largest specs
the limits admit take far more (a 10k-string enum: 39 MiB with 20-character strings, 177 MiB
with 95), so the bytes bind for those. One grammar over the byte bound stays cached alone (a
slow compile a caller gave up on is still found by its retry) until the next one is cached."""


class CompiledGrammar:
    """A compiled ``StructuredOutputs`` spec; share it between matchers (it is immutable)."""

    __slots__ = ("key", "nbytes", "_compiled", "_never", "__weakref__")

    def __init__(self, key: tuple, compiled: Any, never: frozenset[int]) -> None:
        self.key = key
        self.nbytes = int(compiled.memory_size_bytes) + sys.getsizeof(key[1])
        """xgrammar's count plus the spec text the cache keys it by (up to 1 MB of it)."""
        self._compiled = compiled
        self._never = never

    def __repr__(self) -> str:
        return f"CompiledGrammar({self.key[0]})"


class GrammarBackend:
    """Compiles StructuredOutputs for one tokenizer; compiled grammars cached by spec.

    The cache keeps the most recently used grammars within ``cache_size`` entries and
    ``cache_bytes`` bytes (``CompiledGrammar.nbytes``; see ``CACHE_BYTES``); a grammar
    still referenced elsewhere (a request holding it) stays found after its eviction.
    ``cached_bytes`` and ``cached_grammars`` say what it holds.
    """

    def __init__(
        self,
        tokenizer_json: str | Path,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        *,
        any_whitespace: bool = False,
        cache_size: int = CACHE_GRAMMARS,
        cache_bytes: int = CACHE_BYTES,
    ) -> None:
        """Build the xgrammar tokenizer info from a ``tokenizer.json`` file.

        ``vocab_size`` is the model's (logits) vocabulary: ids the tokenizer lacks (padding) are
        never allowed; tokenizer ids at or above it are dropped. ``eos_token_ids`` end a
        complete output. With ``any_whitespace=False`` JSON is generated in ``json.dumps``
        layout (``", "``/``": "``), which keeps small models from looping on whitespace.
        ``cache_size`` and ``cache_bytes`` bound the LRU cache of compiled specs.
        """
        xgr = self._xgr = import_xgrammar()
        from tokenizers import Tokenizer as _HFTokenizer

        text = Path(tokenizer_json).read_text(encoding="utf-8")
        tok = _HFTokenizer.from_str(text)
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        if not self.eos_token_ids:
            raise ValueError("GrammarBackend needs at least one EOS token id")
        if any(not 0 <= t < self.vocab_size for t in self.eos_token_ids):
            raise ValueError(f"EOS token ids {self.eos_token_ids} outside vocab {self.vocab_size}")
        # NOTE: this mirrors TokenizerInfo.from_huggingface for a fast tokenizer (vocab from
        # get_vocab() with added tokens, vocab type / prefix space from the backend JSON, which
        # is tokenizer.json itself) without needing a transformers tokenizer object.
        self._encoded = _encoded_vocab(tok, self.vocab_size)
        self._meta = xgr.TokenizerInfo._detect_metadata_from_hf(text)
        self.vocab_type: str = self._meta["vocab_type"].name
        self._text_info = self._tokenizer_info(self._encoded)
        self._compilers = {"text": self._compiler(self._text_info)}
        # Bytes no JSON output may contain raw (RFC 8259: escape them in strings); \t \n \r
        # only as whitespace between tokens.
        self._json_banned = bytes(b for b in range(32) if not (any_whitespace and b in b"\t\n\r"))
        self._any_whitespace = any_whitespace
        self._cache: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self.cache_bytes = cache_bytes
        self.cached_bytes = 0
        self._live: weakref.WeakValueDictionary[tuple, CompiledGrammar] = (
            weakref.WeakValueDictionary()
        )
        """Every compiled grammar still referenced, cached or not."""
        self._lock = threading.Lock()
        self._batch: Any = None

    def _tokenizer_info(self, encoded: list[str]) -> Any:
        return self._xgr.TokenizerInfo(
            encoded,
            vocab_type=self._meta["vocab_type"],
            vocab_size=self.vocab_size,
            stop_token_ids=list(self.eos_token_ids),
            add_prefix_space=self._meta["add_prefix_space"],
        )

    def _compiler(self, info: Any) -> tuple[Any, frozenset[int]]:
        """An xgrammar compiler for ``info`` and its never-allowed ids (specials but stops)."""
        # Special non-stop ids are rejected by GrammarMatcher.accept before xgrammar sees them
        # (xgrammar would print a warning for each). Our own LRU cache replaces xgrammar's,
        # which returns a new wrapper object per call and is unbounded by default.
        never = frozenset(info.special_token_ids) - set(self.eos_token_ids)
        return self._xgr.GrammarCompiler(info, cache_enabled=False), never

    def _json_compiler(self) -> tuple[Any, frozenset[int]]:
        """The compiler for JSON specs: tokens with raw control bytes are special (never allowed).

        NOTE: xgrammar 0.2.8 compiles a string with minLength/maxLength to a bounded repeat of
        "any character but quote, backslash, CR, LF", which admits raw control characters
        (invalid JSON: ``json.loads`` rejects them) and no escapes (xgrammar issue #800). Removing such tokens from the JSON vocabulary closes
        the first hole at no per-token cost; escapes stay impossible in length-bounded strings.
        """
        with self._lock:
            if "json" not in self._compilers:
                banned = self._json_banned
                encoded = [
                    "" if len(piece.translate(None, banned)) != len(piece) else token
                    for token, piece in zip(
                        self._encoded, self._text_info.decoded_vocab, strict=True
                    )
                ]
                self._compilers["json"] = self._compiler(self._tokenizer_info(encoded))
            return self._compilers["json"]

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """Compile ``spec`` (or return the cached result for an equal spec).

        Raises ``ValueError`` naming the field and the problem for an invalid JSON schema,
        regex or grammar.
        """
        return self.compile_key(spec_key(spec))

    def lookup(self, key: tuple) -> CompiledGrammar | None:
        """The compiled grammar of ``key`` (a ``spec_key``) if cached or still in use."""
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            return self._live.get(key)

    def compile_key(self, key: tuple) -> CompiledGrammar:
        """``compile`` for a ``spec_key``; the compile itself runs on the calling thread."""
        hit = self.lookup(key)
        if hit is not None:
            return hit
        kind, source = key
        c, never = (
            self._json_compiler() if kind in ("json", "json_object") else self._compilers["text"]
        )
        try:
            if kind == "json":
                g = c.compile_json_schema(source, any_whitespace=self._any_whitespace)
            elif kind == "json_object":
                # Not compile_builtin_json_grammar(): its root also allows a JSON array.
                g = c.compile_json_schema(
                    '{"type": "object"}', any_whitespace=self._any_whitespace, strict_mode=False
                )
            elif kind == "regex":
                g = c.compile_regex(source)
            elif kind == "structural_tag":
                g = c.compile_structural_tag(source)
            else:
                g = c.compile_grammar(source)
        except (RuntimeError, ValueError, TypeError) as e:  # InvalidStructuralTagError too
            raise ValueError(f"invalid structured_outputs.{kind}: {_xgr_message(e)}") from None
        return self._keep(CompiledGrammar(key, g, never))

    def _keep(self, compiled: CompiledGrammar) -> CompiledGrammar:
        """Cache ``compiled`` (or return the equal one another thread cached first) and
        evict the least recently used grammars beyond the count and byte bounds."""
        with self._lock:
            key = compiled.key
            compiled = self._cache.get(key) or self._live.get(key) or compiled
            if key not in self._cache:
                self._cache[key] = compiled
                self.cached_bytes += compiled.nbytes
            self._live[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_size or (
                self.cached_bytes > self.cache_bytes and len(self._cache) > 1
            ):
                self.cached_bytes -= self._cache.popitem(last=False)[1].nbytes
        return compiled

    @property
    def cached_grammars(self) -> int:
        return len(self._cache)

    def matcher(self, compiled: CompiledGrammar) -> GrammarMatcher:
        """A fresh matcher (one per sequence) at the start of ``compiled``."""
        return GrammarMatcher(self, self._xgr.GrammarMatcher(compiled._compiled), compiled._never)

    def fill_bitmasks(self, matchers: Sequence[GrammarMatcher], bitmask, rows: Sequence[int]):
        """``matchers[i].fill_bitmask(bitmask, rows[i])`` for all i, the live ones in one
        call that fills rows on xgrammar's threads without the GIL (per-row calls each
        cost a GIL hand-off, and a large vocabulary takes tens of microseconds a row)."""
        live, live_rows = [], []
        for matcher, row in zip(matchers, rows, strict=True):
            if matcher.terminated:
                matcher.fill_bitmask(bitmask, row)
            else:
                live.append(matcher._m)
                live_rows.append(int(row))
        if not live:
            return
        if self._batch is None:
            self._batch = self._xgr.BatchGrammarMatcher()
        self._batch.batch_fill_next_token_bitmask(live, bitmask, live_rows)

    def accept_tokens(self, pairs: Sequence[tuple[GrammarMatcher, int]]) -> list[bool]:
        """``matcher.accept(token)`` for each pair (distinct matchers), in one call into
        xgrammar for those the checks here let through."""
        admissible = [m.admissible(t) for m, t in pairs]
        todo = [(m, int(t)) for (m, t), ok in zip(pairs, admissible, strict=True) if ok]
        done = iter(())
        if todo:
            done = iter(
                self._xgr.BatchGrammarMatcher.batch_accept_token(
                    [m._m for m, _ in todo], [t for _, t in todo]
                )
            )
        accepted = []
        for (matcher, token), ok in zip(pairs, admissible, strict=True):
            took = bool(next(done)) if ok else False
            if took and int(token) in matcher.stop_ids:
                matcher.terminated = matcher._m.is_terminated()
            accepted.append(took)
        return accepted


class GrammarMatcher:
    """The grammar state of one sequence."""

    def __init__(self, backend: GrammarBackend, matcher: Any, never: frozenset[int]) -> None:
        """Use ``GrammarBackend.matcher`` rather than constructing this directly."""
        self._backend = backend
        self._m = matcher
        self._never = never
        self.terminated = matcher.is_terminated()
        """True once the grammar is complete and an EOS token was accepted (kept here: each
        query of xgrammar's state is a call into C++)."""
        self.stop_ids = frozenset(matcher.stop_token_ids)
        """Only accepting one of these can terminate the matcher."""

    def accept(self, token_id: int) -> bool:
        """Advance by one token; ``False`` (state unchanged) if the grammar does not allow it."""
        return self._backend.accept_tokens([(self, token_id)])[0]

    def admissible(self, token_id: int) -> bool:
        """Whether the token may be offered to xgrammar at all (in the vocabulary, not a
        token the backend never allows, the matcher still running)."""
        token_id = int(token_id)
        b = self._backend
        return 0 <= token_id < b.vocab_size and token_id not in self._never and not self.terminated

    def is_terminated(self) -> bool:
        return self.terminated

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (a CPU int32 tensor).

        After termination only the EOS tokens are allowed (xgrammar itself refuses).
        """
        if self.terminated:
            allow_only(bitmask, row, self._backend.eos_token_ids)
            return
        self._m.fill_next_token_bitmask(bitmask, row)


def _encoded_vocab(tok: Any, vocab_size: int) -> list[str]:
    """The encoded token of each id below ``vocab_size`` (a ``tokenizers.Tokenizer``'s vocab
    with added tokens), ``""`` for the ids xgrammar must treat as special."""
    encoded = [""] * vocab_size
    for token, idx in tok.get_vocab(with_added_tokens=True).items():
        if idx < vocab_size:
            encoded[idx] = token
    # NOTE: special added tokens (<|im_end|>, ...) are decoded by xgrammar as their literal
    # text, so a grammar could accept "<|im_end|>" inside a JSON string while our detokenizer
    # drops it. An empty encoding makes xgrammar treat them as special: never allowed
    # except as stop tokens. Ids with no token (model vocab padding) are special likewise.
    for idx, added in tok.get_added_tokens_decoder().items():
        if added.special and idx < vocab_size:
            encoded[idx] = ""
    return encoded


def spec_key(
    spec: StructuredOutputs, inspect: Callable[[str, Any], None] | None = None
) -> tuple[str, str]:
    """A hashable, canonical key ``(kind, source)``: equal schemas (dict or JSON text) give
    equal keys. ``inspect(kind, doc)`` sees a JSON schema or structural tag as parsed."""
    if spec.json is not None:
        schema = spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"invalid structured_outputs.json: not valid JSON ({e})") from None
        if inspect is not None:
            inspect("json", schema)
        try:
            # NOTE: no sort_keys: xgrammar emits properties in schema order.
            return ("json", json.dumps(schema))
        except (TypeError, ValueError) as e:
            raise ValueError(f"invalid structured_outputs.json: {e}") from None
    if spec.json_object:
        return ("json_object", "")
    if spec.regex is not None:
        return ("regex", spec.regex)
    if spec.structural_tag is not None:
        tag = spec.structural_tag
        if inspect is not None:
            inspect("structural_tag", _parsed_tag(tag))
        return ("structural_tag", tag if isinstance(tag, str) else json.dumps(tag))
    return ("grammar", spec.grammar)


def _parsed_tag(tag: dict | str) -> Any:
    """A structural tag as a JSON document; text that is not JSON is left to xgrammar."""
    if not isinstance(tag, str):
        return tag
    try:
        return json.loads(tag)
    except json.JSONDecodeError:
        return tag


_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*(Check failed: .*? is false:\s*)?")


def _xgr_message(error: Exception) -> str:
    """xgrammar's error text without the C++ log prefix ``[time] file.cc:line: ``."""
    return _LOG_PREFIX.sub("", str(error).strip()) or type(error).__name__
