"""agent.function (issue 40): the OpenAI-compatible endpoint, token-exact trajectories, failures, bad requests."""

from __future__ import annotations

import json

import pytest

from agents_support import FMT, PARAMS, ROWS, TOOLS, ScriptedEngine, ids, run_fn
from rlstage.engines.agents.examples import CALCULATOR_TOOL, calculator_agent, run_calculator
from rlstage.engines.agents.loop import AgentLimits, run_agent_batch
from rlstage.engines.preflight import preflight
from rlstage.engines.rollout.hf import SamplingParams
from rlstage.schemas.config import ConfigError, load_config

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


def test_rollouts_stored_before_agent_reward_read_with_it_null():
    import pyarrow as pa

    from rlstage.schemas import artifacts as A

    old = pa.table({n: pa.nulls(2, A.ROLLOUTS.field(n).type) for n in A.ROLLOUTS.names if n != "agent_reward"})
    assert A.conform(old, A.ROLLOUTS).column("agent_reward").to_pylist() == [None, None]
    with pytest.raises(ValueError, match="missing columns"):
        A.conform(old.drop_columns(["response_ids"]), A.ROLLOUTS)


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
