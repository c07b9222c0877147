"""The agent loop (issue 6): state machine, exact masks, tool failures, limits, concurrency, config errors."""

from __future__ import annotations

import asyncio
import json
import re
import time

import pytest
import torch

from agents_support import EOS, FMT, TOK, call, ids
from rlstage.engines import algorithms as algos
from rlstage.engines.agents.loop import (
    AgentLimits,
    AgentRequest,
    agent_metrics,
    run_agent_batch,
    run_requests,
)
from rlstage.engines.agents.policies import AgentPolicy, BatchingPolicy, Generation
from rlstage.engines.agents.tools import (
    CALCULATOR_PARAMETERS,
    CalculatorError,
    ToolSpec,
    calculate,
    calculator,
    parse_tool_calls,
    sample_tools,
)
from rlstage.engines.preflight import preflight
from rlstage.engines.rollout.hf import SamplingParams
from rlstage.schemas.config import ConfigError, build_config, load_config

CALC = ToolSpec("calculator", "arithmetic", CALCULATOR_PARAMETERS, calculator, 1.0)



class ScriptedPolicy(AgentPolicy):
    """A policy whose turns are text from ``script(context_text, key)``; token k gets log-prob -(k+1)/100."""

    def __init__(self, script, stop: bool = True) -> None:
        self.script, self.stop, self.seen = script, stop, []

    async def generate(self, prompt_ids: list[int], params: SamplingParams, key: int = 0) -> Generation:
        context = TOK.decode(prompt_ids)  # special tokens kept: the policy reads exactly its input
        self.seen.append(context)
        ids = FMT.encode(self.script(context, key)) + ([EOS] if self.stop else [])
        finish = "stop" if self.stop else "length"
        if len(ids) > params.max_new_tokens:
            ids, finish = ids[: params.max_new_tokens], "length"
        await asyncio.sleep(0)
        return Generation(ids, [-(k + 1) / 100 for k in range(len(ids))], finish)


def calculator_script(context: str, key: int = 0) -> str:
    """Emit a call for the question's product, then answer with what the tool returned."""
    results = re.findall(r"\nR:([^\n]*)\n", context)
    if not results:
        a, b = re.search(r"What is (\d+)\*(\d+)\?", context).groups()
        return call("calculator", expression=f"{a}*{b}")
    return results[-1]


def request(script_or_policy, tools=(CALC,), limits=AgentLimits(), question="What is 12*34?", extra_info=None, key=0):
    policy = script_or_policy if isinstance(script_or_policy, AgentPolicy) else ScriptedPolicy(script_or_policy)
    offered = sample_tools({t.name: t for t in tools}, extra_info)
    return AgentRequest(
        0, 0, [{"role": "user", "content": question}], offered, FMT, policy, SamplingParams(max_new_tokens=200), limits, key=key
    )


def run(req: AgentRequest):
    return asyncio.run(req.run())



# ---------------------------------------------------------------- state machine and masks


def test_scripted_policy_calls_reads_the_result_and_answers():
    req = request(calculator_script)
    t = run(req)
    assert t.states == ["pending", "generating", "tool_calling", "generating", "completed"]
    assert t.text == "408" and t.finish_reason == "stop" and not t.truncated
    assert (t.num_turns, t.tool_calls, t.tool_errors, t.tool_timeouts) == (2, 1, 0, 0)
    assert [m["role"] for m in t.messages] == ["user", "assistant", "tool", "assistant"]
    assert t.messages[2] == {"role": "tool", "name": "calculator", "content": "408"}
    assert req.policy.seen[1].endswith("<eos>\nR:408\nA:")  # the second turn saw the tool's answer


