"""The child process that screens large request bodies for ``body_parse`` (``python -m
warmboot.server.screen_child``; it reads its requests on stdin, answers on stdout).

It builds the server's app around a stand-in for the engine that answers only the facts it
is sent (context length, the tokenizer's longest token and size, the chat template, the LoRA
adapters' names) and runs
each request through it: the guard's text checks, FastAPI's parse and validation, the route's
checks. Any other use of the engine means the request got past the early checks: the
stand-in notes it and raises, and the answer is ``{"fits": true}``, as it is for anything but
a refusal. A refusal (a 4xx) comes back as ``{"status", "body"}``: the bytes the server would
send for it.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading

from warmboot.server.body_parse import REFUSALS, asgi_scope, read_frame, send_frames
from warmboot.server.config import AdmissionLimits, ServerConfig

NICE = 10
"""Below the server's own CPU priority: its event loop and engine come first."""
LIMIT_S = 30.0
"""A request still running after this (it should not: the engine is not there) fits."""


class _Reached(Exception):
    """The request got as far as the engine."""


REACHED = threading.Event()


class _Stand:
    """Answers the attributes it is given; any other is a use of the engine (noted, raised)."""

    def __init__(self, **known):
        self.__dict__.update(known)

    def __getattr__(self, name: str):
        REACHED.set()
        raise _Reached(name)


class _Tokenizer(_Stand):
    def __len__(self) -> int:
        return self.vocab_size


def engine_holder(facts: dict) -> _Stand:
    """An engine holder whose engine knows only ``facts``."""
    tokenizer = _Tokenizer(
        max_token_chars=facts["max_token_chars"],
        vocab_size=facts["vocab_size"],
        chat_template=facts["chat_template"],
    )
    llm = _Stand(max_model_len=facts["max_model_len"], tokenizer=tokenizer)
    return _Stand(llm=llm, require=lambda: llm, state=lambda: None, error=None)


async def verdict(app, scope: dict, body: bytes) -> dict:
    """``{"fits": true}``, or the refusal ``{"status", "body"}`` of the request."""
    from warmboot.server.errors import ApiError
    from warmboot.server.guard import check_text, replay_body

    REACHED.clear()
    try:
        check_text(body)
    except ApiError as e:
        return {"status": e.status, "body": e.response(scope["path"]).body.decode()}
    answer: dict = {"body": []}

    async def never_leaves():  # NOTE: the client never leaves
        await asyncio.Event().wait()

    async def send(message):
        if message["type"] == "http.response.start":
            answer["status"] = message["status"]
        elif message["type"] == "http.response.body":
            answer["body"].append(message.get("body", b""))

    await asyncio.wait_for(app(scope, replay_body(body, never_leaves), send), LIMIT_S)
    if REACHED.is_set() or answer.get("status") not in REFUSALS:
        return {"fits": True}
    return {"status": answer["status"], "body": b"".join(answer["body"]).decode()}


def main() -> None:
    os.nice(NICE)  # NOTE: first: the imports take a second of CPU
    from warmboot.server.app import create_app

    out = os.dup(1)
    os.dup2(2, 1)  # NOTE: stray prints go to stderr, not into the answers
    setup = json.loads(read_frame(0, None))
    config = ServerConfig(**(setup | {"admission": AdmissionLimits(**setup["admission"])}))
    loop = asyncio.new_event_loop()
    apps: dict[str, object] = {}
    while True:
        try:
            request = json.loads(read_frame(0, None))
            body = read_frame(0, None)
        except EOFError:
            return
        key = json.dumps(request["facts"], sort_keys=True)
        if key not in apps:
            apps[key] = create_app(engine_holder(request["facts"]), config).app
            apps[key].state.adapters.screened = set(request["facts"].get("adapters", ()))
        try:
            found = loop.run_until_complete(verdict(apps[key], asgi_scope(request["scope"]), body))
        except Exception:  # noqa: BLE001 - whatever went wrong, the server decides
            found = {"fits": True}
        send_frames(out, [json.dumps(found).encode()], None)


if __name__ == "__main__":
    sys.exit(main())
