"""The LoRA adapters the server answers to by name, as vLLM's server: ``--lora-modules`` (its
two forms) and the ones loaded at runtime (``lora_routes``). A request's ``model`` names the
base (``served_model_name``) or an adapter, which becomes its ``lora_request``; the engine reads
an adapter on first use, so this table, not the engine, says which names are served (an engine
booted again after a crash reads them again as requests name them). Light: no FastAPI, no
torch (``cli`` reads ``--lora-modules`` with it before the engine boots)."""

from __future__ import annotations

import asyncio
import json
import os
import weakref
from collections.abc import Iterable, Sequence

from warmboot.core.errors import InvalidRequestError
from warmboot.lora_request import LoRARequest

RUNTIME_ENV = "WARMBOOT_ALLOW_RUNTIME_LORA_UPDATING"
VLLM_RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
_JSON_FIELDS = {"name", "path", "base_model_name"}


def runtime_updates_allowed(env=os.environ) -> bool:
    """Whether ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` are on: ours or
    vLLM's variable set to 1 or true."""
    return any(
        env.get(k, "").strip().lower() in ("1", "true") for k in (RUNTIME_ENV, VLLM_RUNTIME_ENV)
    )


def parse_lora_modules(items: Iterable[str], base: str | None = None) -> list[LoRARequest]:
    """``--lora-modules``' items (``NAME=PATH`` or vLLM's JSON object) as ``LoRARequest``s
    (ids 1, 2, ...; paths made absolute); ``ValueError`` naming a bad item, a name given twice
    or the base model's name (``base``)."""
    found: list[LoRARequest] = []
    for item in items:
        name, path, parent = _module(item)
        if name == base or any(r.lora_name == name for r in found):
            what = "the base model's name" if name == base else "given twice"
            raise ValueError(f"--lora-modules {item!r}: the name {name!r} is {what}")
        found.append(LoRARequest(name, len(found) + 1, _absolute(path), parent))
    return found


def _module(item: str) -> tuple[str, str, str | None]:
    text = item.strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules {item!r}: not valid JSON ({e})") from None
        if not isinstance(data, dict) or set(data) - _JSON_FIELDS:
            extra = sorted(set(data) - _JSON_FIELDS) if isinstance(data, dict) else "not an object"
            raise ValueError(
                f"--lora-modules {item!r}: use the fields name, path and base_model_name "
                f"(got {extra})"
            )
        name, path, parent = data.get("name"), data.get("path"), data.get("base_model_name")
    else:
        name, sep, path = text.partition("=")
        parent = None
        if not sep:
            raise ValueError(f"--lora-modules {item!r}: use NAME=PATH or a JSON object")
    for field, value in (("name", name), ("path", path)):
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"--lora-modules {item!r}: the adapter's {field} is missing")
    if parent is not None and not isinstance(parent, str):
        raise ValueError(f"--lora-modules {item!r}: base_model_name must be a string")
    return name.strip(), path.strip(), parent


def _absolute(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


class UnknownModel(LookupError):
    """A request named neither the base nor a served adapter."""

    def __init__(self, model: str, served: str):
        super().__init__(model)
        self.model, self.served = model, served


class NameInUse(InvalidRequestError):
    """A runtime load named the base or an adapter already served."""


class ServedAdapters:
    """The adapters served by name; ``startup``: ``--lora-modules``'."""

    def __init__(self, base: str, startup: Sequence[LoRARequest] = ()):
        self.base = base
        self.startup = list(startup)
        self.by_name: dict[str, LoRARequest] = {r.lora_name: r for r in self.startup}
        self._next_id = max((r.lora_int_id for r in self.startup), default=0) + 1
        self._loading: set[str] = set()
        self._prepared: weakref.WeakSet = weakref.WeakSet()
        self.screened: set[str] = set()
        """Names a stand-in knows without their requests (``screen_child``)."""

    def names(self) -> list[str]:
        return list(self.by_name)

    def lora_request(self, model: str) -> LoRARequest | None:
        """The adapter ``model`` names (None: the base); ``UnknownModel`` otherwise."""
        if model == self.base:
            return None
        found = self.by_name.get(model)
        if found is None:
            if model in self.screened:
                return LoRARequest(model, 1)
            raise UnknownModel(model, self.served())
        return found

    def served(self) -> str:
        """The names a client may send, for an error message."""
        adapters = ", ".join(repr(n) for n in self.by_name)
        return f"{self.base!r}" + (f" and the LoRA adapters {adapters}" if adapters else "")

    # -- loading into an engine ------------------------------------------------------------------
    def prepare(self, client) -> None:
        """On the boot thread, before the engine serves: read and check every start-up
        adapter still served; ``InvalidRequestError`` naming a bad one (the boot fails)."""
        asyncio.run(self.ready(client))

    async def ready(self, client) -> None:
        """The start-up adapters read into ``client``'s engine, once per engine (at its boot,
        or at the first request at the latest)."""
        if client in self._prepared:
            return
        wanted = [r for r in self.startup if self.by_name.get(r.lora_name) is r]
        await load_all(client, wanted)
        self._prepared.add(client)

    async def load(self, client, name: str, path: str) -> LoRARequest:
        """A runtime load (``InvalidRequestError`` naming what is wrong: a name in use, a bad
        path or adapter); served by name once the engine has read and checked it."""
        if not name.strip() or not path.strip():
            raise InvalidRequestError("both lora_name and lora_path must be given")
        if name == self.base:
            raise NameInUse(f"{name!r} is the base model's name")
        if name in self.by_name or name in self._loading:
            raise NameInUse(f"the LoRA adapter {name!r} has already been loaded")
        request = LoRARequest(name, self._next_id, _absolute(path))
        self._next_id += 1
        self._loading.add(name)
        try:
            await client.add_lora(request)
        finally:
            self._loading.discard(name)
        self.by_name[name] = request
        return request

    async def unload(self, client, name: str) -> None:
        """Stop serving ``name`` (``KeyError`` if not served); the engine forgets it, and
        its running requests finish."""
        if name not in self.by_name:
            raise KeyError(name)
        del self.by_name[name]
        if client is not None:
            try:
                await client.remove_lora(name)
            except KeyError:  # NOTE: an engine booted again, which never read it
                pass


async def load_all(client, requests: Iterable[LoRARequest]) -> None:
    """Read and check each adapter into ``client``'s engine; ``InvalidRequestError`` naming
    the first bad one by its ``--lora-modules`` name and path."""
    for r in requests:
        try:
            await client.add_lora(r)
        except InvalidRequestError as e:  # NOTE: a ValueError: a boot it fails is a user error
            raise InvalidRequestError(f"--lora-modules {r.lora_name}={r.lora_path}: {e}") from None


def load_modules(requests: Sequence[LoRARequest], client) -> None:
    """``load_all`` on the boot thread (``EngineHolder.prepare``)."""
    if requests:
        asyncio.run(load_all(client, requests))