def test_masks_logprobs_and_turn_bounds_exact_on_a_hand_built_trajectory():
    t = run(request(calculator_script))
    c = call("calculator", expression="12*34")
    assert t.prompt_ids == ids("U:What is 12*34?\nA:")
    expected = ids(c) + [EOS] + ids("\nR:408\nA:") + ids("408") + [EOS]
    assert t.response_ids == expected
    n1, n_env, n2 = len(c) + 1, len("\nR:408\nA:"), len("408") + 1
    assert t.response_mask == [1] * n1 + [0] * n_env + [1] * n2
    lp1 = [-(k + 1) / 100 for k in range(n1)]
    lp2 = [-(k + 1) / 100 for k in range(n2)]
    assert t.log_probs == pytest.approx(lp1 + [0.0] * n_env + lp2)
    assert t.turn_bounds == [
        {"role": "assistant", "start": 0, "end": n1},
        {"role": "tool", "start": n1, "end": n1 + n_env},
        {"role": "assistant", "start": n1 + n_env, "end": n1 + n_env + n2},
    ]
    # The token trajectory is the chat template of the message list (less the closing after the last eos).
    assert TOK.decode(t.prompt_ids + t.response_ids) + "\n" == FMT.render(t.messages, generation_prompt=False)


def test_a_turn_cut_by_length_gets_the_template_eos_as_a_masked_token():
    policy = ScriptedPolicy(calculator_script, stop=False)
    t = run(request(policy))
    c = call("calculator", expression="12*34")
    # No eos was sampled, so the template's eos closes the turn — as an environment token (mask 0).
    assert t.response_ids[: len(c) + 1] == ids(c) + [EOS]
    assert t.response_mask[: len(c) + 1] == [1] * len(c) + [0]


def test_illegal_transition_is_refused():
    req = request(calculator_script)
    with pytest.raises(RuntimeError, match="illegal transition pending -> completed"):
        req._finish("stop")


# ---------------------------------------------------------------- tool failures become tool messages


def then_answer(first: str):
    """A policy that emits ``first`` and answers "done" once it has seen a tool message."""
    return lambda ctx, key=0: first if "\nR:" not in ctx else "done"


def boom(expression: str) -> str:
    raise ValueError("kaput")


async def sleepy_async(expression: str) -> str:
    await asyncio.sleep(30)
    return "late"


def sleepy_sync(expression: str) -> str:
    time.sleep(1.0)
    return "late"


@pytest.mark.parametrize(
    ("first", "tools", "status", "needle"),
    [
        ('<tool_call>{"name": "calculator", "arguments": {</tool_call>', (CALC,), "malformed", "malformed tool call: invalid JSON"),
        ("<tool_call>" + '{"name": "calculator"', (CALC,), "malformed", "without </tool_call>"),
        ('<tool_call>["calculator"]</tool_call>', (CALC,), "malformed", "expected {"),
        (call("weather", city="Oslo"), (CALC,), "unknown_tool", "unknown tool 'weather' (available: calculator)"),
        (call("calculator", expr="1+1"), (CALC,), "invalid_arguments", "invalid arguments for calculator"),
        (call("calculator", expression="1/0"), (CALC,), "raised", "CalculatorError: division by zero"),
        (call("boom", expression="1"), (ToolSpec("boom", "", CALCULATOR_PARAMETERS, boom, 1.0),), "raised", "raised ValueError: kaput"),
        (call("slow", expression="1"), (ToolSpec("slow", "", CALCULATOR_PARAMETERS, sleepy_async, 0.05),), "timeout", "timed out after 0.05s"),
        (call("slow", expression="1"), (ToolSpec("slow", "", CALCULATOR_PARAMETERS, sleepy_sync, 0.05),), "timeout", "timed out after 0.05s"),
    ],
)
def test_bad_calls_become_tool_messages_and_are_counted(first, tools, status, needle):
    t = run(request(then_answer(first), tools=tools))
    assert t.finish_reason == "stop" and t.text == "done"  # the request carried on to an answer
    assert t.messages[2]["role"] == "tool" and t.messages[2]["content"].startswith("error: ")
    assert needle in t.messages[2]["content"]
    assert t.tool_calls == 1 and t.tool_errors == 1 and t.tool_status == {status: 1}
    assert t.tool_timeouts == (status == "timeout")


