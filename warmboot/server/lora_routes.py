"""``/v1/models`` (the base and each LoRA adapter, in vLLM's shape: an adapter's ``parent`` is
the base, its ``root`` its path) and vLLM's runtime adapter routes, ``POST
/v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``: on only with
``WARMBOOT_ALLOW_RUNTIME_LORA_UPDATING=1`` (or vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``),
else a 403 saying how to allow them. A load is a 400 naming what is wrong (a name in use, a bad
path or adapter); an unload of a name not served a 404; an unloaded adapter's running requests
finish, and later ones naming it get a 404."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from warmboot.architectures import TOWER_KEY
from warmboot.core.errors import InvalidRequestError
from warmboot.server.adapters import (
    RUNTIME_ENV,
    VLLM_RUNTIME_ENV,
    NameInUse,
    ServedAdapters,
    runtime_updates_allowed,
)
from warmboot.server.engine_holder import EngineHolder
from warmboot.server.errors import ApiError, model_not_found
from warmboot.server.fields import UnsupportedParameter, _Strict

LOAD_PATH, UNLOAD_PATH = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


class LoadLoraAdapterRequest(_Strict):
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoraAdapterRequest(_Strict):
    lora_name: str
    lora_int_id: int | None = None
    """vLLM's; the name decides."""


class ModelRoutes:
    """``/v1/models``, ``/v1/models/{id}`` and the runtime adapter routes."""

    def __init__(self, holder: EngineHolder, adapters: ServedAdapters, allow_runtime: bool):
        self.holder, self.adapters, self.allow_runtime = holder, adapters, allow_runtime

    def install(self, app: FastAPI, get_and_head) -> None:
        get_and_head(app, "/v1/models", self.models)
        get_and_head(app, "/v1/models/{model_id:path}", self.model)
        app.add_api_route(LOAD_PATH, self.load, methods=["POST"])
        app.add_api_route(UNLOAD_PATH, self.unload, methods=["POST"])

    async def models(self) -> dict:
        cards = [self._card()] + [self._card(name) for name in self.adapters.names()]
        return {"object": "list", "data": cards}

    async def model(self, model_id: str) -> dict:
        try:
            self.adapters.lora_request(model_id)
        except LookupError:
            raise model_not_found(model_id, self.adapters.served()) from None
        return self._card(None if model_id == self.adapters.base else model_id)

    def _card(self, adapter: str | None = None) -> dict:
        base = self.adapters.base
        card = {"id": adapter or base, "object": "model", "created": 0, "owned_by": "warmboot"}
        if adapter is not None:
            request = self.adapters.by_name[adapter]
            card |= {"root": request.lora_path, "parent": request.base_model_name or base}
        else:
            card |= {"root": base, "parent": None}
        llm = self.holder.llm
        if llm is not None:
            card["max_model_len"] = llm.max_model_len
            engine = getattr(llm, "engine", None)  # NOTE: in-process only (a worker's: none)
            release = engine.model_config.get(TOWER_KEY) if engine is not None else None
            if release and adapter is None:  # NOTE: a multimodal release
                text = f"{release}'s language model (images are refused)"
                card |= {"input_modalities": ["text"], "served_text_only": text}
        return card

    async def load(self, body: LoadLoraAdapterRequest) -> PlainTextResponse:
        self._check_allowed()
        if body.load_inplace:
            raise UnsupportedParameter(
                "load_inplace", "replacing a loaded adapter is not served: unload it, then load"
            )
        llm = self.holder.require()
        await self.adapters.ready(llm)
        try:
            await self.adapters.load(llm, body.lora_name, body.lora_path)
        except InvalidRequestError as e:
            param = "lora_name" if isinstance(e, NameInUse) else "lora_path"
            raise ApiError(400, str(e), "invalid_request_error", param) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload(self, body: UnloadLoraAdapterRequest) -> PlainTextResponse:
        self._check_allowed()
        try:
            await self.adapters.unload(self.holder.llm, body.lora_name)
        except KeyError:
            message = f"the LoRA adapter {body.lora_name!r} cannot be found"
            raise ApiError(404, message, "invalid_request_error", "lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    def _check_allowed(self) -> None:
        if not self.allow_runtime:
            raise ApiError(
                403,
                "loading and unloading LoRA adapters at runtime is off: start the server with "
                f"{RUNTIME_ENV}=1 (or {VLLM_RUNTIME_ENV}=True) to allow it",
                "invalid_request_error",
                code="runtime_lora_updating_disabled",
            )


def model_routes(holder: EngineHolder, adapters: ServedAdapters) -> ModelRoutes:
    """The routes, with runtime updates as this process's environment says."""
    return ModelRoutes(holder, adapters, runtime_updates_allowed())
