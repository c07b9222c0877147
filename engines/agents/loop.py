"""Multi-turn tool-calling rollouts: one asyncio task per request, an explicit state machine each.

A request goes ``PENDING -> GENERATING -> (TOOL_CALLING -> GENERATING)* -> COMPLETED``. In
GENERATING it asks the policy (``AgentPolicy``) to continue the trajectory's token ids; when the
turn holds tool calls (format: ``engines/agents/tools.py``) it moves to TOOL_CALLING, runs them
concurrently, appends the tool messages through the chat template and generates again. Many
requests run at once against one policy, so a request waiting on a slow tool never holds up the
others.

The trajectory is assembled in tokens, never re-tokenized: the prompt is the rendered first
messages; the response is every later token, with ``response_mask`` 1 exactly on the tokens the
policy sampled (their sampling log-probs alongside) and 0 on tool output and template tokens.
``turn_bounds`` lists the ``[start, end)`` spans of assistant and tool turns in the response.

The policies that generate the turns (``BatchingPolicy`` over a rollout engine, ``AsyncVLLMPolicy``) are in
engines/agents/policies.py.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import json
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from rlstage.engines.agents.policies import AgentPolicy, BatchingPolicy, Generation
from rlstage.engines.agents.tools import (
    LIMIT,
    OK,
    TIMEOUT,
    SampleTools,
    ToolConfigError,
    ToolOutcome,
    ToolSpec,
    agent_tokenizer,
    execute_tool_call,
    parse_tool_calls,
    resolve_template,
    sample_tools,
)
from rlstage.engines.rollout.base import Completion, RolloutEngine, SamplingParams


class AgentState(enum.Enum):
    PENDING = "pending"
    GENERATING = "generating"
    TOOL_CALLING = "tool_calling"
    COMPLETED = "completed"


TRANSITIONS: dict[AgentState, frozenset[AgentState]] = {
    AgentState.PENDING: frozenset({AgentState.GENERATING}),
    AgentState.GENERATING: frozenset({AgentState.TOOL_CALLING, AgentState.COMPLETED}),
    AgentState.TOOL_CALLING: frozenset({AgentState.GENERATING, AgentState.COMPLETED}),
    AgentState.COMPLETED: frozenset(),
}

# Why a request ended: the model answered ("stop"), ran out of tokens ("length"), or a limit.
FINISH_REASONS = ("stop", "length", "max_turns", "max_tool_calls")


@dataclass(frozen=True)
class AgentLimits:
    max_turns: int = 4  # assistant turns per request
    max_tool_calls: int = 4  # tool calls executed per request
    max_response_tokens: int = 256  # everything after the prompt: policy, tool and template tokens
    max_tool_output_chars: int = 2048
    max_prompt_tokens: int | None = None  # an agent function's first request longer than this is refused (data.max_prompt_length)


# ---------------------------------------------------------------- chat format

_SENT = "@@rlstage-sentinel@@"


class ChatFormat:
    """The chat template seen in tokens: the prompt, and what the environment appends after a turn.

    After an assistant turn the template's closing of that message (less the eos the model
    sampled), the tool messages and the next generation prompt are rendered as one text delta
    against a reference conversation and tokenized on their own; the policy's tokens stay as sampled.
    """

    def __init__(self, tokenizer: Any, chat_template: str | None = None) -> None:
        self.tok = tokenizer
        self.template = chat_template or getattr(tokenizer, "chat_template", None)
        if not self.template:
            raise ToolConfigError("the tokenizer has no chat template (set agent.chat_template)")
        self.eos_text = tokenizer.eos_token or ""
        self._base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENT}]
        try:
            self._base_text = self.render(self._base, generation_prompt=False)
        except Exception as err:
            raise ToolConfigError(f"the chat template cannot render a user and an assistant message: {err}") from None
        at = self._base_text.rfind(_SENT)
        if at < 0:
            raise ToolConfigError("the chat template drops assistant messages")
        self._closing = self._base_text[at + len(_SENT) :]
        probe = "@@rlstage-tool-output@@"
        try:
            delta = self._delta([{"role": "tool", "name": "probe", "content": probe}])
        except Exception as err:
            raise ToolConfigError(f"the chat template has no tool role (a tool message fails: {err})") from None
        if probe not in delta:
            raise ToolConfigError("the chat template has no tool role (a tool message is not rendered)")

    def render(self, messages: list[dict], generation_prompt: bool, tools: list[dict] | None = None) -> str:
        return self.tok.apply_chat_template(
            messages, tools=tools or None, chat_template=self.template, add_generation_prompt=generation_prompt, tokenize=False
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        return self.encode(self.render(messages, generation_prompt=True, tools=tools))

    def _delta(self, tool_messages: list[dict]) -> str:
        full = self.render(self._base + tool_messages, generation_prompt=True)
        if not full.startswith(self._base_text):
            raise ToolConfigError("the chat template re-renders earlier messages when a tool message follows")
        return full[len(self._base_text) :]

    def env_ids(self, tool_messages: list[dict], stopped: bool) -> list[int]:
        """Tokens after an assistant turn: its closing (less a sampled eos), the tool messages, the next prompt."""
        closing = self._closing
        if stopped and self.eos_text and closing.startswith(self.eos_text):
            closing = closing[len(self.eos_text) :]
        return self.encode(closing + self._delta(tool_messages))


# ---------------------------------------------------------------- the trajectory


@dataclass
class AgentCompletion(Completion):
    """A multi-turn rollout as the rollout stage stores it: ``Completion``'s fields (``text`` is the last assistant
    message, ``log_probs`` 0.0 on the tokens the policy did not sample) and the turns' own."""

    response_mask: list[int]  # 1 on the tokens the policy sampled, 0 on tool output and template tokens
    messages_json: str  # the whole conversation, as JSON
    turn_bounds: list[dict]
    turn_seconds: list[float]
    truncated: bool
    num_turns: int
    tool_calls: int
    tool_errors: int
    tool_timeouts: int
    tool_status: dict[str, int]
    agent_reward: float | None = None  # an agent function's own reward (None: the reward rule scores the answer)
    agent_status: str | None = None  # how an agent function's run ended ("ok" or its failure); None in the built-in loop