def test_a_tool_raising_timeout_error_itself_is_not_a_timeout():
    def raises_timeout(expression: str) -> str:
        raise TimeoutError("upstream")

    t = run(request(then_answer(call("t", expression="1")), tools=(ToolSpec("t", "", CALCULATOR_PARAMETERS, raises_timeout, 1.0),)))
    assert t.tool_status == {"raised": 1} and t.tool_timeouts == 0


async def strict_async(expression: str) -> str:
    return expression


def test_arguments_the_callable_does_not_take_are_a_raised_error_not_a_crash():
    loose = {"type": "object"}  # the schema lets anything through; the function does not
    for fn in (strict_async, calculator):
        tool = ToolSpec("t", "", loose, fn, 1.0)
        t = run(request(then_answer(call("t", expression="1", extra=2)), tools=(tool,)))
        assert t.tool_status == {"raised": 1} and "TypeError" in t.messages[2]["content"]


def test_max_turns():
    t = run(request(lambda ctx, key=0: call("calculator", expression="1+1"), limits=AgentLimits(max_turns=3)))
    assert t.finish_reason == "max_turns" and t.num_turns == 3 and t.tool_calls == 2
    assert [b["role"] for b in t.turn_bounds] == ["assistant", "tool", "assistant", "tool", "assistant"]


def test_max_tool_calls_answers_the_excess_with_an_error_then_stops():
    two = call("calculator", expression="1+1") * 2
    t = run(request(lambda ctx, key=0: two, limits=AgentLimits(max_turns=5, max_tool_calls=3, max_response_tokens=2000)))
    assert t.finish_reason == "max_tool_calls" and t.num_turns == 3
    assert t.tool_calls == 4 and t.tool_status == {"ok": 3, "limit": 1}
    assert "tool call limit (3 per request) reached" in t.messages[-2]["content"]


def test_trajectory_over_the_token_limit_is_truncated_at_a_turn_boundary():
    def chatty(expression: str) -> str:
        return "x" * 80

    tool = ToolSpec("chatty", "", CALCULATOR_PARAMETERS, chatty, 1.0)
    first = call("chatty", expression="1")
    t = run(request(then_answer(first), tools=(tool,), limits=AgentLimits(max_response_tokens=len(first) + 40)))
    assert t.truncated and t.finish_reason == "length"
    # It ends exactly after the assistant's turn: the tool message that would not fit is not there.
    assert t.response_ids == ids(first) + [EOS]
    assert t.turn_bounds == [{"role": "assistant", "start": 0, "end": len(first) + 1}]
    assert [m["role"] for m in t.messages] == ["user", "assistant"]


def test_generation_is_capped_by_the_remaining_token_budget():
    t = run(request(lambda ctx, key=0: "y" * 100, limits=AgentLimits(max_response_tokens=30)))
    assert len(t.response_ids) == 30 and t.truncated and t.finish_reason == "length"
    assert t.response_mask == [1] * 30


# ---------------------------------------------------------------- per-sample tools


def checker(answer: str, ground_truth: str) -> str:
    return "correct" if answer == ground_truth else "wrong"


