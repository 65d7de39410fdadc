"""Run in .venv-clients: LangChain (tools, the three structured-output methods, the Responses
API) and LiteLLM (tools) against a warmboot server; prints one JSON object of what came back.

    python langchain_litellm.py BASE_URL MODEL
"""

import json
import sys

import litellm
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

URL, MODEL = sys.argv[1], sys.argv[2]


class Weather(BaseModel):
    """The weather query."""

    city: str = Field(max_length=12)
    days: int = Field(ge=1, le=7)


def main() -> None:
    llm = ChatOpenAI(
        base_url=URL + "/v1",
        api_key="unused",
        model=MODEL,
        max_tokens=200,
        temperature=1.0,
        seed=1,
        max_retries=0,
    )
    out = {}
    bound = llm.bind_tools([Weather], tool_choice="required", parallel_tool_calls=False)
    out["bind_tools"] = bound.invoke("weather in Rome?").tool_calls
    for method in ("function_calling", "json_schema", "json_mode"):
        chain = llm.with_structured_output(Weather, method=method, include_raw=True)
        got = chain.invoke("weather in Rome, as JSON")
        parsed = got["parsed"].model_dump() if got["parsed"] is not None else None
        raw = got["raw"].content if isinstance(got["raw"].content, str) else None
        out[method] = {"parsed": parsed, "raw": raw, "error": str(got["parsing_error"] or "")}
    responses = ChatOpenAI(
        base_url=URL + "/v1",
        api_key="unused",
        model=MODEL,
        max_tokens=8,
        use_responses_api=True,
        max_retries=0,
    )
    out["responses_text"] = responses.invoke("hello").text
    tools = [
        {
            "type": "function",
            "function": {"name": "Weather", "parameters": Weather.model_json_schema()},
        }
    ]
    reply = litellm.completion(
        model=f"openai/{MODEL}",
        api_base=URL + "/v1",
        api_key="unused",
        messages=[{"role": "user", "content": "weather?"}],
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
    )
    calls = reply.choices[0].message.tool_calls or []
    out["litellm"] = [{"name": c.function.name, "arguments": c.function.arguments} for c in calls]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
