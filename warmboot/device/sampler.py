"""Turn a batch of logits into next tokens (vLLM order).

1. logprobs from the raw logits (float32 ``log_softmax``), for rows that ask;
2. tokens outside ``allowed_token_ids`` -> -inf; ``logit_bias`` added; then penalties:
   repetition (prompt + output), then frequency and presence (output only);
3. ``suppress_token_ids`` -> -inf;
4. greedy rows: argmax;
5. random rows: temperature, min-p, top-k, top-p, then the exponential race
   ``argmax(probs / q)``, ``q ~ Exp(1)``; a seeded row draws ``q`` from its own generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from warmboot.core.types import RunnerOutput, ScheduledRequest, TokenLogprobs
from warmboot.device.staging import upload
from warmboot.kernels import native
from warmboot.sampling_params import SamplingParams

_SEED_MASK = (1 << 64) - 1


@dataclass
class SamplingRow:
    """Host-side facts for one row of the logits batch."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    """Counted by repetition_penalty (with the output), like HF/vLLM."""
    output_token_ids: Sequence[int]
    """Counted by presence/frequency penalties (OpenAI semantics) and repetition_penalty."""
    generator: torch.Generator | None
    """Not None iff ``params.seed`` is not None; lives on the logits' device."""
    suppress_token_ids: Sequence[int] = ()
    """Ids forced to -inf (e.g. EOS/stop ids while the output is shorter than min_tokens)."""


@dataclass
class SamplerOutput:
    """Chosen tokens and, when any row asked, logprobs of the raw logits."""

    token_ids: torch.Tensor
    """(B,) int64 on the logits' device."""
    sampled_logprobs: torch.Tensor | None
    """(B,) float32 logprob of the chosen token; None when no row asked for logprobs."""
    top_logprobs: torch.Tensor | None
    """(B, K) float32, K = max ``params.logprobs`` over the rows that asked (K may be 0)."""
    top_token_ids: torch.Tensor | None
    """(B, K) int64."""

    def to_host(self) -> SamplerOutput:
        """The tensors copied to host memory (non-blocking on CUDA: valid once an event
        recorded after this call has completed)."""

        def host(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None or t.device.type == "cpu":
                return t
            return t.to("cpu", non_blocking=True)

        fields = (self.token_ids, self.sampled_logprobs, self.top_logprobs, self.top_token_ids)
        return SamplerOutput(*(host(t) for t in fields))

    def runner_output(self, rows: Sequence[ScheduledRequest]) -> RunnerOutput:
        """Host tensors -> plain lists, each row's logprobs cut to what it asked for."""
        token_ids = self.token_ids.tolist()
        logprobs = None
        if self.sampled_logprobs is not None:
            sampled = self.sampled_logprobs.tolist()
            top_ids, top_lps = self.top_token_ids.tolist(), self.top_logprobs.tolist()
            logprobs = [
                None
                if (k := s.params.logprobs) is None
                else _token_logprobs(sampled[i], top_ids[i], top_lps[i], k)
                for i, s in enumerate(rows)
            ]
        return RunnerOutput([s.req_id for s in rows], token_ids, logprobs)


def _token_logprobs(value: float, ids: list[int], lps: list[float], k: int) -> TokenLogprobs:
    """One token's logprob and the row's top ``k`` (the rows share the batch's widest k)."""
    return TokenLogprobs(value, list(zip(ids[:k], lps[:k], strict=True)))


@dataclass
class PromptLogprobs:
    """Logprobs of prompt tokens (host tensors once the step's event completed)."""

    target: torch.Tensor
    """(N,) float32 logprob of each predicted prompt token."""
    top_logprobs: torch.Tensor
    """(N, K) float32."""
    top_token_ids: torch.Tensor
    """(N, K) int64."""

    def to_host(self) -> PromptLogprobs:
        return PromptLogprobs(*(t.to("cpu", non_blocking=True) for t in self._fields()))

    def _fields(self) -> tuple[torch.Tensor, ...]:
        return (self.target, self.top_logprobs, self.top_token_ids)

    def split(self, rows: Sequence[tuple[str, int, int]]) -> dict[str, list[TokenLogprobs]]:
        """Host tensors -> per request (id, how many tokens, top-k) its tokens' logprobs."""
        target, top_lps, top_ids = (t.tolist() for t in self._fields())
        out, i = {}, 0
        for req_id, count, k in rows:
            out[req_id] = [
                _token_logprobs(target[j], top_ids[j], top_lps[j], k) for j in range(i, i + count)
            ]
            i += count
        return out


def prompt_logprobs(
    hidden: torch.Tensor,
    compute_logits,
    index: torch.Tensor,
    targets: torch.Tensor,
    k: int,
    chunk: int = 512,
) -> PromptLogprobs:
    """Logprobs (float32 ``log_softmax`` of the raw logits) of ``targets`` at the hidden
    states ``hidden[index]``, plus the top ``k``; ``chunk`` rows of logits at a time, so a
    long prompt never holds (tokens, vocab) logits at once."""
    parts = []
    for i in range(0, index.shape[0], chunk):
        lsm = torch.log_softmax(compute_logits(hidden[index[i : i + chunk]]).float(), dim=-1)
        top = lsm.topk(min(k, lsm.shape[1]), dim=-1)
        parts.append((lsm.gather(1, targets[i : i + chunk, None]).squeeze(1), *top))
    return PromptLogprobs(*(torch.cat(cols) for cols in zip(*parts, strict=True)))


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on ``device`` seeded with ``seed`` (any int; taken modulo 2**64)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed & _SEED_MASK)
    return gen


