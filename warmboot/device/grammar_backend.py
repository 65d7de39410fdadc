"""Grammar-constrained decoding (``StructuredOutputs``) on xgrammar.

A ``GrammarBackend`` compiles specs for one tokenizer (cached by spec); a ``GrammarMatcher``
tracks one sequence and fills its row of a packed token bitmask (bit ``i`` of a row set = token
``i`` allowed), which ``apply_bitmask`` turns into ``-inf`` logits.

xgrammar is imported lazily (first ``GrammarBackend``) so that importing this module costs only
what the engine pays anyway (torch); see ``_xgrammar`` for how its ``transformers`` import is
avoided.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import types
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from warmboot.device.staging import upload
from warmboot.sampling_params import StructuredOutputs

_xgr: Any = None
_import_lock = threading.Lock()


def _xgrammar():
    """Import xgrammar once, without letting it import ``transformers`` (~0.5 s of cold start).

    xgrammar's ``tokenizer_info`` and ``contrib.hf`` modules import ``transformers`` at module
    level, only for ``TokenizerInfo.from_huggingface`` and an HF ``LogitsProcessor``, neither of
    which we use. While xgrammar loads, a stub module stands in for ``transformers`` (its
    attributes are placeholder classes) and is removed right after, so a later
    ``import transformers`` anywhere gets the real package. If transformers is already loaded,
    or the stubbed import fails, xgrammar is imported normally.
    """
    global _xgr
    with _import_lock:
        if _xgr is not None:
            return _xgr
        if "transformers" in sys.modules:
            import xgrammar

            _xgr = xgrammar
            return _xgr
        stub = types.ModuleType("transformers")

        def placeholder(name: str) -> type:
            if name.startswith("__"):
                raise AttributeError(name)
            cls = type(name, (), {"__module__": "transformers"})
            setattr(stub, name, cls)
            return cls

        stub.__getattr__ = placeholder
        sys.modules["transformers"] = stub
        try:
            import xgrammar
        except Exception:
            for name in [m for m in sys.modules if m == "xgrammar" or m.startswith("xgrammar.")]:
                del sys.modules[name]
            xgrammar = None
        finally:
            if sys.modules.get("transformers") is stub:
                del sys.modules["transformers"]
        if xgrammar is None:
            import xgrammar
        _xgr = xgrammar
        return _xgr


class CompiledGrammar:
    """A compiled ``StructuredOutputs`` spec; share it between matchers (it is immutable)."""

    __slots__ = ("key", "_compiled", "_never")

    def __init__(self, key: tuple, compiled: Any, never: frozenset[int]) -> None:
        self.key = key
        self._compiled = compiled
        self._never = never

    def __repr__(self) -> str:
        return f"CompiledGrammar({self.key[0]})"


class GrammarBackend:
    """Compiles StructuredOutputs for one tokenizer; compiled grammars cached by spec."""

    def __init__(
        self,
        tokenizer_json: str | Path,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        *,
        any_whitespace: bool = False,
        cache_size: int = 256,
    ) -> None:
        """Build the xgrammar tokenizer info from a ``tokenizer.json`` file.

        ``vocab_size`` is the model's (logits) vocabulary: ids the tokenizer lacks (padding) are
        never allowed; tokenizer ids at or above it are dropped. ``eos_token_ids`` end a
        complete output. With ``any_whitespace=False`` JSON is generated in ``json.dumps``
        layout (``", "``/``": "``), which keeps small models from looping on whitespace.
        ``cache_size`` bounds the LRU cache of compiled specs.
        """
        xgr = _xgrammar()
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
        encoded = [""] * self.vocab_size
        for token, idx in tok.get_vocab(with_added_tokens=True).items():
            if idx < self.vocab_size:
                encoded[idx] = token
        # NOTE: special added tokens (<|im_end|>, ...) are decoded by xgrammar as their literal
        # text, so a grammar could accept "<|im_end|>" inside a JSON string while our detokenizer
        # drops it. An empty encoding makes xgrammar treat them as special: never allowed
        # except as stop tokens. Ids with no token (model vocab padding) are special likewise.
        for idx, added in tok.get_added_tokens_decoder().items():
            if added.special and idx < self.vocab_size:
                encoded[idx] = ""
        self._meta = xgr.TokenizerInfo._detect_metadata_from_hf(text)
        self.vocab_type: str = self._meta["vocab_type"].name
        self._encoded = encoded
        self._text_info = self._tokenizer_info(encoded)
        self._compilers = {"text": self._compiler(self._text_info)}
        # Bytes no JSON output may contain raw (RFC 8259: escape them in strings); \t \n \r
        # only as whitespace between tokens.
        self._json_banned = bytes(b for b in range(32) if not (any_whitespace and b in b"\t\n\r"))
        self._any_whitespace = any_whitespace
        self._cache: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._batch: Any = None

    def _tokenizer_info(self, encoded: list[str]) -> Any:
        return _xgr.TokenizerInfo(
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
        return _xgr.GrammarCompiler(info, cache_enabled=False), never

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
        key = _spec_key(spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
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
        compiled = CompiledGrammar(key, g, never)
        with self._lock:
            compiled = self._cache.setdefault(key, compiled)
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, compiled: CompiledGrammar) -> GrammarMatcher:
        """A fresh matcher (one per sequence) at the start of ``compiled``."""
        return GrammarMatcher(self, _xgr.GrammarMatcher(compiled._compiled), compiled._never)

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
            self._batch = _xgr.BatchGrammarMatcher()
        self._batch.batch_fill_next_token_bitmask(live, bitmask, live_rows)

    def accept_tokens(self, pairs: Sequence[tuple[GrammarMatcher, int]]) -> list[bool]:
        """``matcher.accept(token)`` for each pair (distinct matchers), in one call into
        xgrammar for those the checks here let through."""
        admissible = [m.admissible(t) for m, t in pairs]
        todo = [(m, int(t)) for (m, t), ok in zip(pairs, admissible, strict=True) if ok]
        done = iter(())
        if todo:
            done = iter(
                _xgr.BatchGrammarMatcher.batch_accept_token(
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
            bitmask[row] = 0
            for t in self._backend.eos_token_ids:
                bitmask[row, t // 32] |= _bit(t % 32)
            return
        self._m.fill_next_token_bitmask(bitmask, row)


def allocate_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed int32 bitmask of shape ``(batch, ceil(vocab_size / 32))`` on CPU."""
    return torch.full((batch, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Set the disallowed tokens of ``logits[r]`` to ``-inf`` for each ``r`` in ``rows``.

    Row ``r`` of ``logits`` (2-D, float32/bf16/fp16) uses row ``r`` of ``bitmask``; other rows
    are untouched. ``logits`` and ``bitmask`` must be on the same device (CPU or e.g. CUDA).
    Only the first ``min(logits.shape[1], 32 * bitmask.shape[1])`` columns are masked.
    """
    rows = [int(r) for r in rows]
    if not rows:
        return
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError("apply_bitmask needs 2-D logits and a 2-D int32 bitmask")
    if logits.device != bitmask.device:
        raise ValueError(f"logits on {logits.device} but bitmask on {bitmask.device}")
    n_rows = min(logits.shape[0], bitmask.shape[0])
    if min(rows) < 0 or max(rows) >= n_rows:
        raise IndexError(f"rows {rows} out of range for {n_rows} rows")
    vocab = min(logits.shape[1], bitmask.shape[1] * 32)
    if logits.device.type == "cpu":
        # xgrammar's C++ CPU kernel (its "auto" backend picks it for CPU tensors too).
        (_xgr or _xgrammar()).apply_token_bitmask_inplace(
            logits, bitmask, vocab_size=vocab, indices=rows, backend="cpu"
        )
    else:
        # Not xgrammar's default for CUDA (a Triton kernel): that needs triton installed and
        # JIT-compiles on first use; a few torch ops are enough for a (rows, vocab) mask.
        _apply_bitmask_torch(logits, bitmask, rows, vocab)


def _apply_bitmask_torch(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab: int
) -> None:
    idx = upload(torch.tensor(rows, dtype=torch.int64), logits.device)  # NOTE: no hidden sync
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bitmask[idx].unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()
    logits[idx, :vocab] = logits[idx, :vocab].masked_fill(~allowed, float("-inf"))


def _bit(i: int) -> int:
    """Bit ``i`` of an int32 word as a Python int (bit 31 is the sign bit)."""
    return -(1 << 31) if i == 31 else 1 << i


def _spec_key(spec: StructuredOutputs) -> tuple:
    """A hashable, canonical key: equal schemas (dict or JSON text) give equal keys."""
    if spec.json is not None:
        schema = spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"invalid structured_outputs.json: not valid JSON ({e})") from None
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
        return ("structural_tag", tag if isinstance(tag, str) else json.dumps(tag))
    return ("grammar", spec.grammar)


_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*(Check failed: .*? is false:\s*)?")


def _xgr_message(error: Exception) -> str:
    """xgrammar's error text without the C++ log prefix ``[time] file.cc:line: ``."""
    return _LOG_PREFIX.sub("", str(error).strip()) or type(error).__name__
