"""A small agent that books a multi-city trip: it asks the model what to do, and the
model answers with one tool call per step (checking each city), until it is done.

It talks to the sidecar exactly as it would talk to OpenAI and to its own tools:
the stock OpenAI SDK with its base URL pointed at the sidecar, plain HTTP for the
tools, and a few extra headers: Outrigger-Task-Id naming the task, and on tool calls
the model's tool_call_id and `Prefer: wait=30` (a repeat of a call still running,
because the agent was killed during it, waits for its result instead of getting
409). Nothing else in the agent knows about crashes.

Kill it at any point and start it again with the same task id: the model calls it
repeats are answered from the sidecar's journal (the same tool_call_ids come back),
and the tool calls it repeats are deduplicated by keys the sidecar derives from
those ids, so every side effect happens exactly once.

    OUTRIGGER_URL=http://127.0.0.1:7070 TASK_ID=trip-42 python3 agent.py

AGENT_STREAM=1 makes it stream every model turn (`stream=True`), assembling the
message from the chunks as any streaming agent does; a killed agent's repeated turns
are then replayed as streams, byte for byte.

For the crash-recovery test, AGENT_CRASH_AFTER_TOOL_CALLS=N makes the agent kill
itself (SIGKILL) right after its N-th tool call returned, and (streaming)
AGENT_CRASH_MID_STREAM=N right after the first chunk of its N-th model turn arrived:
the sidecar reads the rest of that stream into its journal, and the restarted agent
gets it whole from there, nothing generated twice.
"""

import json
import os
import signal
import sys
import urllib.request

from openai import OpenAI
from openai.types.chat import ChatCompletionMessage

SIDECAR = os.environ.get("OUTRIGGER_URL", "http://127.0.0.1:7070")
TASK_ID = os.environ.get("TASK_ID", "trip-42")
MODEL = os.environ.get("MODEL", "gpt-mock")
CRASH_AFTER = int(os.environ.get("AGENT_CRASH_AFTER_TOOL_CALLS", "0"))
STREAM = os.environ.get("AGENT_STREAM") == "1"
CRASH_MID_STREAM = int(os.environ.get("AGENT_CRASH_MID_STREAM", "0"))

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Checks a city and books it when the weather is fine (a side effect).",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
            "required": ["city"],
        },
    },
}]


def call_tool(tool_call):
    """POSTs one tool call to the sidecar's tool route. No idempotency key is sent:
    the sidecar derives it from the task and the model's tool_call_id."""
    request = urllib.request.Request(
        f"{SIDECAR}/tools/booking/{tool_call.function.name}",
        data=tool_call.function.arguments.encode(),
        method="POST",
        headers={
            "content-type": "application/json",
            "outrigger-task-id": TASK_ID,
            "outrigger-tool-call-id": tool_call.id,
            "prefer": "wait=30",
        },
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        replayed = response.headers.get("outrigger-replayed") == "true"
        return json.loads(response.read()), replayed


def crash():
    print("crashing now", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def plain_turn(client, messages, turn):
    """One model turn as a plain call: the message, and whether it was replayed."""
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, tools=TOOLS)
    replayed = raw.headers.get("outrigger-replayed") == "true"
    return raw.parse().choices[0].message, replayed


def streamed_turn(client, messages, turn):
    """One model turn streamed: the message assembled from its chunks (text deltas
    joined, each tool call's name and arguments joined by index), and whether it
    was replayed."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, tools=TOOLS, stream=True
    )
    replayed = raw.headers.get("outrigger-replayed") == "true"
    text, calls = [], {}
    for n, chunk in enumerate(raw.parse()):
        if CRASH_MID_STREAM == turn and n == 0:
            crash()
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                text.append(delta.content)
            for part in delta.tool_calls or []:
                call = calls.setdefault(
                    part.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
                )
                call["id"] += part.id or ""
                if part.function:
                    call["function"]["name"] += part.function.name or ""
                    call["function"]["arguments"] += part.function.arguments or ""
    message = {"role": "assistant", "content": "".join(text) or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return ChatCompletionMessage.model_validate(message), replayed


def main():
    client = OpenAI(
        base_url=f"{SIDECAR}/v1",
        api_key="unused-the-sidecar-holds-the-key",
        default_headers={"outrigger-task-id": TASK_ID},
        max_retries=0,
    )
    messages = [
        {"role": "system", "content": "You plan trips. Check every city with get_weather."},
        {"role": "user", "content": "Plan my trip and book what you can."},
    ]
    tool_calls_done = 0
    turn = streamed_turn if STREAM else plain_turn
    for step in range(20):
        message, replayed = turn(client, messages, step + 1)
        print(f"step {step}: model {'replayed from the journal' if replayed else 'generated'}", flush=True)
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            print(f"done: {message.content}", flush=True)
            return 0
        for tool_call in message.tool_calls:
            result, replayed = call_tool(tool_call)
            tool_calls_done += 1
            print(f"  tool {tool_call.function.name}({tool_call.function.arguments}) "
                  f"-> effect {result.get('effect')}{' (replayed)' if replayed else ''}", flush=True)
            messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": json.dumps(result)})
            if CRASH_AFTER and tool_calls_done == CRASH_AFTER:
                crash()
    print("gave up after 20 steps", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