CHECK = ToolSpec(
    "check",
    "compare with the truth",
    {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
    checker,
    1.0,
)


def test_verl_tools_kwargs_are_hidden_arguments_that_override_the_model():
    extra = {"tools_kwargs": {"check": {"create_kwargs": {"ground_truth": "42"}}}}
    t = run(request(then_answer(call("check", answer="42", ground_truth="0")), tools=(CHECK, CALC), extra_info=extra))
    assert t.messages[2]["content"] == "correct"
    flat = json.dumps({"tools_kwargs": {"check": {"ground_truth": "7"}}})  # flat form, extra_info as a JSON string
    t = run(request(then_answer(call("check", answer="42")), tools=(CHECK,), extra_info=flat))
    assert t.messages[2]["content"] == "wrong"


def test_openai_tools_column_decides_what_is_offered_and_wins_over_tools_kwargs():
    extra = {
        "tools": [{"type": "function", "function": {"name": "calculator", "parameters": CALCULATOR_PARAMETERS}}, {"type": "function", "function": {"name": "nope"}}],
        "tools_kwargs": {"check": {"ground_truth": "42"}},
    }
    offered = sample_tools({"check": CHECK, "calculator": CALC}, extra)
    assert list(offered.tools) == ["calculator"] and offered.kwargs == {} and offered.ignored == ["nope"]
    t = run(request(then_answer(call("check", answer="42")), tools=(CHECK, CALC), extra_info=extra))
    assert t.tool_status == {"unknown_tool": 1}


# ---------------------------------------------------------------- concurrency


async def slow_async(expression: str) -> str:
    await asyncio.sleep(0.3)
    return "slow"


def slow_sync(expression: str) -> str:
    time.sleep(0.3)
    return "slow"


@pytest.mark.parametrize("slow_fn", [slow_async, slow_sync])
def test_a_slow_request_does_not_delay_the_others(slow_fn):
    tools = {"slow": ToolSpec("slow", "", CALCULATOR_PARAMETERS, slow_fn, 5.0), "calculator": CALC}
    policy = ScriptedPolicy(lambda ctx, key: (call("slow", expression="1") if key == 0 else call("calculator", expression="1+1")) if "\nR:" not in ctx else "ok")
    reqs = [
        AgentRequest(i, 0, [{"role": "user", "content": f"q{i}"}], sample_tools(tools, None), FMT, policy, SamplingParams(max_new_tokens=100), AgentLimits(), key=i)
        for i in range(4)
    ]  # fmt: skip
    trajs = asyncio.run(run_requests(reqs))
    assert [t.prompt_index for t in trajs] == [0, 1, 2, 3]  # results come back in input order
    assert all(t.text == "ok" for t in trajs)
    # Request 0 started first but finished last: the others went through their tool calls meanwhile.
    assert trajs[0].done_seq == 3
    assert sorted(t.done_seq for t in trajs[1:]) == [0, 1, 2]
    # Tool time is the tool's own run time (the sleep), kept apart from the time waiting on the model.
    assert trajs[0].tool_run_s >= 0.3 > max(t.tool_run_s for t in trajs[1:])


# ---------------------------------------------------------------- the HF engine behind the loop


def test_hf_batching_policy_matches_the_engine_and_batches_concurrent_requests(tiny_engine):
    rows = [{"prompt": f"What is {a}*{a + 1}?", "messages": None, "extra_info": "{}"} for a in range(6)]
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=12)
    out, stats = run_agent_batch(tiny_engine, FMT, {"calculator": CALC}, rows, params, AgentLimits())
    direct = tiny_engine.generate_ids([FMT.prompt_ids([{"role": "user", "content": r["prompt"]}]) for r in rows], params)
    assert [o.response_ids[: o.turn_bounds[0]["end"]] for o in out] == [c.response_ids for c in direct]
    for o, c in zip(out, direct, strict=True):
        assert o.log_probs[: len(c.log_probs)] == pytest.approx(c.log_probs, abs=1e-5)
    assert stats["batches"] >= 1 and stats["model_s"] > 0
    m = agent_metrics(out, stats)
    for name in ("num_turns/mean", "tool_calls/mean", "tool_calls/errors", "tool_calls/timeouts", "response_length/mean", "timing_s/gen_model", "timing_s/gen_tools"):
        assert name in m


def test_hf_batching_policy_serves_requests_that_arrive_while_a_batch_runs(tiny_engine):
    policy = BatchingPolicy(tiny_engine, max_batch=4, window_s=0.01)
    prompt = FMT.prompt_ids([{"role": "user", "content": "hi"}])

    async def main():
        first = [policy.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=3), key=k) for k in range(6)]
        res = await asyncio.gather(*first)
        late = await policy.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=2), key=9)
        await policy.aclose()
        return res, late

    res, late = asyncio.run(main())
    assert policy.batch_sizes[:2] == [4, 2]  # max_batch respected, the rest served next
    assert all(len(r.token_ids) <= 3 for r in res) and len(late.token_ids) <= 2
    assert late.token_ids == res[0].token_ids[: len(late.token_ids)]  # greedy: the same continuation