@dataclass
class Trajectory:
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    messages: list[dict]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    turn_bounds: list[dict] = field(default_factory=list)  # {"role", "start", "end"} over response_ids
    turn_seconds: list[float] = field(default_factory=list)  # wall seconds of each turn of turn_bounds
    text: str = ""  # the last assistant message: the answer a reward function scores
    finish_reason: str = ""
    truncated: bool = False  # stopped by max_response_tokens (always at a turn boundary or the sampler's cut)
    num_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0  # every call whose outcome is not "ok" (timeouts included)
    tool_timeouts: int = 0
    tool_status: dict[str, int] = field(default_factory=dict)
    model_s: float = 0.0  # time this request waited on the policy (queueing for a batch included)
    tool_s: float = 0.0  # time this request spent in TOOL_CALLING (wall; a turn's calls run concurrently)
    tool_run_s: float = 0.0  # the tools' own run time, summed over this request's calls
    states: list[str] = field(default_factory=list)
    done_seq: int = -1  # completion order within the batch

    def append(self, ids: Sequence[int], policy: bool, log_probs: Sequence[float] | None, role: str, seconds: float) -> None:
        """A turn: the policy's (its sampling log-probs) or the environment's (tools, user), and how long it took."""
        if log_probs is not None and len(log_probs) != len(ids):
            raise ValueError(f"the policy returned {len(ids)} tokens but {len(log_probs)} log-probs")
        start = len(self.response_ids)
        self.response_ids.extend(ids)
        self.response_mask.extend([1 if policy else 0] * len(ids))
        self.log_probs.extend(list(log_probs) if log_probs is not None else [0.0] * len(ids))
        self.turn_bounds.append({"role": role, "start": start, "end": len(self.response_ids)})
        self.turn_seconds.append(seconds)

    def completion(self, agent_reward: float | None = None, agent_status: str | None = None) -> AgentCompletion:
        """The record the rollout stage stores (with an agent function's reward and status, when one ran)."""
        return AgentCompletion(
            prompt_index=self.prompt_index,
            sample_index=self.sample_index,
            prompt_ids=list(self.prompt_ids),
            response_ids=list(self.response_ids),
            log_probs=list(self.log_probs),
            text=self.text,
            finish_reason=self.finish_reason,
            response_mask=list(self.response_mask),
            messages_json=json.dumps(self.messages, ensure_ascii=False),
            turn_bounds=[dict(b) for b in self.turn_bounds],
            turn_seconds=list(self.turn_seconds),
            truncated=self.truncated,
            num_turns=self.num_turns,
            tool_calls=self.tool_calls,
            tool_errors=self.tool_errors,
            tool_timeouts=self.tool_timeouts,
            tool_status=dict(self.tool_status),
            agent_reward=agent_reward,
            agent_status=agent_status,
        )


