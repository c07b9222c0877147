"""Hostile and buggy agents behind the OpenAI-compatible endpoint (issue #62): each is one failed sample, never a
wrecked step or a lost run. The cases, each with what is stored and trained:

1. an agent past its bound, whatever it does with cancellation (swallows it, hangs, blocks the event loop in one
   call or in many), is a ``timeout`` at its own bound, and the agents that waited behind it are not;
   ``agent.stage_timeout_s`` ends a round;
2. an over-long first prompt is a 400 naming the limit and a ``too_long`` sample; KeyboardInterrupt, SystemExit and
   GeneratorExit are ``raised`` samples; a reward beyond float32 (1e39, 1.7e308, NaN, inf) is a ``bad_return``;
3. a failed sample has reward 0, no trained token, its kind in the rollout and reward tables and ``rlstage
   inspect``, and is left out of its group's baseline (the pipeline run below); an agent that returns a number
   without a request is ``no_request`` and its number no reward;
4. another sample's id with the wrong key is refused and writes nothing;
5. tool calls in a first request's history reach the trained prompt; refused requests are counted, the first few
   of each sample logged;
and malformed, rewritten or wrongly addressed requests are 4xx answers the batch goes on past."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import openai
import pytest

from agents_support import ROWS, TOK, ScriptedEngine, ik, run_fn
from rlstage.engines.agents.endpoint import SAMPLE_HEADER
from rlstage.engines.agents.examples import CALCULATOR_TOOL, calculator_agent
from rlstage.engines.agents.loop import AgentLimits, agent_metrics
from rlstage.engines.rollout.hf import SamplingParams

# ---------------------------------------------------------------- failed samples


async def _raises(client, sample):
    await client.chat.completions.create(model=sample.model, messages=sample.messages)
    raise RuntimeError("the agent's own bug")


async def _hangs(client, sample):
    await asyncio.sleep(60)


async def _garbage(client, sample):
    await client.chat.completions.create(model=sample.model, messages=sample.messages)
    return "1.0"


def test_an_agent_that_raises_hangs_or_returns_garbage_is_a_failed_sample_counted_by_kind(caplog):
    rows = [*ROWS, {**ROWS[0], "prompt": "What is 5*6?"}]

    async def agent(client, sample):
        i = ik(sample)[0]
        return await (calculator_agent, _raises, _hangs, _garbage)[i](client, sample)

    with caplog.at_level(logging.WARNING, logger="rlstage.engines.agents.endpoint"):
        out, stats = run_fn(agent, rows=rows, timeout_s=1.0)
    status = [o.agent_status for o in out]
    assert status == ["ok", "ok", "raised", "raised", "timeout", "timeout", "bad_return", "bad_return"]
    for o in out[2:]:
        assert o.agent_reward == 0.0 and set(o.response_mask) == {0} and o.response_ids
    assert set(out[2].response_ids) - {0} and out[4].prompt_ids  # the raiser's turn is kept, the hung one gets a stub
    m = agent_metrics(out, stats)
    assert (m["agent/status/ok"], m["agent/status/raised"], m["agent/status/timeout"], m["agent/status/bad_return"]) == (2, 2, 2, 2)
    lines = [r.getMessage() for r in caplog.records]
    assert sum("raised RuntimeError: the agent's own bug" in x for x in lines) == 2
    assert sum("timed out after 1s" in x for x in lines) == 2 and sum("returned str '1.0'" in x for x in lines) == 2


def test_a_reward_beyond_float32_is_a_bad_return_not_an_inf_in_the_table():
    """1e39 is a finite Python float but inf in the rewards table's float32 column: a bad return, as NaN and inf are."""
    values = (1e39, -1.7e308, float("inf"), float("nan"), 3.0e38)
    rows = [*ROWS, {**ROWS[0], "prompt": "What is 5*6?"}, {**ROWS[0], "prompt": "What is 2*9?"}]

    async def agent(client, sample):
        await client.chat.completions.create(model=sample.model, messages=sample.messages)
        return values[ik(sample)[0]]

    out, _ = run_fn(agent, rows=rows)
    assert [o.agent_status for o in out] == ["bad_return"] * 8 + ["ok"] * 2
    assert [o.agent_reward for o in out] == [0.0] * 8 + [3.0e38] * 2