# ---------------------------------------------------------------- the masks through every estimator


@pytest.mark.parametrize("estimator", sorted(algos.ADV_ESTIMATORS))
def test_every_estimator_and_the_loss_ignore_tool_tokens(estimator):
    trajs = [run(request(calculator_script, question=q)) for q in ("What is 12*34?", "What is 5*6?", "What is 7*8?", "What is 9*9?")]
    width = max(len(t.response_ids) for t in trajs)
    mask = torch.zeros(len(trajs), width)
    for i, t in enumerate(trajs):
        mask[i, : len(t.response_mask)] = torch.tensor(t.response_mask, dtype=torch.float32)
    rewards = torch.zeros_like(mask)
    for i, t in enumerate(trajs):
        rewards[i, max(j for j, v in enumerate(t.response_mask) if v)] = float(i % 2)  # on the last policy token
    values = torch.randn(len(trajs), width)
    kw = {"index": [0, 0, 1, 1], "values": values, "reward_baselines": torch.tensor([0.5, 0.5, 0.2, 0.2])}
    kw.update(old_log_probs=torch.full_like(mask, -1.0), sum_pi_squared=torch.full_like(mask, 0.3))  # OTB
    adv, _ = algos.compute_advantage(estimator, token_level_rewards=rewards, response_mask=mask, gamma=0.9, lam=0.8, **kw)
    gap = (mask == 0) & (torch.arange(width) < torch.tensor([len(t.response_ids) for t in trajs])[:, None])
    assert gap.any()
    if estimator == "gae":  # values inside the gaps never reach a policy token's advantage
        noisy = values.clone()
        noisy[gap] += 100.0
        kw["values"] = noisy
        adv2, _ = algos.compute_advantage(estimator, token_level_rewards=rewards, response_mask=mask, gamma=0.9, lam=0.8, **kw)
        assert torch.allclose(adv2[mask.bool()], adv[mask.bool()], atol=1e-5)
    log_prob = torch.zeros_like(mask, requires_grad=True)
    loss, _ = algos.get_policy_loss("vanilla")(torch.zeros_like(mask), log_prob, adv, mask, "token-mean")
    loss.backward()
    assert torch.all(log_prob.grad[mask == 0] == 0)  # tool and template tokens get no gradient
    assert torch.isfinite(log_prob.grad).all()


# ---------------------------------------------------------------- the calculator


@pytest.mark.parametrize(
    ("expr", "value"),
    [("123*456", 56088), ("2+3*4", 14), ("(2+3)*4", 20), ("-3**2", -9), ("7/2", 3.5), ("7//2", 3), ("2**-1", 0.5), ("10 % 4", 2), (" 1.5e3 ", 1500.0)],
)
def test_calculator_arithmetic(expr, value):
    assert calculate(expr) == value


def test_calculator_formats_results():
    assert calculator("6/2") == "3" and calculator("1/3") == "0.333333333333" and calculator("123*456") == "56088"


@pytest.mark.parametrize(
    "expr",
    ["__import__('os').system('true')", "x+1", "(1).__class__", "[1,2]", "1 if 1 else 2", "2**100000", "9**9**9", "1 < 2", "'a'*3", "True+1", "1/0", "10**99*10**99", "(" * 300 + "1" + ")" * 300, "2 ^ 3"],
)
def test_calculator_refuses_everything_but_bounded_arithmetic(expr):
    with pytest.raises(CalculatorError):
        calculate(expr)


def test_parse_tool_calls():
    text = 'I will compute <tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call> and <tool_call>{"name": "x"}</tool_call>'
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [("calculator", {"expression": "1+1"}, None), ("x", {}, None)]
    assert parse_tool_calls("no calls here") == []


# ---------------------------------------------------------------- bad config fails at load