# ---------------------------------------------------------------- one request


class AgentRequest:
    """One request's state machine; ``run`` drives it to COMPLETED and returns its trajectory."""

    def __init__(
        self,
        prompt_index: int,
        sample_index: int,
        messages: list[dict],
        tools: SampleTools,
        fmt: ChatFormat,
        policy: AgentPolicy,
        params: SamplingParams,
        limits: AgentLimits,
        *,
        tool_executor: ThreadPoolExecutor | None = None,
        tools_in_prompt: bool = True,
        key: int = 0,
    ) -> None:
        self.tools, self.fmt, self.policy, self.params, self.limits = tools, fmt, policy, params, limits
        self.tool_executor, self.key = tool_executor, key
        prompt = fmt.prompt_ids(messages, tools.schemas() if tools_in_prompt else None)
        self.traj = Trajectory(prompt_index, sample_index, prompt, [dict(m) for m in messages])
        self.state = AgentState.PENDING
        self.traj.states.append(self.state.value)

    def _to(self, new: AgentState) -> None:
        if new not in TRANSITIONS[self.state]:
            raise RuntimeError(f"agent request: illegal transition {self.state.value} -> {new.value}")
        self.state = new
        self.traj.states.append(new.value)

    def _finish(self, reason: str, truncated: bool = False) -> Trajectory:
        t = self.traj
        t.finish_reason, t.truncated = reason, truncated
        t.text = next((m["content"] for m in reversed(t.messages) if m["role"] == "assistant"), "")
        self._to(AgentState.COMPLETED)
        return t

    async def run(self) -> Trajectory:
        t, lim = self.traj, self.limits
        self._to(AgentState.GENERATING)
        while True:
            budget = lim.max_response_tokens - len(t.response_ids)
            params = replace(self.params, n=1, max_new_tokens=max(1, min(self.params.max_new_tokens, budget)))
            t0 = time.perf_counter()
            gen = await self.policy.generate(t.prompt_ids + t.response_ids, params, self.key)
            took = time.perf_counter() - t0
            t.model_s += took
            ids = list(gen.token_ids)[: params.max_new_tokens]
            t.append(ids, True, list(gen.log_probs)[: len(ids)], "assistant", took)
            t.num_turns += 1
            text = self.fmt.decode(ids)
            t.messages.append({"role": "assistant", "content": text})
            calls = parse_tool_calls(text)
            out_of_tokens = len(t.response_ids) >= lim.max_response_tokens
            if not calls:
                return self._finish(gen.finish_reason, truncated=out_of_tokens and gen.finish_reason == "length")
            if out_of_tokens:
                return self._finish("length", truncated=True)
            if t.num_turns >= lim.max_turns:
                return self._finish("max_turns")
            room = lim.max_tool_calls - t.tool_calls
            if room <= 0:
                return self._finish("max_tool_calls")
            self._to(AgentState.TOOL_CALLING)
            t0 = time.perf_counter()
            outcomes = list(
                await asyncio.gather(
                    *(execute_tool_call(c, self.tools, self.tool_executor, lim.max_tool_output_chars) for c in calls[:room])
                )
            )
            tools_took = time.perf_counter() - t0
            t.tool_s += tools_took
            outcomes += [
                ToolOutcome(f"error: tool call limit ({lim.max_tool_calls} per request) reached; not run", LIMIT, name=c.name)
                for c in calls[room:]
            ]
            for o in outcomes:
                t.tool_calls += 1
                t.tool_run_s += o.seconds
                t.tool_status[o.status] = t.tool_status.get(o.status, 0) + 1
                t.tool_errors += o.status != OK
                t.tool_timeouts += o.status == TIMEOUT
            tool_messages = [{"role": "tool", "name": o.name or "", "content": o.content} for o in outcomes]
            env = self.fmt.env_ids(tool_messages, stopped=gen.finish_reason == "stop")
            # The tool turn must fit with room for at least one policy token; else end at this boundary.
            if len(t.response_ids) + len(env) >= lim.max_response_tokens:
                return self._finish("length", truncated=True)
            t.messages.extend(tool_messages)
            t.append(env, False, None, "tool", tools_took)
            self._to(AgentState.GENERATING)


