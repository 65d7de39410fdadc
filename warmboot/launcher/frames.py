"""The launcher <-> worker wire format: length-prefixed msgpack frames over stdin/stdout.

A frame is a 4-byte big-endian length and a msgpack map with a ``t`` (type) field. Only plain
data crosses: ``SamplingParams`` and ``RequestOutput`` are turned into maps and back here.
No sockets: a worker inside a process snapshot keeps talking on whatever stdio the restore
gave it.
"""

from __future__ import annotations

import json
import struct
import threading
from dataclasses import fields
from typing import BinaryIO

import msgpack

from warmboot.core.errors import InvalidRequestError
from warmboot.outputs import CompletionOutput, Logprob, OutputFolder, RequestOutput
from warmboot.sampling_params import SamplingParams, StructuredOutputs

MAX_FRAME_BYTES = 256 << 20
_HEADER = struct.Struct(">I")


class FrameError(RuntimeError):
    """The peer closed the pipe or sent something that is not a frame."""


def read_frame(stream: BinaryIO) -> dict | None:
    """The next frame, or None at a clean end of stream."""
    header = _read_exact(stream, _HEADER.size, allow_eof=True)
    if header is None:
        return None
    (size,) = _HEADER.unpack(header)
    if size > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {size} bytes exceeds the limit of {MAX_FRAME_BYTES}")
    body = _read_exact(stream, size, allow_eof=False)
    frame = msgpack.unpackb(body, raw=False, strict_map_key=False)
    if not isinstance(frame, dict) or "t" not in frame:
        raise FrameError(f"not a frame: {str(frame)[:80]}")
    return frame


def _read_exact(stream: BinaryIO, size: int, allow_eof: bool) -> bytes | None:
    data = bytearray()
    while len(data) < size:
        piece = stream.read(size - len(data))
        if not piece:
            if allow_eof and not data:
                return None
            raise FrameError(f"stream ended inside a frame ({len(data)} of {size} bytes)")
        data += piece
    return bytes(data)


class FrameWriter:
    """Thread-safe frame writer (the engine thread and the reader thread both reply)."""

    def __init__(self, stream: BinaryIO):
        self._stream = stream
        self._lock = threading.Lock()

    def send(self, frame: dict) -> None:
        body = msgpack.packb(frame, use_bin_type=True)
        with self._lock:
            self._stream.write(_HEADER.pack(len(body)) + body)
            self._stream.flush()


# -- plain-data conversions ------------------------------------------------------------------
def params_to_wire(params: SamplingParams) -> dict:
    """Shallow: a schema or structural tag given as a dict crosses as JSON text (named in
    ``as_text``). Converted recursively, a schema 400 levels deep overflowed the stack, a
    500 for what the worker refuses with a 400 naming the nesting limit."""
    data = {f.name: getattr(params, f.name) for f in fields(params)}
    spec = params.structured_outputs
    if spec is not None:
        wire = {f.name: getattr(spec, f.name) for f in fields(spec)}
        texts = [name for name, value in wire.items() if isinstance(value, dict | list)]
        for name in texts:
            try:
                wire[name] = json.dumps(wire[name])
            except RecursionError:
                raise InvalidRequestError(
                    f"structured_outputs.{name} is nested too deeply to compile"
                ) from None
        data["structured_outputs"] = wire | {"as_text": texts}
    return data


def params_from_wire(data: dict) -> SamplingParams:
    data = dict(data)
    structured = data.pop("structured_outputs", None)
    if structured is not None:
        structured = dict(structured)
        for name in structured.pop("as_text", ()):
            structured[name] = json.loads(structured[name])
        data["structured_outputs"] = StructuredOutputs(**structured)
    return SamplingParams(**data)


def output_to_wire(out: RequestOutput) -> dict:
    """Only what is new since the previous output (any ``output_kind``): a long stream
    costs O(tokens) on the wire, not O(tokens^2)."""
    completions = []
    for c in out.outputs:
        new = len(c.delta_token_ids)
        logprobs = None
        if c.logprobs is not None:
            logprobs = [_logprobs_to_wire(step) for step in c.logprobs[len(c.logprobs) - new :]]
        completions.append(
            {
                "index": c.index,
                "delta_text": c.delta_text,
                "delta_token_ids": list(c.delta_token_ids),
                "logprobs": logprobs,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
        )
    wire = {"finished": out.finished, "num_cached_tokens": out.num_cached_tokens, "c": completions}
    if out.prompt_logprobs is not None:
        wire["p"] = [_logprobs_to_wire(step) for step in out.prompt_logprobs]
    return wire


def _logprobs_to_wire(step: dict | None) -> dict | None:
    return None if step is None else {t: [lp.logprob, lp.decoded_token] for t, lp in step.items()}


def _logprobs_from_wire(step: dict | None) -> dict | None:
    return None if step is None else {int(t): Logprob(v[0], v[1]) for t, v in step.items()}


class OutputAccumulator:
    """Turns ``output_to_wire`` maps back into ``RequestOutput``s of the request's kind:
    deltas as they are, cumulative ones folded (the only O(length) copy per output)."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        output_kind: str = "cumulative",
    ):
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.output_kind = output_kind
        self._folder = OutputFolder()

    def add(self, data: dict) -> RequestOutput:
        delta = RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[_completion_from_wire(c) for c in data["c"]],
            finished=data["finished"],
            num_cached_tokens=data["num_cached_tokens"],
            prompt_logprobs=[_logprobs_from_wire(s) for s in data["p"]] if "p" in data else None,
        )
        if self.output_kind == "delta":
            return delta
        self._folder.add(delta)
        return self._folder.cumulative()


def _completion_from_wire(c: dict) -> CompletionOutput:
    logprobs = None
    if c["logprobs"] is not None:
        logprobs = [_logprobs_from_wire(step) for step in c["logprobs"]]
    ids = list(c["delta_token_ids"])
    return CompletionOutput(
        index=c["index"],
        text=c["delta_text"],
        token_ids=ids,
        finish_reason=c["finish_reason"],
        stop_reason=c["stop_reason"],
        logprobs=logprobs,
        delta_text=c["delta_text"],
        delta_token_ids=ids,
    )
