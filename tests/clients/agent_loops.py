"""Run in .venv-clients: the tool loops of the OpenAI Agents SDK and of LangGraph's prebuilt
ReAct agent against a warmboot server, with a token limit that lets the call finish and with
limits that cut it; prints one JSON object of what each framework returned and of what the
server sent it (content, tool calls, finish reason of each reply).

    python agent_loops.py BASE_URL MODEL
"""

import asyncio
import json
import sys
import warnings
from typing import Annotated

import httpx
import httpx2
from agents import (
    Agent,
    ItemHelpers,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from openai import AsyncOpenAI
from pydantic import Field

URL, MODEL = sys.argv[1], sys.argv[2]
LIMITS = {"complete": 200, "cut": 48, "cut_stream": 48, "cut_early": 12, "cut_early_stream": 12}
"""max_tokens per run: 48 stops inside the arguments, 12 inside the call's opening markup."""


def get_weather(city: Annotated[str, Field(max_length=12)]) -> str:
    """The weather of a city."""
    return f"sunny in {city}"


class Wire:
    """Every chat completion the server sent, read in full by an httpx response hook."""

    def __init__(self):
        self.replies: list[dict] = []

    async def hook(self, response) -> None:
        if response.request.url.path.endswith("/chat/completions"):
            self.replies.append(_summary(await response.aread()))


def _summary(body: bytes) -> dict:
    """content, tool calls and finish reason of one reply, whole JSON or SSE chunks."""
    text = body.decode()
    if not text.lstrip().startswith("data:"):
        choice = json.loads(text)["choices"][0]
        message, calls = choice["message"], choice["message"].get("tool_calls") or []
        calls = [[c["function"]["name"], c["function"]["arguments"]] for c in calls]
        return {
            "content": message.get("content"),
            "finish_reason": choice["finish_reason"],
            "tool_calls": calls,
        }
    out, calls = {"content": "", "finish_reason": None, "tool_calls": []}, {}
    for line in text.splitlines():
        if not line.startswith("data:") or line.strip() == "data: [DONE]":
            continue
        for choice in json.loads(line[5:]).get("choices", []):
            delta = choice.get("delta") or {}
            out["content"] += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                entry = calls.setdefault(call["index"], ["", ""])
                entry[0] += (call.get("function") or {}).get("name") or ""
                entry[1] += (call.get("function") or {}).get("arguments") or ""
            out["finish_reason"] = choice.get("finish_reason") or out["finish_reason"]
    out["tool_calls"] = [calls[i] for i in sorted(calls)]
    return out


async def agents_sdk(limit: int, stream: bool) -> dict:
    wire = Wire()
    http = httpx2.AsyncClient(event_hooks={"response": [wire.hook]})
    client = AsyncOpenAI(base_url=URL + "/v1", api_key="unused", max_retries=0, http_client=http)
    settings = ModelSettings(
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=limit,
        temperature=1.0,
        extra_args={"seed": 1},
    )
    agent = Agent(
        name="weather",
        instructions="Use the tool.",
        tools=[function_tool(get_weather)],
        model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
        model_settings=settings,
        tool_use_behavior="stop_on_first_tool",
    )
    out: dict = {"wire": wire.replies}
    try:
        if stream:
            result = Runner.run_streamed(agent, "weather in Rome?", max_turns=3)
            async for _ in result.stream_events():
                pass
        else:
            result = await Runner.run(agent, "weather in Rome?", max_turns=3)
        out["final"] = None if result.final_output is None else str(result.final_output)
        out["items"] = [_agents_item(item) for item in result.new_items]
    except Exception as e:  # what the framework raised is part of the record
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def _agents_item(item) -> dict:
    if item.type == "tool_call_item":
        return {"type": item.type, "name": item.raw_item.name, "arguments": item.raw_item.arguments}
    if item.type == "tool_call_output_item":
        return {"type": item.type, "output": str(item.output)}
    if item.type == "message_output_item":
        return {"type": item.type, "text": ItemHelpers.text_message_output(item)}
    return {"type": item.type}


async def langgraph(limit: int, stream: bool) -> dict:
    from langgraph.prebuilt import create_react_agent

    wire = Wire()
    http = httpx.AsyncClient(event_hooks={"response": [wire.hook]})
    llm = ChatOpenAI(
        base_url=URL + "/v1",
        api_key="unused",
        model=MODEL,
        max_tokens=limit,
        temperature=1.0,
        seed=1,
        max_retries=0,
        streaming=stream,
        http_async_client=http,
    )
    weather = tool(get_weather, return_direct=True)  # the loop ends once the tool ran
    bound = llm.bind_tools([weather], tool_choice="required", parallel_tool_calls=False)
    agent = create_react_agent(bound, [weather])
    out: dict = {"wire": wire.replies}
    try:
        state = await agent.ainvoke(
            {"messages": [("user", "weather in Rome?")]}, {"recursion_limit": 6}
        )
        out["messages"] = [_lc_message(m) for m in state["messages"][1:]]
        out["final"] = state["messages"][-1].content
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def _lc_message(m) -> dict:
    calls = [[c["name"], c["args"]] for c in getattr(m, "tool_calls", [])]
    bad = [[c["name"], c["args"]] for c in getattr(m, "invalid_tool_calls", [])]
    return {
        "type": m.type,
        "content": m.content,
        "tool_calls": calls,
        "invalid_tool_calls": bad,
        "finish_reason": m.response_metadata.get("finish_reason"),
    }


async def main() -> None:
    set_tracing_disabled(True)
    warnings.filterwarnings("ignore", message=".*create_react_agent.*")
    out: dict = {"agents": {}, "langgraph": {}}
    for run, limit in LIMITS.items():
        stream = run.endswith("_stream")
        out["agents"][run] = await agents_sdk(limit, stream)
        out["langgraph"][run] = await langgraph(limit, stream)
    print(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main())
