"""Agents written as plain OpenAI clients, for ``agent.function`` (docs/agents.md: "Your own agent")."""

from __future__ import annotations

import json

import jsonschema

from rlstage.engines.agents.tools import calculator

# The calculator as an OpenAI function tool: the same schema a config declares for the built-in loop.
CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
_VALIDATOR = jsonschema.validators.validator_for(CALCULATOR_TOOL["function"]["parameters"])(CALCULATOR_TOOL["function"]["parameters"])


def run_calculator(name: str, arguments: str) -> str:
    """One tool call's message, in the built-in loop's words (engines/agents/tools.py: execute_tool_call)."""
    if not name:  # the endpoint's form of a <tool_call> tag it could not parse: the parser's error as arguments
        return f"error: malformed tool call: {arguments}"
    if name != "calculator":
        return f"error: unknown tool {name!r} (available: calculator)"
    try:
        args = json.loads(arguments)
    except ValueError:
        return f"error: malformed tool call: {arguments}"
    try:
        _VALIDATOR.validate(args)
    except jsonschema.ValidationError as err:
        return f"error: invalid arguments for calculator: {err.message}"
    try:
        return calculator(**args)
    except Exception as err:  # the model sees its mistake
        return f"error: tool calculator raised {type(err).__name__}: {err}"


async def calculator_agent(client, sample) -> float | None:
    """The built-in loop's calculator task: call the tool until the model answers; the rule reward scores it."""
    messages = list(sample.messages)
    while True:
        reply = await client.chat.completions.create(model=sample.model, messages=messages, tools=[CALCULATOR_TOOL])
        msg = reply.choices[0].message
        if not msg.tool_calls:
            return None  # the rule reward scores the last answer
        messages.append(msg.model_dump(exclude_none=True))
        for call in msg.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": run_calculator(call.function.name, call.function.arguments)})