def test_an_agent_that_swallows_its_cancellation_is_a_timeout_at_its_own_bound():
    """An agent that catches CancelledError and goes on (for ever) cannot outlive its timeout: the batch returns, the
    sample is a timeout with reward 0 and no trained tokens, and nothing it asked after its bound is recorded."""
    tried_after: list[str] = []

    async def stubborn(client, sample):
        if ik(sample)[0] != 1:
            return await calculator_agent(client, sample)
        await client.chat.completions.create(model=sample.model, messages=sample.messages)
        while True:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                try:  # past its bound: refused
                    await client.chat.completions.create(model=sample.model, messages=sample.messages)
                    tried_after.append("answered")
                except Exception as err:
                    tried_after.append(type(err).__name__)

    out, _ = run_fn(stubborn, timeout_s=1.0)
    assert [o.agent_status for o in out] == ["ok", "ok", "timeout", "timeout", "ok", "ok"]
    for o in out[2:4]:
        assert o.agent_reward == 0.0 and set(o.response_mask) == {0}
    assert "answered" not in tried_after


def test_the_policys_time_is_not_the_agents_a_slow_engine_times_out_no_sample():
    """The bound counts the agent's own time: its requests' time in the endpoint (the engine's generation, however
    slow or however loaded the machine) is the policy's. Each generate call here takes 0.6 s, so every sample waits
    1.2 s for its two turns, past its 1 s bound: none is a timeout, and one that sleeps 1.5 s of its own is."""
    import time as _time

    class SlowEngine(ScriptedEngine):
        def generate_ids(self, encoded, params):
            _time.sleep(0.6)  # on the policy's worker thread: the event loop runs on meanwhile
            return super().generate_ids(encoded, params)

    async def agent(client, sample):
        if ik(sample) == (2, 1):
            await asyncio.sleep(1.5)
        return await calculator_agent(client, sample)

    out, stats = run_fn(agent, engine=SlowEngine(), timeout_s=1.0)
    assert [o.agent_status for o in out] == ["ok", "ok", "ok", "ok", "ok", "timeout"]
    assert stats["model_s"] >= 1.2  # the generate calls did take that long


@pytest.mark.parametrize("steps", [1, 50], ids=["one-call", "many-short-steps"])
def test_a_blocking_agent_is_charged_its_own_stall_and_the_others_are_not(steps):
    """``time.sleep`` inside ``async def`` holds the event loop: the agent that blocked past its bound is the timeout;
    the samples that waited behind it are not (their bound counts their own time), whether it blocked in one call or
    in many short ones between awaits (50 of 30 ms: before, every sample of the batch was a timeout)."""
    import time as _time

    async def blocks(client, sample):
        if ik(sample) == (1, 0):
            await client.chat.completions.create(model=sample.model, messages=sample.messages)
            for _ in range(steps):
                _time.sleep(1.5 / steps)  # the mistake: a blocking call in an async agent
                await asyncio.sleep(0)
            return 1.0
        await asyncio.sleep(0.2)  # the others still running while it blocks
        return await calculator_agent(client, sample)

    out, _ = run_fn(blocks, timeout_s=1.0)
    assert [o.agent_status for o in out] == ["ok", "ok", "timeout", "ok", "ok", "ok"]
    assert out[2].agent_reward == 0.0 and set(out[2].response_mask) == {0}
    assert [o.agent_reward for o in out if o.agent_status == "ok"] == [None] * 5  # the rule scores the innocents


