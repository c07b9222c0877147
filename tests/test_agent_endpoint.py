"""agent.function (issue 40): the OpenAI-compatible endpoint, token-exact trajectories, failures, bad requests."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import openai
import pytest
import torch

from rlstage.engines.agents.endpoint import SAMPLE_HEADER, run_function_batch
from rlstage.engines.agents.examples import CALCULATOR_TOOL, calculator_agent, run_calculator
from rlstage.engines.agents.loop import AgentLimits, ChatFormat, agent_metrics, run_agent_batch
from rlstage.engines.agents.tools import ToolSpec, calculator
from rlstage.engines.models.tinykit import build_char_tokenizer, build_tiny_llama
from rlstage.engines.preflight import preflight
from rlstage.engines.rollout.hf import Completion, SamplingParams
from rlstage.schemas.config import ConfigError, KitConfig, load_config

TOK = build_char_tokenizer()
FMT = ChatFormat(TOK)
EOS = TOK.eos_token_id
CALC = ToolSpec("calculator", "", CALCULATOR_TOOL["function"]["parameters"], calculator, 1.0)
TOOLS = {"calculator": CALC}
# A token decoding skips: text holding it re-tokenizes to other ids than the engine sampled.
SKIPPED = TOK.convert_tokens_to_ids("<bos>")


def ids(text: str) -> list[int]:
    return TOK.convert_tokens_to_ids(list(text))


class ScriptedEngine:
    """An engine whose turns are fixed: a calculator call wrapped in a skipped special token, then the tool's result.

    It records what it was asked and what it answered, so a test can compare the trainer's tokens with the engine's.
    """

    batch_size = 64
    tokenizer = TOK

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], list[int], list[float]]] = []

    def generate_ids(self, encoded: list[list[int]], params: SamplingParams) -> list[Completion]:
        out = []
        for j, prompt in enumerate(encoded):
            text = TOK.decode(prompt)
            if "\nR:" not in text:
                a, b = text.split("What is ")[1].split("?")[0].split("*")
                call = json.dumps({"name": "calculator", "arguments": {"expression": f"{a}*{b}"}}, separators=(",", ":"))
                resp = [SKIPPED] + ids(f"<tool_call>{call}</tool_call>") + [EOS]
            else:
                resp = ids(text.rsplit("\nR:", 1)[1].split("\n")[0]) + [SKIPPED, EOS]
            lps = [-0.05 - t / 1000 for t in range(len(resp))]
            self.calls.append((list(prompt), resp, lps))
            out.append(Completion(j, 0, prompt, resp, lps, TOK.decode(resp, skip_special_tokens=True), "stop"))
        return out


ROWS = [{"prompt": f"What is {a}*{a + 3}?", "messages": None, "extra_info": "{}", "ground_truth": str(a * (a + 3))} for a in (12, 40, 7)]
PARAMS = SamplingParams(n=2, temperature=1.0, max_new_tokens=120, seed=3)


def ik(sample) -> tuple[int, int]:
    """(prompt index, sample index) of a sample id ``<batch>-<i>-<k>``."""
    _, i, k = sample.sample_id.split("-")
    return int(i), int(k)


def run_fn(fn, engine=None, rows=ROWS, params=PARAMS, limits=AgentLimits(), **kw):
    return run_function_batch(engine or ScriptedEngine(), FMT, fn, rows, params, limits, tool_schemas=lambda r: [CALCULATOR_TOOL], **kw)


# ---------------------------------------------------------------- token-exact trajectories


def test_the_trainers_tokens_are_the_engines_for_a_trajectory_that_would_re_tokenize_differently():
    engine = ScriptedEngine()
    out, stats = run_fn(calculator_agent, engine)
    assert len(out) == 6 and all(o.agent_status == "ok" and o.agent_reward is None for o in out)
    by_prompt = {tuple(p): (r, lp) for p, r, lp in engine.calls}
    for o in out:
        assert o.num_turns == 2 and o.tool_calls == 1 and o.finish_reason == "stop"
        first = by_prompt[tuple(o.prompt_ids)]
        n1 = len(first[0])
        env = o.turn_bounds[1]
        second = by_prompt[tuple(o.prompt_ids + o.response_ids[: env["end"]])]
        # Exactly the engine's ids and log-probs on the policy's turns, the rendered tool turn between them, masked.
        assert o.response_ids == first[0] + o.response_ids[n1 : env["end"]] + second[0]
        assert o.log_probs[:n1] == first[1] and o.log_probs[env["end"] :] == second[1]
        assert o.response_mask == [1] * n1 + [0] * (env["end"] - n1) + [1] * len(second[0])
        assert o.response_ids[n1 : env["end"]] == ids(f"\nR:{o.text}\nA:")
        # Re-tokenizing the conversation's text would lose the special tokens the engine sampled.
        text = FMT.render(json.loads(o.messages_json), generation_prompt=False)
        assert FMT.encode(text)[: len(o.prompt_ids) + len(o.response_ids)] != o.prompt_ids + o.response_ids
    assert stats["batches"] == 2  # every sample's first turn in one batch, every second turn in another


@pytest.mark.parametrize(
    ("limits", "finish"),
    [
        (AgentLimits(), "stop"),
        (AgentLimits(max_turns=1), "max_turns"),
        (AgentLimits(max_tool_calls=0), "max_tool_calls"),
        (AgentLimits(max_response_tokens=90), "length"),  # the tool turn does not fit after the call
        (AgentLimits(max_response_tokens=60), "length"),  # the call itself is cut
    ],
)
def test_the_function_agent_and_the_built_in_loop_store_the_same_trajectories(limits, finish):
    fn_rows, _ = run_fn(calculator_agent, limits=limits)
    loop_rows, _ = run_agent_batch(ScriptedEngine(), FMT, TOOLS, ROWS, PARAMS, limits)
    keys = (
        "prompt_ids", "response_ids", "response_mask", "log_probs", "turn_bounds", "messages_json", "text", "finish_reason",
        "truncated", "num_turns", "tool_calls", "tool_errors",
    )  # fmt: skip
    assert [{k: getattr(r, k) for k in keys} for r in fn_rows] == [{k: getattr(r, k) for k in keys} for r in loop_rows]
    assert {r.finish_reason for r in fn_rows} == {finish}


async def streaming_calculator_agent(client, sample) -> float | None:
    """calculator_agent through ``stream=True``: the reply assembled from its chunks, as streaming SDKs do."""
    messages, usage = list(sample.messages), []
    while True:
        chunks = await client.chat.completions.create(
            model=sample.model, messages=messages, tools=[CALCULATOR_TOOL], stream=True, stream_options={"include_usage": True}
        )
        content, calls, finish = "", {}, None
        async for chunk in chunks:
            if chunk.usage is not None:
                usage.append(chunk.usage.completion_tokens)
            for choice in chunk.choices:
                content += choice.delta.content or ""
                finish = choice.finish_reason or finish
                for call in choice.delta.tool_calls or []:
                    calls[call.index] = call
        assert finish is not None and len(usage) == sum(m["role"] == "assistant" for m in messages) + 1
        if not calls:
            return None
        messages.append({"role": "assistant", "content": content, "tool_calls": [c.model_dump(exclude_none=True, exclude={"index"}) for c in calls.values()]})
        for call in calls.values():
            messages.append({"role": "tool", "tool_call_id": call.id, "content": run_calculator(call.function.name, call.function.arguments)})


def test_a_streaming_agent_stores_the_trajectories_of_a_plain_one():
    streamed, _ = run_fn(streaming_calculator_agent)
    plain, _ = run_fn(calculator_agent)
    assert all(o.agent_status == "ok" for o in streamed) and any(o.tool_calls for o in streamed)
    keys = ("prompt_ids", "response_ids", "response_mask", "log_probs", "turn_bounds", "messages_json", "finish_reason", "tool_calls")
    assert [{k: getattr(r, k) for k in keys} for r in streamed] == [{k: getattr(r, k) for k in keys} for r in plain]


def test_on_the_hf_engine_the_endpoint_samples_as_the_built_in_loop(tiny_engine):
    # A window long enough for every HTTP request to join its batch: the batches, hence the seeds, are the loop's.
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=24, seed=5)
    fn_rows, fn_stats = run_fn(calculator_agent, tiny_engine, params=params, window_s=5.0)
    loop_rows, loop_stats = run_agent_batch(tiny_engine, FMT, TOOLS, ROWS, params, AgentLimits(), window_s=5.0)
    assert fn_stats["batches"] == loop_stats["batches"]
    for f, b in zip(fn_rows, loop_rows, strict=True):
        assert (f.prompt_ids, f.response_ids, f.response_mask) == (b.prompt_ids, b.response_ids, b.response_mask)
        assert f.log_probs == pytest.approx(b.log_probs, abs=1e-6)


class FirstTurnScripted:
    """A real engine whose first turns are a scripted calculator call: the later turns are the engine's own."""

    def __init__(self, inner) -> None:
        self.inner, self.batch_size, self.tokenizer = inner, inner.batch_size, TOK
        self.later: list[Completion] = []  # what the engine produced

    def generate_ids(self, encoded: list[list[int]], params: SamplingParams) -> list[Completion]:
        scripted = ScriptedEngine()
        first = [j for j, p in enumerate(encoded) if "\nR:" not in TOK.decode(p)]
        later = [j for j in range(len(encoded)) if j not in first]
        out: dict[int, Completion] = {}
        for j, c in zip(first, scripted.generate_ids([encoded[j] for j in first], params), strict=True):
            out[j] = c
        if later:
            got = self.inner.generate_ids([encoded[j] for j in later], params)
            self.later += got
            out.update(zip(later, got, strict=True))
        return [out[j] for j in range(len(encoded))]