async def run_requests(requests: Sequence[AgentRequest], max_concurrency: int = 1024) -> list[Trajectory]:
    """Run every request as its own task (at most ``max_concurrency`` at once); results in input order."""
    gate = asyncio.Semaphore(max_concurrency)
    seq = itertools.count()

    async def one(req: AgentRequest) -> Trajectory:
        async with gate:
            req.policy.open_request()
            try:
                traj = await req.run()
            finally:
                req.policy.close_request()
            traj.done_seq = next(seq)
            return traj

    return list(await asyncio.gather(*(one(r) for r in requests)))


# ---------------------------------------------------------------- a batch of rows


def row_messages(row: dict) -> list[dict]:
    """The first messages of a prompts row: its chat messages, else its prompt text as one user turn."""
    msgs = row.get("messages")
    if msgs:
        return [{"role": m["role"], "content": m["content"]} for m in msgs]
    return [{"role": "user", "content": row["prompt"]}]


def run_agent_batch(
    engine: RolloutEngine,
    fmt: ChatFormat,
    tools: dict[str, ToolSpec],
    rows: Sequence[dict],
    params: SamplingParams,
    limits: AgentLimits,
    *,
    tools_in_prompt: bool = True,
    max_concurrency: int = 1024,
    window_s: float = 0.05,
    tool_workers: int = 8,
) -> tuple[list[AgentCompletion], dict[str, float]]:
    """``params.n`` agent rollouts of every row on ``engine``; their completions and timing stats."""
    policy = BatchingPolicy(engine, max_batch=engine.batch_size, window_s=window_s)
    executor = ThreadPoolExecutor(tool_workers, thread_name_prefix="rlstage-tool")
    requests = [
        AgentRequest(
            i, k, row_messages(row), sample_tools(tools, row.get("extra_info")), fmt, policy, params, limits,
            tool_executor=executor, tools_in_prompt=tools_in_prompt, key=i * params.n + k,
        )
        for i, row in enumerate(rows)
        for k in range(params.n)
    ]  # fmt: skip

    async def main() -> list[Trajectory]:
        try:
            return await run_requests(requests, max_concurrency)
        finally:
            await policy.aclose()

    t0 = time.perf_counter()
    try:
        trajs = asyncio.run(main())
    finally:
        # A sync tool stuck past its timeout keeps its thread; it is not waited for.
        executor.shutdown(wait=False, cancel_futures=True)
    stats = {
        "wall_s": time.perf_counter() - t0,
        "model_s": policy.model_s,
        "tool_s": sum(t.tool_run_s for t in trajs),
        "tool_wait_s": sum(t.tool_s for t in trajs),
        "batches": float(len(policy.batch_sizes)),
    }
    return [t.completion() for t in trajs], stats


def agent_metrics(rows: Sequence[AgentCompletion], stats: dict[str, float] | None = None, prefix: str = "") -> dict[str, float]:
    """verl-style metrics of a batch of agent completions."""
    n = max(1, len(rows))
    calls = sum(r.tool_calls for r in rows)
    errors = sum(r.tool_errors for r in rows)
    out = {
        "num_turns/mean": sum(r.num_turns for r in rows) / n,
        "num_turns/max": float(max((r.num_turns for r in rows), default=0)),
        "tool_calls/mean": calls / n,
        "tool_calls/errors": float(errors),
        "tool_calls/timeouts": float(sum(r.tool_timeouts for r in rows)),
        "tool_calls/success_rate": (calls - errors) / calls if calls else 0.0,
        "response_length/mean": sum(len(r.response_ids) for r in rows) / n,
        "response_length/policy_tokens_mean": sum(sum(r.response_mask) for r in rows) / n,
        "rollout/truncated_ratio": sum(bool(r.truncated) for r in rows) / n,
    }
    for status in sorted({s for r in rows for s in r.tool_status}):
        out[f"tool_calls/status/{status}"] = float(sum(r.tool_status.get(status, 0) for r in rows))
    for reason in FINISH_REASONS:
        out[f"rollout/finish/{reason}"] = sum(r.finish_reason == reason for r in rows) / n
    statuses = [r.agent_status for r in rows if r.agent_status is not None]  # agent.function runs
    for status in sorted(set(statuses)):
        out[f"agent/status/{status}"] = float(statuses.count(status))
    if stats is not None:
        out["timing_s/gen_model"] = stats["model_s"]
        out["timing_s/gen_tools"] = stats["tool_s"]
        out["timing_s/gen_tool_wait"] = stats.get("tool_wait_s", 0.0)
        out["timing_s/gen_wall"] = stats["wall_s"]
        out["rollout/gen_batches"] = stats["batches"]
        out.update({f"agent/{k}": v for k, v in stats.items() if k.startswith("rejected/")})
    return {prefix + k: v for k, v in out.items()}