def test_base_exceptions_from_an_agent_are_failed_samples_and_a_round_has_its_own_bound(caplog):
    """KeyboardInterrupt, SystemExit and GeneratorExit raised by an agent fail its sample only (asyncio would
    re-raise the first two out of the loop); ``agent.stage_timeout_s`` ends a round whose agents have not finished."""

    async def escapes(client, sample):
        i, k = ik(sample)
        await client.chat.completions.create(model=sample.model, messages=sample.messages)
        if i == 0:
            raise (KeyboardInterrupt, SystemExit)[k]("from the agent")
        if (i, k) == (1, 0):
            raise GeneratorExit
        if i == 2:
            await asyncio.sleep(60)  # within its own 30 s bound, past the round's
        return 1.0

    with caplog.at_level(logging.WARNING, logger="rlstage.engines.agents.endpoint"):
        out, _ = run_fn(escapes, timeout_s=30.0, stage_timeout_s=1.0)
    assert [o.agent_status for o in out] == ["raised", "raised", "raised", "ok", "timeout", "timeout"]
    lines = [r.getMessage() for r in caplog.records]
    assert any("raised KeyboardInterrupt: from the agent" in x for x in lines)
    assert any("raised SystemExit: from the agent" in x for x in lines)
    assert any("2 sample(s) still running at agent.stage_timeout_s=1s" in x for x in lines)


def test_an_over_long_first_prompt_is_refused_and_only_its_sample_fails(caplog):
    """A first request over ``data.max_prompt_length`` (2,000 characters, and 1 MB) is a 400 naming the limit, the
    sample ``too_long`` with reward 0 and nothing trained, whatever its agent does next; the batch goes on."""
    seen: list[str] = []

    async def long_winded(client, sample):
        i, k = ik(sample)
        if i == 0:
            return await calculator_agent(client, sample)
        text = "x" * (2000 if i == 1 else 1 << 20)
        try:
            await client.chat.completions.create(model=sample.model, messages=[{"role": "user", "content": text}])
        except openai.BadRequestError as err:
            seen.append(str(err))
        return 1.0  # claims success: not a reward

    with caplog.at_level(logging.WARNING, logger="rlstage.engines.agents.endpoint"):
        out, stats = run_fn(long_winded, limits=AgentLimits(max_prompt_tokens=256))
    assert [o.agent_status for o in out] == ["ok", "ok", "too_long", "too_long", "too_long", "too_long"]
    for o in out[2:]:
        assert o.agent_reward == 0.0 and set(o.response_mask) == {0}
    assert len(seen) == 4 and all("400" in m and "data.max_prompt_length is 256" in m for m in seen)
    assert stats["rejected/prompt_too_long"] == 4.0


def test_an_agent_that_returns_without_a_request_is_no_request_and_its_number_no_reward():
    """Before: marked failed but its 1.0 kept, the sample's score (and a held-out accuracy made of such returns)."""

    async def lazy(client, sample):
        if ik(sample)[0] == 1:
            return 1.0  # never asked the endpoint anything
        return await calculator_agent(client, sample)

    out, _ = run_fn(lazy)
    assert [o.agent_status for o in out] == ["ok", "ok", "no_request", "no_request", "ok", "ok"]
    for o in out[2:4]:
        assert o.agent_reward == 0.0 and set(o.response_mask) == {0}


# ---------------------------------------------------------------- bad requests