@pytest.mark.integration
@pytest.mark.skipif(not __import__("rlstage.engines.rollout.vllm_engine", fromlist=["x"]).vllm_available(), reason="vllm is not installed")
def test_on_the_vllm_engine_the_endpoint_records_vllms_tokens_and_matches_the_built_in_loop(tmp_path):
    from rlstage.engines.models.tinykit import save_model_dir
    from rlstage.engines.rollout.vllm_engine import VLLMRolloutEngine
    from rlstage.engines.training.forward import build_inputs, response_log_probs

    torch.manual_seed(0)
    model = build_tiny_llama(KitConfig(), TOK).eval()  # vLLM's CPU kernels want head_dim >= 32
    vllm = VLLMRolloutEngine(str(save_model_dir(model, TOK, tmp_path / "model")), TOK, seed=0, kv_cache_bytes=256 << 20, max_num_seqs=64)
    try:
        params = SamplingParams(n=2, temperature=1.0, max_new_tokens=40, seed=5)
        engine = FirstTurnScripted(vllm)
        fn_rows, _ = run_fn(calculator_agent, engine, params=params, window_s=5.0)
        loop_rows, _ = run_agent_batch(FirstTurnScripted(vllm), FMT, TOOLS, ROWS, params, AgentLimits(), window_s=5.0)
    finally:
        vllm.close()
    assert [(r.response_ids, r.log_probs) for r in fn_rows] == [(r.response_ids, r.log_probs) for r in loop_rows]
    for r in fn_rows:
        last = r.turn_bounds[-1]
        assert r.num_turns == 2 and last["role"] == "assistant"
        # The second turn is one of the completions vLLM produced for this context (a prompt's two samples share it).
        context = r.prompt_ids + r.response_ids[: last["start"]]
        produced = [(list(c.response_ids), list(c.log_probs)) for c in engine.later if list(c.prompt_ids) == context]
        assert (r.response_ids[last["start"] :], r.log_probs[last["start"] :]) in produced
        # The trainer's recompute on the stored tokens matches vLLM's sampling log-probs.
        with torch.no_grad():
            logp, _ = response_log_probs(model, build_inputs([r.prompt_ids], [r.response_ids], TOK.pad_token_id), 1.0)
        assert r.log_probs[last["start"] :] == pytest.approx(logp[0, last["start"] : last["end"]].tolist(), abs=1e-3)


