"""The offline facade, shaped like vLLM's ``LLM``; ``close()`` (or ``with LLM(...) as llm:``)
frees its engine."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

from warmboot.config import ENGINE_OPTIONS, EngineConfig
from warmboot.engine.llm_engine import InvalidRequestError, LLMEngine, Prompt
from warmboot.lora_request import LoRARequest
from warmboot.options import build, describe, signature
from warmboot.outputs import RequestOutput
from warmboot.sampling_params import SamplingParams

Messages = list[dict]

ENGINE_NAMES = frozenset(o.name for o in ENGINE_OPTIONS)


class LLM:
    """``LLM(model=path).generate(prompts, SamplingParams(...))``.

    On a CPU with neither ``enforce_eager`` nor ``compile_steps`` said, ``LLM(...)`` returns
    as soon as the engine can serve eager steps; the model steps compile in the background
    (once the engine has been idle 0.5 s, or after 10 s of serving) and the step that serves
    from then on is chosen by measurement, so a first ``generate`` runs partly or wholly on
    eager steps. ``wait_for_compile=True`` returns only once that choice is made (vLLM's
    ``LLM`` returns compiled): a first batch then runs on the chosen step throughout.
    ``stats()["last_generate_steps"]`` counts the steps of the last ``generate`` by kind
    (``eager``, ``compiled``, ``graph``), ``stats()["steps_served"]`` all of them.

    ``close()`` frees the engine (waits for a background compile, stops the device thread,
    drops the KV pool and the weights); ``with LLM(...) as llm:`` closes on leaving the block.
    An engine never closed is closed at interpreter exit (``engine.shutdown``).
    """

    def __init__(self, model: str, *, wait_for_compile: bool = False, **settings: Any):
        unknown = sorted(set(settings) - ENGINE_NAMES)
        if unknown:
            near = difflib.get_close_matches(unknown[0], ENGINE_NAMES, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise TypeError(f"LLM() got unexpected keyword arguments {unknown}{hint}")
        if settings.get("snapshot_store") is not None:
            settings["snapshot_store"] = str(settings["snapshot_store"])
        config = build(EngineConfig, {"model": str(model), **settings}, ENGINE_OPTIONS)
        self.engine = LLMEngine(config)
        self._last_steps: dict[str, int] = {}
        if wait_for_compile:
            self.engine.wait_compiled()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Free the engine; idempotent. The LLM cannot generate afterwards."""
        self.engine.startup.close()

    @property
    def closed(self) -> bool:
        return self.engine.startup.closed

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order. ``lora_request``:
        the adapter of every prompt, or one per prompt (None: the base model).

        All prompts are validated before any is queued: a bad one raises ``ValueError`` naming
        its index, and nothing runs.
        """
        if isinstance(prompts, (str, dict)) or _is_token_list(prompts):
            prompts = [prompts]
        params = [_final(p) for p in _per_prompt(sampling_params, len(prompts))]
        ids = self._add_all(prompts, params, _per_prompt_lora(lora_request, len(prompts)))
        done: dict[str, RequestOutput] = {}
        before = self.engine.runner.served.copy()
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                done[out.request_id] = out
        self._last_steps = dict(self.engine.runner.served - before)
        return [done[i] for i in ids]

    def generate_stream(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield the outputs of one request as it advances, shaped by the params'
        ``output_kind`` (cumulative by default, with ``delta_text`` / ``delta_token_ids``)."""
        params = [sampling_params or SamplingParams()]
        (request_id,) = self._add_all([prompt], params, [lora_request])
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == request_id:
                        yield out
                        if out.finished:
                            return
        finally:
            if request_id in self.engine.outputs.groups:
                self.engine.abort_request(request_id)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts = [
            tok.apply_chat_template(list(c), add_generation_prompt=add_generation_prompt)
            for c in conversations
        ]
        # NOTE: the template already holds any BOS; do not add special tokens again.
        token_prompts = [
            {"prompt": p, "prompt_token_ids": tok.encode(p, add_special_tokens=False)}
            for p in prompts
        ]
        return self.generate(token_prompts, sampling_params, lora_request)

    def stats(self) -> dict:
        return self.engine.stats() | {"last_generate_steps": dict(self._last_steps)}

    def _add_all(
        self, prompts: Sequence[Prompt], params: list[SamplingParams], loras: list
    ) -> list[str]:
        if self.closed:
            raise RuntimeError("this LLM is closed")
        checked = []
        for i, (prompt, p, lora) in enumerate(zip(prompts, params, loras, strict=True)):
            try:
                checked.append(self.engine.validate(prompt, p))
                if lora is not None:  # NOTE: read and checked before anything is queued
                    self.engine.check_lora(lora)
            except InvalidRequestError as e:
                raise InvalidRequestError(f"prompt {i}: {e}") from None
        pairs = zip(checked, loras, strict=True)
        return [self.engine.add_request(None, c, lora_request=lora) for c, lora in pairs]


def _signature() -> inspect.Signature:
    """``LLM.__init__``'s, the settings spelled out (``help(LLM)``, ``inspect``, editors)."""
    plain = inspect.Parameter.POSITIONAL_OR_KEYWORD
    before = [inspect.Parameter("self", plain), inspect.Parameter("model", plain)]
    wait = inspect.Parameter("wait_for_compile", inspect.Parameter.KEYWORD_ONLY, default=False)
    return signature(ENGINE_OPTIONS, before, [wait])


LLM.__init__.__signature__ = _signature()
LLM.__doc__ += "\n" + describe(ENGINE_OPTIONS)


def _is_token_list(x) -> bool:
    return isinstance(x, list) and bool(x) and isinstance(x[0], int)


def _final(params: SamplingParams) -> SamplingParams:
    """Batch generation returns only the end: no per-step output copies."""
    return params if params.output_kind == "final" else replace(params, output_kind="final")


def _per_prompt_lora(lora, count: int) -> list:
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * count
    lora = list(lora)
    if len(lora) != count:
        raise ValueError(f"{len(lora)} lora requests for {count} prompts")
    return lora


def _per_prompt(params, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"{len(params)} sampling params for {count} prompts")
    return params