def test_bad_requests_get_a_4xx_and_a_log_line_and_the_batch_goes_on(caplog):
    got: dict[str, object] = {}
    first_done = asyncio.Event()

    async def agent(client, sample):
        i, k = ik(sample)
        if (i, k) == (0, 0):
            try:
                return await calculator_agent(client, sample)
            finally:
                got["client"], got["headers"] = client, {SAMPLE_HEADER: sample.sample_id}
                first_done.set()
        if k == 1:
            return await calculator_agent(client, sample)
        try:
            if i == 1:
                await client.chat.completions.create(model="gpt-4o", messages=sample.messages)
            else:
                await client.chat.completions.create(model=sample.model, messages=sample.messages, tools=[{"type": "function", "name": "calculator"}])
        except openai.APIStatusError as err:
            got[f"{i}"] = (err.status_code, err.body)
        base = str(client.base_url).rstrip("/")
        async with httpx.AsyncClient() as raw:  # no sample id
            r = await raw.post(f"{base}/chat/completions", json={"model": sample.model, "messages": sample.messages})
            got[f"noid{i}"] = r.status_code
        await first_done.wait()
        try:  # sample 0-0's agent has returned: its client is refused
            await got["client"].chat.completions.create(model=sample.model, messages=sample.messages)
        except openai.APIStatusError as err:
            got[f"closed{i}"] = err.status_code
        return await calculator_agent(client, sample)

    with caplog.at_level(logging.WARNING, logger="rlstage.engines.agents.endpoint"):
        out, stats = run_fn(agent, timeout_s=30.0)
    assert [o.agent_status for o in out] == ["ok"] * 6 and all(o.num_turns == 2 for o in out)
    assert got["1"][0] == 404 and "gpt-4o" in got["1"][1]["message"]
    assert got["2"][0] == 400 and got["2"][1]["code"] == "invalid_tools"
    assert got["noid1"] == got["noid2"] == 400 and got["closed1"] == got["closed2"] == 409
    assert {k: v for k, v in stats.items() if k.startswith("rejected/")} == {
        "rejected/model_not_found": 1, "rejected/invalid_tools": 1, "rejected/missing_sample_id": 2, "rejected/sample_closed": 2,
    }  # fmt: skip
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("agent endpoint: HTTP")]
    assert len(lines) == 6 and all("\n" not in x for x in lines)
    assert sorted(x for x in stats["log"] if x.startswith("agent endpoint: HTTP")) == sorted(lines)  # for the stage's log
    # After the stage: the same sample's client gets a 409 (the endpoint outlives the stage), and a log line.
    late = openai.AsyncOpenAI(base_url=got["client"].base_url, api_key="x", max_retries=0, default_headers=got["headers"])
    with pytest.raises(openai.ConflictError) as err, caplog.at_level(logging.WARNING, logger="rlstage.engines.agents.endpoint"):
        asyncio.run(late.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}]))
    assert err.value.body["code"] == "stage_ended" and "stage_ended" in caplog.records[-1].getMessage()


def test_only_a_samples_own_client_writes_its_trajectory():
    """Each sample's client carries a secret API key, checked per request: another sample's id (ids appear in logs)
    with this client's key, or with none, is a 401 and writes nothing; ``/v1/models`` wants a running sample's key."""
    import httpx

    got: dict = {}

    async def agent(client, sample):
        i, k = ik(sample)
        if (i, k) == (0, 0):
            victim = sample.sample_id.rsplit("-", 2)[0] + "-1-0"
            body = {"model": "policy", "messages": [{"role": "user", "content": "What is 99*99?"}]}
            async with httpx.AsyncClient(base_url=str(client.base_url)) as http:
                for name, key in (("own key", client.api_key), ("no key", None), ("guessed", "rlstage")):
                    headers = {SAMPLE_HEADER: victim, **({"Authorization": f"Bearer {key}"} if key else {})}
                    got[name] = (await http.post("/chat/completions", json=body, headers=headers)).status_code
                got["models without key"] = (await http.get("/models")).status_code
                got["models"] = (await http.get("/models", headers={"Authorization": f"Bearer {client.api_key}"})).status_code
        return await calculator_agent(client, sample)

    out, stats = run_fn(agent, timeout_s=30.0)
    assert got == {"own key": 401, "no key": 401, "guessed": 401, "models without key": 401, "models": 200}
    assert stats["rejected/invalid_api_key"] == 4.0
    plain, _ = run_fn(calculator_agent, timeout_s=30.0)
    # the victim's trajectory is its own agent's, as in a batch without the intruder
    assert [o.response_ids for o in out] == [o.response_ids for o in plain] and "99" not in str(out[2].messages_json)