def test_rollouts_stored_before_agent_reward_read_with_it_null():
    import pyarrow as pa

    from rlstage.schemas import artifacts as A

    old = pa.table({n: pa.nulls(2, A.ROLLOUTS.field(n).type) for n in A.ROLLOUTS.names if n != "agent_reward"})
    assert A.conform(old, A.ROLLOUTS).column("agent_reward").to_pylist() == [None, None]
    with pytest.raises(ValueError, match="missing columns"):
        A.conform(old.drop_columns(["response_ids"]), A.ROLLOUTS)


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


class BrokenEngine(ScriptedEngine):
    def generate_ids(self, encoded, params):
        raise RuntimeError("CUDA out of memory (pretend)")


def test_an_engine_failure_fails_the_batch_as_it_fails_the_built_in_loop():
    with pytest.raises(RuntimeError, match="out of memory"):
        run_fn(calculator_agent, BrokenEngine())
    with pytest.raises(RuntimeError, match="out of memory"):
        run_agent_batch(BrokenEngine(), FMT, TOOLS, ROWS, PARAMS, AgentLimits())


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["agent.function=no_such_module:agent"], "config error: agent.function: cannot import 'no_such_module:agent'"),
        (["agent.function=rlstage.engines.agents.tools:calculator"], "config error: agent.function: 'rlstage.engines.agents.tools:calculator' must be an async function"),
    ],
)
def test_an_agent_function_that_does_not_import_fails_at_preflight_with_one_line(overrides, needle):
    with pytest.raises(ConfigError) as err:
        preflight(load_config(None, ["agent.enable=true", *overrides]))
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_agent_function_needs_agent_mode():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["agent.function=rlstage.engines.agents.examples:calculator_agent"])
    assert "set agent.enable=true" in str(err.value) and "\n" not in str(err.value)


