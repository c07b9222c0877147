"""An OpenEnv environment played through rlstage's endpoint: ``agent.function: rlstage.engines.agents.openenv:episode``.

The prompts come from ``data.source: openenv`` (engines/data/datasets.py), one row per episode seed. Each sample
opens its own session with the environment server (OpenEnv's WebSocket client, one environment instance per
session), resets it with the row's seed, and alternates: the observation's text as a user message, the policy's
reply (through the OpenAI client rlstage gives the agent) as the action. The environment's rewards, summed over the
episode, are the sample's reward. What of OpenEnv is used: ``reset(seed)``, ``step(action)``, an observation's
``reward`` and ``done``; the environment's own state, MCP tools and rubrics are not read.
"""

from __future__ import annotations

import json

from rlstage.engines.data.datasets import observation_text, openenv_session


async def episode(client, sample) -> float:
    """Play the row's episode to its end (the environment's done, ``max_steps``, or the sample's token or turn
    limits); the environment's rewards summed."""
    info = json.loads(sample.row["extra_info"])
    s = info["openenv"]
    total = 0.0
    async with openenv_session(s["url"], s["timeout_s"]) as env:
        result = await env.reset(seed=info["seed"])
        messages = [{"role": "user", "content": observation_text(result.observation, s["observation_field"])}]
        for _ in range(s["max_steps"]):
            reply = await client.chat.completions.create(model=sample.model, messages=messages)
            if reply.usage is not None and reply.usage.completion_tokens == 0:
                break  # a limit of the sample ended its trajectory: nothing was generated to act with
            text = reply.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": text})
            result = await env.step({s["action_field"]: text})
            total += float(result.reward or 0.0)
            if result.done:
                break
            messages.append({"role": "user", "content": observation_text(result.observation, s["observation_field"])})
    return total