def test_refused_requests_are_all_counted_and_the_first_few_of_a_sample_logged(caplog):
    """A flood of bad requests from one agent: every one counted (agent/rejected/<code>), three logged, then one line
    saying the rest are counted only; the other samples' warnings are their own."""
    from rlstage.engines.agents.endpoint import WARNINGS_PER_SAMPLE

    async def flood(client, sample):
        if ik(sample) == (0, 0):
            for _ in range(20):
                try:
                    await client.chat.completions.create(model="gpt-4o", messages=sample.messages)
                except openai.NotFoundError:
                    pass
        elif ik(sample) == (1, 0):
            try:
                await client.chat.completions.create(model="gpt-4o", messages=sample.messages)
            except openai.NotFoundError:
                pass
        return await calculator_agent(client, sample)

    with caplog.at_level(logging.WARNING, logger="rlstage.engines.agents.endpoint"):
        out, stats = run_fn(flood, timeout_s=30.0)
    assert stats["rejected/model_not_found"] == 21.0 and [o.agent_status for o in out] == ["ok"] * 6
    lines = [r.getMessage() for r in caplog.records if "agent endpoint:" in r.getMessage()]
    first = [x for x in lines if "-0-0" in x]
    assert len(first) == WARNINGS_PER_SAMPLE + 1 and "counted in agent/rejected/<code>, not logged" in first[-1]
    assert len([x for x in lines if "-1-0" in x]) == 1


def test_tool_calls_in_a_first_requests_history_reach_the_trained_prompt():
    """A first request that replays a conversation with an assistant's tool calls: the calls (and the tool message
    answering one, named after it) are in the prompt as the chat template renders them, not dropped."""

    async def replays(client, sample):
        history = [
            *sample.messages,
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2*3"}'}},
            ]},
            {"role": "tool", "tool_call_id": "c1", "content": "6"},
            {"role": "user", "content": "and now?"},
        ]  # fmt: skip
        await client.chat.completions.create(model=sample.model, messages=history, tools=[CALCULATOR_TOOL])
        return 1.0

    out, _ = run_fn(replays, timeout_s=30.0)
    prompt = TOK.decode(out[0].prompt_ids)
    assert '<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>' in prompt, prompt
    assert "6" in prompt.split("</tool_call>", 1)[1] and "and now?" in prompt


def test_a_request_that_rewrites_earlier_turns_is_refused():
    seen: list[int] = []

    async def agent(client, sample):
        reply = await client.chat.completions.create(model=sample.model, messages=sample.messages, tools=[CALCULATOR_TOOL])
        forged = [*sample.messages, {"role": "assistant", "content": "something else"}, {"role": "user", "content": "go on"}]
        try:
            await client.chat.completions.create(model=sample.model, messages=forged)
        except openai.BadRequestError as err:
            seen.append(err.status_code)
        msg = reply.choices[0].message
        return await client.chat.completions.create(
            model=sample.model, messages=[*sample.messages, msg.model_dump(exclude_none=True), {"role": "user", "content": "go on"}]
        ) and 1.0

    out, stats = run_fn(agent, rows=ROWS[:1], params=SamplingParams(n=1, max_new_tokens=120))
    assert seen == [400] and stats["rejected/not_a_continuation"] == 1
    assert out[0].agent_status == "ok" and out[0].agent_reward == 1.0 and out[0].num_turns == 2
    assert json.loads(out[0].messages_json)[2] == {"role": "user", "content": "go on"}


def test_malformed_messages_are_a_400_not_a_crash():
    got: list[tuple[int, str]] = []

    async def agent(client, sample):
        for messages in ([{"role": "user", "content": 12}], [{"role": "user", "content": "x", "tool_calls": [1]}], []):
            try:
                await client.chat.completions.create(model=sample.model, messages=messages)
            except openai.BadRequestError as err:
                got.append((err.status_code, err.body["code"]))
        return await calculator_agent(client, sample)

    out, _ = run_fn(agent, rows=ROWS[:1], params=SamplingParams(n=1, max_new_tokens=120))
    assert got == [(400, "invalid_messages")] * 3 and out[0].agent_status == "ok"