def test_a_stored_config_may_not_name_an_agent_function_to_import():
    from rlstage.schemas.config import stored_config_from

    stored = {"config": {"agent": {"enable": True, "function": "evil_agents:run"}}}
    with pytest.raises(ConfigError, match=r"agent\.function: 'evil_agents:run' comes from the stored config"):
        stored_config_from(stored, "run.json")
    assert stored_config_from(stored, "run.json", ["agent.function=evil_agents:run"]).agent.function == "evil_agents:run"
    example = {"config": {"agent": {"enable": True, "function": "rlstage.engines.agents.examples:calculator_agent"}}}
    assert stored_config_from(example, "run.json").agent.function.endswith(":calculator_agent")


def test_a_run_recorded_before_agent_function_existed_continues_with_its_keys(tmp_path):
    from rlstage.flows.checks import check_run_config, record_run_config
    from rlstage.infra.store import ArtifactStore

    store = ArtifactStore(str(tmp_path))
    cfg = load_config(None, ["run_name=nightly", "agent.enable=true"])
    assert not {"function", "function_timeout_s"} & set(cfg.hashed_dump()["agent"])  # late settings at their default
    record_run_config(store, cfg)
    stored = store.get_json("nightly", "run.json")
    for doc in (stored["config"], stored["identity"]):  # as the version before them wrote it
        doc["agent"].pop("function", None)
        doc["agent"].pop("function_timeout_s", None)
    store.put_json("nightly", "run.json", stored)
    assert check_run_config(store, cfg) is True
    with pytest.raises(ConfigError, match=r"exists with another config \(agent.function: stored None"):
        check_run_config(store, load_config(None, ["run_name=nightly", "agent.enable=true", "agent.function=rlstage.engines.agents.examples:calculator_agent"]))