def _agent(*extra: str):
    cfg = load_config(None, ["agent.enable=true", *extra])
    preflight(cfg)  # tools and templates are checked before any stage, not by the config model
    return cfg


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["agent.tools=[{name: c, callable: 'no_such_module:fn'}]"], "config error: agent.tools.0.callable: cannot import 'no_such_module:fn'"),
        (["agent.tools=[{name: c, callable: 'rlstage.engines.agents.tools:nope'}]"], "has no attribute 'nope'"),
        (["agent.tools=[{name: c, callable: 'rlstage.engines.agents.tools:CALL_OPEN'}]"], "is not callable"),
        (["agent.tools=[{name: c, callable: 'rlstage.engines.agents.tools:calculator', parameters: {type: objekt}}]"], "config error: agent.tools.0.parameters: not a valid JSON schema"),
        (["agent.tools=[{name: c, callable: 'rlstage.engines.agents.tools:calculator', parameters: {type: string}}]"], "must have type 'object'"),
        (["agent.chat_template=/no/such/template.jinja"], "neither a Jinja template nor an existing file"),
    ],
)
def test_bad_agent_config_fails_at_load_with_one_line(overrides, needle):
    with pytest.raises(ConfigError) as err:
        _agent(*overrides)
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("template", "needle"),
    [
        ("{% for m in messages %}{% if m['role'] != 'tool' %}{{ m['content'] }}{% endif %}{% endfor %}", "(a tool message is not rendered)"),
        ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}{{ m['content'] }}{% endfor %}", "(a tool message fails: no tools)"),
    ],
)
def test_chat_template_without_a_tool_role_fails_at_load(template, needle):
    with pytest.raises(ConfigError) as err:
        preflight(build_config({"agent": {"enable": True, "chat_template": template}}))
    msg = str(err.value)
    assert "agent.chat_template: the chat template has no tool role" in msg and needle in msg and "\n" not in msg


def test_good_agent_config_loads_with_the_demo_file():
    cfg = load_config("configs/agent_calc.yaml")
    assert cfg.agent.enable and cfg.agent.tools[0].callable == "rlstage.engines.agents.tools:calculator"
    assert cfg.kit.task == "multiply"


# ---------------------------------------------------------------- the multiply task and its demonstrations


def test_multiply_splits_are_disjoint_three_digit_products():
    from rlstage.engines.data.datasets import MULTIPLY_SOURCE, make_task_splits
    from rlstage.engines.rewards.rules import default_reward_fn

    train, test = make_task_splits("multiply", 3, 300, 50, seed=7)
    rows = train.to_pylist() + test.to_pylist()
    pairs = [(json.loads(r["extra_info"])["a"], json.loads(r["extra_info"])["b"]) for r in rows]
    assert len(set(pairs)) == 350 and all(100 <= a <= 999 and 100 <= b <= 999 for a, b in pairs)
    assert all(r["ground_truth"] == str(a * b) and r["messages"][0]["content"] == f"What is {a}*{b}?" for r, (a, b) in zip(rows, pairs, strict=True))
    assert rows[0]["data_source"] == MULTIPLY_SOURCE and default_reward_fn(MULTIPLY_SOURCE) == "exact_match"


def test_tool_demonstrations_are_masked_like_rollouts():
    from rlstage.engines.data.datasets import make_task_splits
    from rlstage.tasks.kit import tool_demonstrations

    cfg = load_config("configs/agent_calc.yaml")
    train, _ = make_task_splits("multiply", 3, 3, 1, seed=1)
    rows = train.to_pylist()
    for (seq, mask), row in zip(tool_demonstrations(cfg, TOK, rows), rows, strict=True):
        info = json.loads(row["extra_info"])
        c = call("calculator", expression=f"{info['a']}*{info['b']}")
        prompt, answer = f"U:What is {info['a']}*{info['b']}?\nA:", row["ground_truth"]
        env = f"\nR:{answer}\nA:"
        assert seq == ids(prompt) + ids(c) + [EOS] + ids(env) + ids(answer) + [EOS]
        assert mask == [0] * len(prompt) + [1] * (len(c) + 1) + [0] * len(env) + [1] * (len(answer) + 1)