class Sampler:
    """Stateless batch sampler; see the module docstring for the order of operations."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """Pick one token per row of ``logits`` (B, V) following ``rows[i]``."""
        _validate(logits, rows)
        params = [r.params for r in rows]
        want_logprobs = any(p.logprobs is not None for p in params)
        plain = all(
            p.greedy
            and not p.uses_penalties
            and not p.logit_bias
            and not p.allowed_token_ids
            and not r.suppress_token_ids
            for p, r in zip(params, rows, strict=True)
        )
        if plain and not want_logprobs:
            return SamplerOutput(native.argmax(logits), None, None, None)

        x = logits.to(torch.float32, copy=True)
        logprobs = torch.log_softmax(x, dim=-1) if want_logprobs else None
        apply_allowed_tokens(x, params)
        apply_logit_bias(x, params)
        apply_penalties(x, rows)
        _suppress(x, rows)
        tokens = native.argmax(x)
        rand = [i for i, p in enumerate(params) if not p.greedy]
        if rand:
            # NOTE: a Python list as an index of a CUDA tensor is a blocking copy (a sync)
            at = upload(torch.tensor(rand), x.device)
            tokens[at] = _sample(x[at], [rows[i] for i in rand])
        if logprobs is None:
            return SamplerOutput(tokens, None, None, None)
        k = max(p.logprobs for p in params if p.logprobs is not None)
        top = logprobs.topk(min(k, logprobs.shape[1]), dim=-1)
        sampled = logprobs.gather(1, tokens[:, None]).squeeze(1)
        return SamplerOutput(tokens, sampled, top.values, top.indices)


def apply_allowed_tokens(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """Set every token outside a row's ``allowed_token_ids`` to -inf, in place (one (R, V)
    mask for the R rows that ask)."""
    at = [i for i, p in enumerate(params) if p.allowed_token_ids]
    if not at:
        return
    pairs = [(j, t) for j, i in enumerate(at) for t in params[i].allowed_token_ids]
    index = torch.tensor(pairs, dtype=torch.int64)
    _check_ids(index[:, 1], logits.shape[1], "allowed_token_ids")
    dev = logits.device
    index, rows = upload(index, dev), upload(torch.tensor(at), dev)
    banned = torch.ones(len(at), logits.shape[1], dtype=torch.bool, device=dev)
    banned[index[:, 0], index[:, 1]] = False
    logits[rows] = logits[rows].masked_fill(banned, float("-inf"))


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Add each row's ``logit_bias`` in place to float32 (B, V) logits (one indexed add)."""
    triples = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias or ()]
    if not triples:
        return logits
    rows, tokens, bias = zip(*triples, strict=True)
    _check_ids(torch.tensor(tokens), logits.shape[1], "logit_bias")
    dev = logits.device
    at = (upload(torch.tensor(rows), dev), upload(torch.tensor(tokens), dev))
    logits.index_put_(at, upload(torch.tensor(bias, dtype=torch.float32), dev), accumulate=True)
    return logits


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Apply repetition, frequency and presence penalties in place to float32 (B, V) logits.

    Touches only the (row, token) pairs of the histories: O(history) gathers and scatters plus
    one zero-fill of the counts, no (B, V) temporaries and no host sync. Repeated pairs write
    the same value, so the scatters are deterministic; the arithmetic is the dense formula's,
    element for element (a repetition penalty of 1 divides or multiplies by 1: exact)."""
    idx = [i for i, r in enumerate(rows) if r.params.uses_penalties]
    if not idx:
        return logits
    sub = [rows[i] for i in idx]
    dev, vocab = logits.device, logits.shape[1]
    work = logits if logits.is_contiguous() else logits.contiguous()
    flat = work.view(-1)
    base = upload(torch.tensor(idx) * vocab, dev)
    out_ids, out_owner = _occurrences([r.output_token_ids for r in sub], vocab, "history", dev)
    out_at = base[out_owner] + out_ids
    rep_rows = [j for j, r in enumerate(sub) if r.params.repetition_penalty != 1.0]
    if rep_rows:
        prompts = [sub[j].prompt_token_ids for j in rep_rows]
        p_ids, p_owner = _occurrences(prompts, vocab, "prompt", dev)
        p_owner = upload(torch.tensor(rep_rows), dev)[p_owner]
        seen = torch.cat([out_at, base[p_owner] + p_ids])
        rep = _per_row([r.params.repetition_penalty for r in sub], dev)
        rep = rep[torch.cat([out_owner, p_owner])]
        x = flat[seen]
        flat[seen] = torch.where(x > 0, x / rep, x * rep)
    counts = torch.zeros(len(sub) * vocab, dtype=torch.float32, device=dev)
    local = out_owner * vocab + out_ids
    counts.index_add_(0, local, torch.ones(local.shape[0], dtype=torch.float32, device=dev))
    c = counts[local]
    freq = _per_row([r.params.frequency_penalty for r in sub], dev)[out_owner]
    presence = _per_row([r.params.presence_penalty for r in sub], dev)[out_owner]
    flat[out_at] = flat[out_at] - freq * c - presence * (c > 0)
    if work is not logits:
        logits.copy_(work)
    return logits


def apply_filters(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Return temperature-scaled (R, V) logits with tokens outside min-p/top-k/top-p set to -inf."""
    dev, vocab = logits.device, logits.shape[1]
    if any(p.min_p > 0 for p in params):
        probs = torch.softmax(logits, dim=-1)
        floor = _column([p.min_p for p in params], dev) * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    if not any(p.uses_top_k or p.top_p < 1.0 for p in params):
        return logits
    cand, order = _candidates(logits, params)
    ks = [min(p.top_k, vocab) if p.uses_top_k else vocab for p in params]
    kth = cand.gather(1, upload(torch.tensor(ks), dev).clamp_max(cand.shape[1])[:, None] - 1)
    no_k = upload(torch.tensor([not p.uses_top_k for p in params]), dev)[:, None]
    kth = kth.masked_fill(no_k, float("-inf"))
    # NOTE: ties with the k-th largest value are kept, so the kept set may exceed k.
    logits = logits.masked_fill(logits < kth, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        logits = _top_p(logits, cand.masked_fill(cand < kth, float("-inf")), order, params)
    return logits


def _candidates(
    logits: torch.Tensor, params: Sequence[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) of each row's K largest logits, descending; K is the largest top-k in use,
    so top-k sorts nothing, unless a row asks for top-p without top-k (then all, sorted)."""
    if any(p.top_p < 1.0 and not p.uses_top_k for p in params):
        return logits.sort(dim=-1, descending=True)
    width = min(max(p.top_k for p in params if p.uses_top_k), logits.shape[1])
    return logits.topk(width, dim=-1)


def _top_p(
    logits: torch.Tensor, cand: torch.Tensor, order: torch.Tensor, params: Sequence[SamplingParams]
) -> torch.Tensor:
    """Keep each top-p row's smallest set of candidates holding ``top_p`` of the mass: drop a
    candidate once those before it hold top_p (the most likely token always survives). Rows
    without top-p keep what they have."""
    probs = torch.softmax(cand, dim=-1)
    top_p = _column([p.top_p for p in params], logits.device)
    drop = ((probs.cumsum(dim=-1) - probs) >= top_p) & (top_p < 1.0)
    dropped = torch.ones_like(logits, dtype=torch.bool).scatter_(1, order, drop)
    return logits.masked_fill(dropped & (top_p < 1.0), float("-inf"))


def _sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Exponential-race sample of (R, V) penalised logits of random rows."""
    params = [r.params for r in rows]
    x = logits / _column([p.temperature for p in params], logits.device)
    probs = torch.softmax(apply_filters(x, params), dim=-1)
    return native.argmax(probs.div_(_exponentials(rows, x.shape[1], x.device)))


def _exponentials(rows: Sequence[SamplingRow], vocab: int, dev: torch.device) -> torch.Tensor:
    """(R, V) Exp(1) draws: seeded rows from their own generator, the rest in one batched draw."""
    unseeded = [j for j, r in enumerate(rows) if r.generator is None]
    if len(unseeded) == len(rows):
        q = torch.empty(len(rows), vocab, device=dev).exponential_()
    else:
        q = torch.empty(len(rows), vocab, device=dev)
        if unseeded:
            draws = torch.empty(len(unseeded), vocab, device=dev).exponential_()
            q[upload(torch.tensor(unseeded), dev)] = draws
        for j, r in enumerate(rows):
            if r.generator is not None:
                # NOTE: exactly one draw of V per seeded row and step, so a seeded row's tokens
                # depend only on its seed and history, never on the rest of the batch.
                q[j] = torch.empty(vocab, device=dev).exponential_(generator=r.generator)
    # NOTE: q > 0, so a zero probability can never become 0/0 = nan and win the argmax.
    return q.clamp_min_(torch.finfo(torch.float32).tiny)


def _suppress(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Set every row's ``suppress_token_ids`` to -inf in place."""
    pairs = [(i, t) for i, r in enumerate(rows) for t in r.suppress_token_ids]
    if not pairs:
        return
    index = torch.tensor(pairs, dtype=torch.int64)
    _check_ids(index[:, 1], logits.shape[1], "suppress_token_ids")
    index = upload(index, logits.device)
    logits[index[:, 0], index[:, 1]] = float("-inf")


def _occurrences(
    histories: Sequence[Sequence[int] | torch.Tensor], vocab: int, what: str, dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 (ids, owner) on ``dev``: every id of every history and the index of its history.
    One upload of the ids; the owners are expanded on the device (sized, so no sync)."""
    parts = [torch.as_tensor(h, dtype=torch.int64).reshape(-1) for h in histories]
    ids = torch.cat(parts)
    _check_ids(ids, vocab, what)
    lengths = upload(torch.tensor([p.shape[0] for p in parts]), dev)
    owner = upload(torch.arange(len(parts)), dev)
    owner = torch.repeat_interleave(owner, lengths, output_size=ids.shape[0])
    return upload(ids, dev), owner


class TokenHistory:
    """A growing host int64 tensor of token ids, appended in amortised O(new ids): the
    penalties read a request's history without converting a list every step."""

    def __init__(self) -> None:
        self._buf = torch.empty(64, dtype=torch.int64)
        self._len = 0

    @property
    def tensor(self) -> torch.Tensor:
        """The ids so far, as a view that later ``extend`` calls never change."""
        return self._buf[: self._len]

    def extend(self, ids: Sequence[int]) -> None:
        """Append ``ids``."""
        n = self._len + len(ids)
        if n > self._buf.shape[0]:
            grown = torch.empty(max(n, 2 * self._buf.shape[0]), dtype=torch.int64)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown
        if ids:
            self._buf[self._len : n] = torch.tensor(list(ids), dtype=torch.int64)
        self._len = n


def _check_ids(ids: torch.Tensor, vocab: int, what: str) -> None:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(
            f"{what} holds ids outside [0, {vocab}): min={int(ids.min())}, max={int(ids.max())}"
        )


def _column(values: Sequence[float], dev: torch.device) -> torch.Tensor:
    return upload(torch.tensor(values, dtype=torch.float32), dev)[:, None]


def _per_row(values: Sequence[float], dev: torch.device) -> torch.Tensor:
    return upload(torch.tensor(values, dtype=torch.float32), dev)


def _validate(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D (batch, vocab), got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    if len(rows) != logits.shape[0]:
        raise ValueError(f"got {len(rows)} sampling rows for {logits.shape[0]} rows of logits")
    if logits.shape[1] == 0:
        raise ValueError("logits have an empty vocabulary dimension")
    for i, r in enumerate(rows):
        if (r.generator is None) != (r.params.seed is None):
            raise ValueError(f"row {i}: generator must be given iff params.seed is set")