def run_agent_config(
    engine: RolloutEngine, agent: Any, rows: Sequence[dict], params: SamplingParams
) -> tuple[list[AgentCompletion], dict[str, float]]:
    """``run_agent_batch`` with everything taken from the ``agent`` config section (the built-in loop; with
    ``agent.function`` set, workers call ``engines/agents/endpoint.py: run_agents`` instead)."""
    from rlstage.engines.agents.tools import load_tools, resolve_template

    fmt = ChatFormat(engine.tokenizer, resolve_template(agent.chat_template))
    limits = AgentLimits(agent.max_turns, agent.max_tool_calls, agent.max_response_tokens, agent.max_tool_output_chars)
    return run_agent_batch(
        engine, fmt, load_tools(agent.tools, agent.tool_timeout_s), rows, params, limits,
        tools_in_prompt=agent.tools_in_prompt, max_concurrency=agent.max_concurrency,
        window_s=agent.batch_window_ms / 1000, tool_workers=agent.tool_workers,
    )  # fmt: skip


# ---------------------------------------------------------------- demonstrations for SFT


class TeacherPolicy(AgentPolicy):
    """Replays given assistant turns (``turns[key][k]`` is request ``key``'s k-th turn), each ended by eos."""

    def __init__(self, fmt: ChatFormat, turns: Sequence[Sequence[str]]) -> None:
        self.fmt, self.turns = fmt, turns
        self._next: dict[int, int] = {}

    async def generate(self, prompt_ids: list[int], params: SamplingParams, key: int = 0) -> Generation:
        k = self._next.get(key, 0)
        self._next[key] = k + 1
        ids = self.fmt.encode(self.turns[key][k]) + [self.fmt.tok.eos_token_id]
        return Generation(ids, [0.0] * len(ids), "stop")


def demonstrations(
    fmt: ChatFormat,
    tools: dict[str, ToolSpec],
    rows: Sequence[dict],
    turns: Sequence[Sequence[str]],
    limits: AgentLimits,
    *,
    tools_in_prompt: bool = True,
    tool_workers: int = 8,
) -> list[Trajectory]:
    """Run the scripted assistant ``turns`` of each row through the loop with the real tools.

    The result is tokenized and masked exactly as an RL rollout would be, so SFT on
    ``(prompt_ids + response_ids, [0] * len(prompt_ids) + response_mask)`` teaches the same format.
    """
    policy = TeacherPolicy(fmt, turns)
    executor = ThreadPoolExecutor(tool_workers, thread_name_prefix="rlstage-tool")
    params = SamplingParams(max_new_tokens=limits.max_response_tokens)
    requests = [
        AgentRequest(
            i, 0, row_messages(row), sample_tools(tools, row.get("extra_info")), fmt, policy, params, limits,
            tool_executor=executor, tools_in_prompt=tools_in_prompt, key=i,
        )
        for i, row in enumerate(rows)
    ]  # fmt: skip
    try:
        return asyncio.run(run_requests(requests))
    finally:
        executor.shutdown(wait=False, cancel_futures=True)


def check_agent_template(cfg: Any) -> None:
    """Agent mode needs a chat template that renders tool messages incrementally: fail at config load."""
    template = resolve_template(cfg.agent.chat_template)
    tok = agent_tokenizer(cfg)
    if tok is None:
        return
    ChatFormat(tok, template)
