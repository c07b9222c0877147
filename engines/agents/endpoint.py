"""Your own agent: an OpenAI-compatible ``/v1/chat/completions`` endpoint in front of the policy.

Each process serves one endpoint on 127.0.0.1 (an ephemeral port, ``EndpointServer``). ``run_function_batch``
calls ``agent.function`` once per sample with an ``openai.AsyncOpenAI`` client bound to that sample (its requests
carry the ``X-Rlstage-Sample-Id`` header); requests become ``BatchingPolicy`` requests on the batch's event loop,
so concurrent agents share generation batches exactly as the built-in loop's requests do.

Trajectories are recorded in tokens: a sample's first request renders its messages (and ``tools``) with the chat
template; every later request must repeat the earlier conversation and append tool / user messages, whose
rendered ids are appended to the recorded ids (``ChatFormat.env_ids``). The policy's tokens and log-probs are
kept as the engine produced them, never re-tokenized from text.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import hashlib
import hmac
import inspect
import json
import logging
import math
import re
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from rlstage.engines.agents.loop import (
    AgentCompletion,
    AgentLimits,
    ChatFormat,
    Trajectory,
    row_messages,
    run_agent_config,
)
from rlstage.engines.agents.policies import BatchingPolicy
from rlstage.engines.agents.tools import (
    CALL_CLOSE,
    CALL_OPEN,
    ToolConfigError,
    load_tools,
    parse_tool_calls,
    resolve_callable,
    resolve_template,
    sample_tools,
)
from rlstage.engines.rewards.rules import FLOAT32_MAX
from rlstage.engines.rollout.base import RolloutEngine, SamplingParams

log = logging.getLogger(__name__)

SAMPLE_HEADER = "X-Rlstage-Sample-Id"
# the sample's secret where a harness cannot set the client's API key (its Authorization header) itself
KEY_HEADER = "X-Rlstage-Sample-Key"
MODEL_NAME = "policy"  # the model name the endpoint serves (AgentSample.model)
# How an agent function's sample ended; every kind but "ok" is a failed sample.
OK, RAISED, TIMEOUT, BAD_RETURN, NO_REQUEST = "ok", "raised", "timeout", "bad_return", "no_request"
TOO_LONG = "too_long"  # its first request's prompt was over data.max_prompt_length: refused, nothing trained
_ROLES_AFTER = ("tool", "user", "system")  # what an agent may append between two completions
_TAGGED = re.compile(re.escape(CALL_OPEN) + r".*?" + re.escape(CALL_CLOSE), re.S)


class RequestError(Exception):
    """A request the endpoint refuses: an HTTP 4xx with an OpenAI-shaped error body."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


@dataclass(frozen=True)
class AgentSample:
    """What an agent function gets besides its client: the sample and how to ask for the policy."""

    sample_id: str  # also in every request's X-Rlstage-Sample-Id header (the client sets it)
    model: str  # the model name to request
    messages: list[dict]  # the prompts row's first messages
    row: dict  # the prompts-table row: prompt, ground_truth, data_source, extra_info, ...
    tools: list[dict]  # the configured tools offered to this sample, as OpenAI function tools
    settings: dict = field(default_factory=dict)  # the run's data.source_settings (from its config, never a stored row)


def resolve_agent_function(path: str) -> Callable[..., Any]:
    """``agent.function`` -> an ``async def fn(client, sample)``; ToolConfigError (one line) otherwise."""
    fn = resolve_callable(path) if (":" in path or "." in path) else None
    if fn is None:
        raise ToolConfigError(f"{path!r} is not an import path (write package.module:function)")
    if not inspect.iscoroutinefunction(fn):
        raise ToolConfigError(f"{path!r} must be an async function: async def agent(client, sample) -> float | None")
    return fn


# ---------------------------------------------------------------- one sample's record


def _norm(m: dict) -> tuple:
    """A message as the prefix check compares it: role, content and tool calls (arguments parsed)."""
    calls = []
    for c in m.get("tool_calls") or []:
        fn = c.get("function") or {}
        args = fn.get("arguments")
        with contextlib.suppress(TypeError, ValueError):
            args = json.loads(args) if isinstance(args, str) else args
        calls.append((fn.get("name"), json.dumps(args, sort_keys=True)))
    content = m.get("content")
    if isinstance(content, list):  # content parts: the text ones, joined
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if not isinstance(content, str | None):
        raise TypeError("content must be a string or a list of text parts")
    return (m.get("role"), (content or "").strip(), tuple(calls), m.get("tool_call_id") if m.get("role") == "tool" else None)


@dataclass
class SampleRecord:
    """A sample's trajectory as requests arrive (``Trajectory`` as the built-in loop builds it)."""

    key: int
    traj: Trajectory | None = None
    seen: list[tuple] = field(default_factory=list)  # the conversation as the agent sends it, normalized
    call_names: dict[str, str] = field(default_factory=dict)  # tool call id -> tool name (tool messages name it)
    last_finish: str = ""  # the last generation's finish reason
    ended: str | None = None  # a limit that ended the trajectory: later requests are answered empty
    failure: str | None = None  # the endpoint's verdict on the sample (TOO_LONG), whatever its agent returns
    closed: bool = False  # the agent returned (or failed): requests are refused
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one request of a sample at a time
    replied_at: float = 0.0  # when the last completion was answered: the agent's own turn runs from there
    clock: _OwnClock | None = None  # its agent's bound: the time inside its requests is the policy's, not the agent's


def _assistant_message(text: str, call_id: str) -> tuple[dict, dict[str, str]]:
    """The OpenAI message of a turn: text outside the tool-call tags as content, each tag a tool call."""
    calls, names = [], {}
    for j, c in enumerate(parse_tool_calls(text)):
        cid = f"{call_id}_{j}"
        # An unparseable call still comes back, with its raw arguments (the OpenAI API does not promise JSON).
        args = json.dumps(c.arguments) if c.arguments is not None else (c.error or "")
        calls.append({"id": cid, "type": "function", "function": {"name": c.name or "", "arguments": args}})
        names[cid] = c.name or ""
    content = _TAGGED.sub("", text).strip() if calls else text
    msg: dict = {"role": "assistant", "content": content or None}
    if calls:
        msg["tool_calls"] = calls
    return msg, names


# ---------------------------------------------------------------- the endpoint


class ChatEndpoint:
    """``/v1/chat/completions`` over a ``BatchingPolicy``, recording each sample's trajectory."""

    def __init__(
        self,
        policy: BatchingPolicy,
        fmt: ChatFormat,
        params: SamplingParams,
        limits: AgentLimits,
        records: dict[str, SampleRecord],
        samples: dict[str, tuple[int, int]],
        keys: dict[str, str] | None = None,
    ) -> None:
        self.policy, self.fmt, self.params, self.limits = policy, fmt, params, limits
        self.records, self.samples = records, samples  # sample id -> (prompt index, sample index)
        self.keys = keys or {}  # sample id -> the secret its client sends as its API key
        self.ended = False  # the batch is over: every request is refused
        self.loop: asyncio.AbstractEventLoop | None = None  # the batch's loop, where requests run
        self.engine_error: Exception | None = None  # the first generation failure: raised once the batch ends

    async def complete(self, body: Any, sample_id: str | None) -> dict:
        if self.ended:
            raise RequestError(409, "stage_ended", f"the rollout stage that served sample {sample_id!r} has ended")
        rec = self.records.get(sample_id)
        if rec is None:
            raise RequestError(404, "unknown_sample", f"sample {sample_id!r} is not in this batch")
        if not isinstance(body, dict):
            raise RequestError(400, "invalid_body", "the body must be a JSON object")
        if body.get("model") != MODEL_NAME:
            raise RequestError(404, "model_not_found", f"model {body.get('model')!r} is not served here (use {MODEL_NAME!r})")
        if body.get("n", 1) != 1:
            raise RequestError(400, "unsupported", "n must be 1 (each sample is one trajectory)")
        messages, tools = body.get("messages"), body.get("tools")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise RequestError(400, "invalid_messages", "messages must be a non-empty list of {role, content} objects")
        if tools is not None and not (
            isinstance(tools, list)
            and all(isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str) for t in tools)
        ):
            raise RequestError(400, "invalid_tools", 'tools must be a list of {"type": "function", "function": {"name": ..., "parameters": ...}}')
        if rec.clock is not None:
            rec.clock.enter()
        try:
            async with rec.lock:
                if rec.closed:
                    raise RequestError(409, "sample_closed", f"sample {sample_id!r} has ended (its agent returned or failed)")
                return await self._turn(sample_id, rec, messages, tools)
        finally:
            if rec.clock is not None:
                rec.clock.leave()

    def _empty(self, reason: str) -> dict:
        """The answer to a request past a limit: nothing generated, nothing recorded."""
        return _response({"role": "assistant", "content": ""}, reason, 0, 0)

    def _extend(self, rec: SampleRecord, messages: list[dict], norm: list[tuple]) -> dict | None:
        """Append a later request's new messages to the recorded ids, as the built-in loop appends tool turns;
        the empty answer instead when a limit ends the trajectory here (None: generate)."""
        lim = self.limits
        t = rec.traj
        if norm[: len(rec.seen)] != rec.seen or len(norm) == len(rec.seen):
            raise RequestError(400, "not_a_continuation", "messages must repeat the sample's earlier turns and append tool or user messages")
        new = messages[len(rec.seen) :]
        if any(m.get("role") not in _ROLES_AFTER for m in new):
            raise RequestError(400, "invalid_messages", f"only {', '.join(_ROLES_AFTER)} messages may follow a completion")
        if rec.ended is not None:
            return self._empty("length")
        out_of_tokens = len(t.response_ids) >= lim.max_response_tokens
        if out_of_tokens or t.num_turns >= lim.max_turns:
            rec.ended = "length" if out_of_tokens else "max_turns"
            t.truncated = out_of_tokens
            return self._empty("length")
        plain = [_plain(m, rec.call_names) for m in new]
        tool_msgs = [m for m in plain if m["role"] == "tool"]
        room = lim.max_tool_calls - t.tool_calls
        if tool_msgs and room <= 0:
            rec.ended = "max_tool_calls"
            return self._empty("length")
        for m in tool_msgs[max(room, 0) :]:  # as the built-in loop answers calls over the limit
            m["content"] = f"error: tool call limit ({lim.max_tool_calls} per request) reached; not run"
        try:
            env = self.fmt.env_ids(plain, stopped=rec.last_finish == "stop")
        except Exception as err:
            raise RequestError(400, "invalid_messages", f"the chat template cannot render the new messages: {err}") from None
        for m in tool_msgs:  # the agent ran these calls: counted even if their messages do not fit (as built in)
            t.tool_calls += 1
            bad = m["content"].startswith("error:")  # the built-in loop's tool messages report failures so
            t.tool_errors += bad
            status = "error" if bad else "ok"
            t.tool_status[status] = t.tool_status.get(status, 0) + 1
        if len(t.response_ids) + len(env) >= lim.max_response_tokens:  # no room for a policy token: end here
            rec.ended, t.truncated = "length", True
            return self._empty("length")
        t.messages.extend(plain)
        t.append(env, False, None, "tool" if tool_msgs else plain[-1]["role"], time.perf_counter() - rec.replied_at)
        t.states.append("generating")
        rec.seen = norm
        return None

    async def _turn(self, sample_id: str, rec: SampleRecord, messages: list[dict], tools: list[dict] | None) -> dict:
        lim = self.limits
        try:
            norm = [_norm(m) for m in messages]
        except (AttributeError, TypeError, ValueError):
            raise RequestError(400, "invalid_messages", "a message is malformed (content: a string or text parts; tool_calls: a list)") from None
        if rec.traj is None:  # the first request: its messages (and tools) rendered are the prompt
            i, k = self.samples[sample_id]
            first = [_plain(m, rec.call_names) for m in messages]
            try:
                prompt = self.fmt.prompt_ids(first, tools)
            except Exception as err:  # the template cannot render what the agent sent
                raise RequestError(400, "invalid_messages", f"the chat template cannot render the messages: {err}") from None
            if lim.max_prompt_tokens is not None and len(prompt) > lim.max_prompt_tokens:
                rec.failure = TOO_LONG
                raise RequestError(
                    400, "prompt_too_long",
                    f"the first request's messages are {len(prompt)} tokens with the chat template; data.max_prompt_length "
                    f"is {lim.max_prompt_tokens}",
                )  # fmt: skip
            rec.traj = Trajectory(i, k, prompt, first)
            rec.traj.states.append("generating")
            rec.seen = norm
        else:
            ended = self._extend(rec, messages, norm)
            if ended is not None:
                return ended
        t = rec.traj
        budget = lim.max_response_tokens - len(t.response_ids)
        params = replace(self.params, n=1, max_new_tokens=max(1, min(self.params.max_new_tokens, budget)))
        t0 = time.perf_counter()
        try:
            gen = await self.policy.generate(t.prompt_ids + t.response_ids, params, rec.key)
        except Exception as err:  # the engine failed: the stage fails with it (retried), as the built-in loop's does
            self.engine_error = self.engine_error or err
            raise
        took = time.perf_counter() - t0
        t.model_s += took
        if rec.closed:  # the agent gave up (timeout) while this turn was generated: not recorded
            raise RequestError(409, "sample_closed", f"sample {sample_id!r} has ended (its agent returned or failed)")
        ids = list(gen.token_ids)[: params.max_new_tokens]
        t.append(ids, True, list(gen.log_probs)[: len(ids)], "assistant", took)
        t.num_turns += 1
        text = self.fmt.decode(ids)
        t.messages.append({"role": "assistant", "content": text})
        rec.last_finish = gen.finish_reason
        msg, names = _assistant_message(text, f"call_{_short(sample_id)}_{t.num_turns}")
        rec.call_names.update(names)
        rec.seen = [*rec.seen, _norm(msg)]
        calls = "tool_calls" in msg
        if calls and len(t.response_ids) >= lim.max_response_tokens:
            rec.ended, t.truncated = "length", True
        elif calls and t.num_turns >= lim.max_turns:
            rec.ended = "max_turns"
        elif calls and lim.max_tool_calls - t.tool_calls <= 0:
            rec.ended = "max_tool_calls"
        reason = "tool_calls" if calls else gen.finish_reason
        rec.replied_at = time.perf_counter()
        return _response(msg, reason, len(t.prompt_ids) + len(t.response_ids) - len(ids), len(ids))

    def finish(self, rec: SampleRecord) -> Trajectory | None:
        """The sample's trajectory once its agent is done: the finish reason the built-in loop would give."""
        t = rec.traj
        if t is None:
            return None
        if rec.ended is not None:
            t.finish_reason = rec.ended
        else:
            t.finish_reason = rec.last_finish
            t.truncated = t.truncated or (rec.last_finish == "length" and len(t.response_ids) >= self.limits.max_response_tokens)
        t.text = next((m["content"] for m in reversed(t.messages) if m["role"] == "assistant"), "")
        t.states.append("completed")
        return t


def _given_key(request: Any) -> str:
    """The secret a request carries: its ``X-Rlstage-Sample-Key`` header, else its bearer API key."""
    if request.headers.get(KEY_HEADER):
        return request.headers[KEY_HEADER]
    scheme, _, value = (request.headers.get("authorization") or "").partition(" ")
    return value.strip() if scheme.lower() == "bearer" else ""


def _short(sample_id: str) -> str:
    return hashlib.blake2b(sample_id.encode(), digest_size=4).hexdigest()


def _plain(m: dict, call_names: dict[str, str]) -> dict:
    """A request message as the chat template and the stored conversation take it ({role, content[, name]})."""
    content = m.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if m["role"] == "tool":  # named after the call it answers, as the built-in loop names tool messages
        return {"role": "tool", "name": m.get("name") or call_names.get(m.get("tool_call_id") or "", ""), "content": content or ""}
    if m["role"] == "assistant" and m.get("tool_calls"):
        # an earlier turn's tool calls (a first request that replays a conversation): written as the policy writes
        # them, tags in the text, so the chat template renders them and their tool messages are named after them
        tags = []
        for c in m["tool_calls"]:
            fn = c.get("function") or {}
            args = fn.get("arguments")
            with contextlib.suppress(TypeError, ValueError):
                args = json.loads(args) if isinstance(args, str) else args
            tags.append(f"{CALL_OPEN}{json.dumps({'name': fn.get('name') or '', 'arguments': args if args is not None else {}})}{CALL_CLOSE}")
            if c.get("id"):
                call_names[c["id"]] = fn.get("name") or ""
        return {"role": "assistant", "content": "\n".join([*([content] if content else []), *tags])}
    return {"role": m["role"], "content": content or ""}


def _response(msg: dict, reason: str, prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "id": f"chatcmpl-{time.monotonic_ns():x}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": MODEL_NAME,
        "choices": [{"index": 0, "message": msg, "finish_reason": reason, "logprobs": None}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens},
    }


def _stream(response: dict, include_usage: bool) -> list[bytes]:
    """A completed response as OpenAI's server-sent chunks: the whole message in one delta, the finish reason,
    the usage if asked for, ``[DONE]`` (the batch generates a turn whole, so nothing arrives earlier)."""
    msg, reason = response["choices"][0]["message"], response["choices"][0]["finish_reason"]
    delta = {"role": "assistant", "content": msg.get("content")}
    if "tool_calls" in msg:
        delta["tool_calls"] = [{"index": j, **call} for j, call in enumerate(msg["tool_calls"])]
    head = {key: response[key] for key in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    usage = {"usage": None} if include_usage else {}
    chunks = [
        {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None, "logprobs": None}], **usage},
        {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": reason, "logprobs": None}], **usage},
    ]
    if include_usage:
        chunks.append({**head, "choices": [], "usage": response["usage"]})
    return [f"data: {json.dumps(c)}\n\n".encode() for c in chunks] + [b"data: [DONE]\n\n"]


class EndpointServer:
    """The process's endpoint: uvicorn on 127.0.0.1 (an ephemeral port) in a daemon thread of its own.

    It outlives the stages: a batch registers its ``ChatEndpoint`` under a token that prefixes its sample ids,
    requests are run on the batch's event loop, and a request for a batch that has ended gets HTTP 409.
    """

    def __init__(self) -> None:
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):  # the worker process keeps its own signal handlers
                yield

        self.batches: dict[str, ChatEndpoint] = {}
        self.ended: collections.OrderedDict[str, None] = collections.OrderedDict()  # the last tokens that ended
        self.rejected: collections.Counter[str] = collections.Counter()  # refused requests by error code
        self.warned: collections.Counter[str] = collections.Counter()  # refused requests logged, by sample id
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
        config = uvicorn.Config(self._app(), log_level="error", access_log=False, lifespan="off", timeout_graceful_shutdown=1)
        self._server = Server(config)
        self._thread = threading.Thread(target=lambda: asyncio.run(self._server.serve(sockets=[sock])), name="rlstage-agent-endpoint", daemon=True)
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the agent endpoint's server did not start")
            time.sleep(0.01)

    def open(self, token: str, endpoint: ChatEndpoint) -> None:
        self.batches[token] = endpoint

    def close(self, token: str) -> None:
        for sid in [k for k in self.warned if k.startswith(token + "-")]:
            del self.warned[sid]
        endpoint = self.batches.pop(token, None)
        if endpoint is not None:
            endpoint.ended = True
        self.ended[token] = None
        while len(self.ended) > 10_000:
            self.ended.popitem(last=False)

    def _route(self, sample_id: str | None, given: str) -> ChatEndpoint:
        if not sample_id:
            raise RequestError(400, "missing_sample_id", f"no {SAMPLE_HEADER} header: use the client rlstage gave the agent")
        token = sample_id.split("-", 1)[0]
        endpoint = self.batches.get(token)
        if endpoint is None:
            if token in self.ended:
                raise RequestError(409, "stage_ended", f"the rollout stage that served sample {sample_id!r} has ended")
            raise RequestError(404, "unknown_sample", f"sample {sample_id!r} is in no running rollout stage")
        key = endpoint.keys.get(sample_id)
        if key is not None and not hmac.compare_digest(given.encode(), key.encode()):
            # a sample id (they appear in logs) is no credential: only its own client's secret writes its trajectory
            raise RequestError(401, "invalid_api_key", f"the API key is not sample {sample_id!r}'s: use the client rlstage gave its agent")
        return endpoint

    def _any_key(self, given: str) -> bool:
        """Whether the request carries the secret of a sample of a running batch (``/v1/models``)."""
        return any(hmac.compare_digest(given.encode(), k.encode()) for e in list(self.batches.values()) for k in e.keys.values())

    def reject(self, err: RequestError, sample_id: str | None) -> JSONResponse:
        self.rejected[err.code] += 1
        who = sample_id or "-"
        self.warned[who] += 1
        if self.warned[who] <= WARNINGS_PER_SAMPLE:  # the first few per sample; every one is counted (agent/rejected/*)
            log.warning("agent endpoint: HTTP %d %s (sample %s): %s", err.status, err.code, who, err)
        elif self.warned[who] == WARNINGS_PER_SAMPLE + 1:
            log.warning("agent endpoint: sample %s: more requests refused; they are counted in agent/rejected/<code>, not logged", who)
        body = {"error": {"message": str(err), "type": "invalid_request_error", "code": err.code}}
        return JSONResponse(body, status_code=err.status)

    async def _forward(self, endpoint: ChatEndpoint, body: Any, sample_id: str) -> dict:
        """Run the request on its batch's event loop (where the policy batches); a batch ending meanwhile is a 409."""
        try:
            fut = asyncio.run_coroutine_threadsafe(endpoint.complete(body, sample_id), endpoint.loop)
        except RuntimeError:  # the batch's loop has closed
            raise RequestError(409, "stage_ended", f"the rollout stage that served sample {sample_id!r} has ended") from None
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            if not fut.cancelled():
                raise  # this server is stopping
            raise RequestError(409, "stage_ended", f"the rollout stage that served sample {sample_id!r} has ended") from None

    def _app(self) -> Any:
        app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Response:
            sample_id = request.headers.get(SAMPLE_HEADER)
            try:
                endpoint = self._route(sample_id, _given_key(request))
                try:
                    body = await request.json()
                except ValueError:
                    raise RequestError(400, "invalid_body", "the body is not JSON") from None
                stream = isinstance(body, dict) and bool(body.get("stream"))
                if stream:  # answered as chunks of the whole turn (agents' SDKs that always stream, e.g. verifiers')
                    options = body.get("stream_options")
                    include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
                    body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
                response = await self._forward(endpoint, body, sample_id or "")
                if stream:
                    return StreamingResponse(iter(_stream(response, include_usage)), media_type="text/event-stream")
                return JSONResponse(response)
            except RequestError as err:
                return self.reject(err, sample_id)
            except Exception as err:  # a failed generation (the stage fails after the batch) or a bug here
                log.warning("agent endpoint: HTTP 500 (sample %s): %s: %s", sample_id or "-", type(err).__name__, err)
                return JSONResponse({"error": {"message": str(err), "type": "server_error", "code": None}}, status_code=500)

        @app.get("/v1/models")
        async def models(request: Request) -> Response:
            if not self._any_key(_given_key(request)):
                err = RequestError(401, "invalid_api_key", "no API key of a running sample: use the client rlstage gave the agent")
                return self.reject(err, request.headers.get(SAMPLE_HEADER))
            return JSONResponse({"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "rlstage"}]})

        return app


_SERVER: list[EndpointServer] = []
_SERVER_LOCK = threading.Lock()


def endpoint_server() -> EndpointServer:
    """The process's endpoint server, started on first use."""
    with _SERVER_LOCK:
        if not _SERVER:
            _SERVER.append(EndpointServer())
        return _SERVER[0]


# ---------------------------------------------------------------- a batch of samples


def _check_reward(value: Any) -> float | None:
    if value is None:
        return None
    # float32's range: the rewards table stores float32, where 1e39 is inf (NaN advantages, a skipped step)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or abs(value) > FLOAT32_MAX:
        raise TypeError(f"returned {type(value).__name__} {value!r}, not a finite float32 or None")
    return float(value)


class AgentEscaped(Exception):
    """KeyboardInterrupt, SystemExit or GeneratorExit raised by an agent function's own code: that sample's failure,
    never the stage's (asyncio would re-raise the first two out of the event loop)."""


WARNINGS_PER_SAMPLE = 3  # refused requests logged per sample; the rest are counted only
_CANCEL_GRACE_S = 1.0  # how long a cancelled agent may take to stop before it is left behind


class _LoopTime:
    """The time the agents of a batch have held its event loop, all their steps together (one loop runs one step
    at a time, so the sum is exact): an agent's own time is its wall time less what the others held of it."""

    def __init__(self) -> None:
        self.total = 0.0


class _OwnClock:
    """One agent's own time, what its bound counts: the wall time since it started, less the other agents' steps
    on the event loop (a blocking call among them) and less the time its requests spent in the endpoint (the
    policy's batching and generation, and the other work on the loop meanwhile): a busy engine or a loaded machine
    times out no agent, its own steps and awaits do."""

    def __init__(self, held: _LoopTime) -> None:
        self.held, self.start, self.held_at_start = held, time.perf_counter(), held.total
        self.busy = 0.0  # its own steps on the loop
        self.requests = 0  # its requests inside the endpoint now
        self.in_endpoint = 0.0  # closed spells inside the endpoint, less every agent's steps meanwhile
        self._spell = (0.0, 0.0)  # the open spell's start and the loop time held by then

    def charge(self, step: float) -> None:
        self.busy += step
        self.held.total += step

    def enter(self) -> None:
        if self.requests == 0:
            self._spell = (time.perf_counter(), self.held.total)
        self.requests += 1

    def leave(self) -> None:
        self.requests -= 1
        if self.requests == 0:
            self.in_endpoint += self._open_spell()

    def _open_spell(self) -> float:  # steps meanwhile are counted once: as the others' (below) or as its own
        since, held_then = self._spell
        return time.perf_counter() - since - (self.held.total - held_then)

    def own(self) -> float:
        others = self.held.total - self.held_at_start - self.busy
        in_endpoint = self.in_endpoint + (self._open_spell() if self.requests else 0.0)
        return time.perf_counter() - self.start - others - in_endpoint


class _Timed:
    """An agent's coroutine driven one step at a time, each step timed: the time a step held the event loop (a
    blocking call inside ``async def``, long or in many short steps) is charged to that agent, and is not the other
    agents' time."""

    def __init__(self, coro: Any, clock: _OwnClock) -> None:
        self.coro, self.clock = coro, clock

    def _charge(self, t0: float) -> None:
        self.clock.charge(time.perf_counter() - t0)

    def __await__(self):
        it = self.coro.__await__()
        send: Any = None
        thrown: BaseException | None = None
        while True:
            t0 = time.perf_counter()
            try:
                step = it.throw(thrown) if thrown is not None else it.send(send)
            except StopIteration as stop:
                self._charge(t0)
                return stop.value
            except (KeyboardInterrupt, SystemExit, GeneratorExit) as err:  # the agent's own (closing is handled below)
                self._charge(t0)
                raise AgentEscaped(f"{type(err).__name__}: {err}" if str(err) else type(err).__name__) from None
            except BaseException:
                self._charge(t0)
                raise
            self._charge(t0)
            try:
                send, thrown = (yield step), None
            except GeneratorExit:
                it.close()
                raise
            except BaseException as err:  # a cancellation (or another exception) thrown into the awaiting task
                send, thrown = None, err


async def _bounded(coro: Any, sid: str, timeout_s: float, clock: _OwnClock) -> tuple[float | None, str]:
    """Run one agent within its own ``timeout_s``, whatever it does with cancellation: past the bound its task is
    cancelled and left behind (its later requests are refused), never waited for. The bound counts the agent's own
    time (``_OwnClock``): other agents' steps and its requests' time in the endpoint do not count against it."""
    timed = _Timed(coro, clock)
    task = asyncio.ensure_future(timed)
    while not task.done() and (left := timeout_s - clock.own()) > 0:
        await asyncio.wait({task}, timeout=left)
    if not task.done() or clock.own() > timeout_s:
        task.cancel()  # left behind: the batch's end never waits for it (_run_leaving_abandoned)
        blocked = f" (it blocked the event loop for {clock.busy:.1f}s)" if clock.busy > timeout_s / 2 else ""
        log.warning("agent function: sample %s timed out after %gs%s", sid, timeout_s, blocked)
        return 0.0, TIMEOUT
    try:
        return _check_reward(task.result()), OK
    except TypeError as err:
        status = BAD_RETURN if str(err).startswith("returned ") else RAISED
        log.warning("agent function: sample %s %s", sid, err)
    except AgentEscaped as err:
        status = RAISED
        log.warning("agent function: sample %s raised %s", sid, err)
    except asyncio.CancelledError:
        status = RAISED  # the agent cancelled itself
        log.warning("agent function: sample %s was cancelled by its own code", sid)
    except Exception as err:  # the agent's own failure is this sample's, never the stage's
        status = RAISED
        log.warning("agent function: sample %s raised %s: %s", sid, type(err).__name__, err)
    return 0.0, status


def _run_leaving_abandoned(main: Any) -> None:
    """``asyncio.run`` but for its end: agents left behind are cancelled and given a moment, never awaited until
    they finish (one that swallows its cancellation would hold the stage forever)."""
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(main)
    finally:
        try:
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                loop.run_until_complete(asyncio.wait(pending, timeout=_CANCEL_GRACE_S))
            for t in pending:  # left behind on purpose (the timeout said so): no "destroyed but pending" at exit
                t._log_destroy_pending = False
            loop.run_until_complete(asyncio.wait_for(loop.shutdown_asyncgens(), _CANCEL_GRACE_S))
        except (TimeoutError, RuntimeError):
            pass
        finally:
            executor = getattr(loop, "_default_executor", None)  # a blocked agent's thread is not waited for either
            if executor is not None:
                executor.shutdown(wait=False, cancel_futures=True)
            asyncio.set_event_loop(None)
            loop.close()


def _failed(t: Trajectory | None, i: int, k: int, fmt: ChatFormat, messages: list[dict]) -> Trajectory:
    """A failed sample keeps its group whole: its tokens, none trained (or one masked eos if none was generated)."""
    if t is None:
        eos = fmt.tok.eos_token_id
        t = Trajectory(i, k, fmt.prompt_ids(messages), messages)
        t.append([eos], False, None, "assistant", 0.0)
        t.finish_reason = "stop"
    t.response_mask = [0] * len(t.response_ids)
    return t


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


_SAMPLES_PER_CLIENT = 4


def run_function_batch(
    engine: RolloutEngine,
    fmt: ChatFormat,
    function: Callable[..., Any],
    rows: Sequence[dict],
    params: SamplingParams,
    limits: AgentLimits,
    *,
    tool_schemas: Callable[[dict], list[dict]] = lambda row: [],
    timeout_s: float = 300.0,
    max_concurrency: int = 1024,
    window_s: float = 0.05,
    settings: dict | None = None,
    stage_timeout_s: float | None = None,
) -> tuple[list[AgentCompletion], dict[str, Any]]:
    """``params.n`` runs of the agent ``function`` on every row against the endpoint; their completions and stats.

    A completion carries ``agent_reward`` (the function's reward, None: the rule scores the answer) and
    ``agent_status`` (OK or the kind of failure). A failed sample gets reward 0.0 and no
    trained tokens.
    """
    import httpx
    import openai

    _openai_ready()
    server = endpoint_server()
    token = secrets.token_hex(6)  # this batch's prefix of its sample ids
    policy = BatchingPolicy(engine, max_batch=engine.batch_size, window_s=window_s)
    samples = {f"{token}-{i}-{k}": (i, k) for i in range(len(rows)) for k in range(params.n)}
    records = {sid: SampleRecord(key=i * params.n + k) for sid, (i, k) in samples.items()}
    keys = {sid: secrets.token_urlsafe(24) for sid in samples}  # each sample's client's API key, checked per request
    endpoint = ChatEndpoint(policy, fmt, params, limits, records, samples, keys)
    results: dict[str, tuple[float | None, str]] = {}

    held = _LoopTime()  # the time agents' own steps held the event loop, charged to each (_bounded)

    async def one(sid: str, base_url: str, http: Any, gate: asyncio.Semaphore) -> None:
        i, k = samples[sid]
        row = rows[i]
        sample = AgentSample(sid, MODEL_NAME, row_messages(row), dict(row), tool_schemas(row), dict(settings or {}))
        # No client timeout: the bound is _bounded's, which leaves out other agents' time on the loop (a client timeout of the
        # same length fired while another agent blocked the loop, and failed the samples that waited behind it).
        client = openai.AsyncOpenAI(
            base_url=base_url, api_key=keys[sid], http_client=http, max_retries=0, timeout=None,
            default_headers={SAMPLE_HEADER: sid},
        )  # fmt: skip
        async with gate:
            policy.open_request()
            records[sid].clock = clock = _OwnClock(held)
            try:
                reward, status = await _bounded(function(client, sample), sid, timeout_s, clock)
            finally:
                records[sid].closed = True
                policy.close_request()
        results[sid] = (reward, status)

    async def main() -> None:
        gate = asyncio.Semaphore(max_concurrency)
        endpoint.loop = asyncio.get_running_loop()
        server.open(token, endpoint)
        # A few samples per HTTP client: httpcore's pool scans every connection for every waiting request,
        # so one client shared by 64 agents spent most of the batch's time in that scan.
        sids = list(samples)
        tls = ssl.create_default_context()  # loaded once: each client would load the CA bundle (~20 ms) for plain HTTP
        https = [
            httpx.AsyncClient(timeout=None, transport=_policy_time_transport()(httpx.AsyncHTTPTransport(verify=tls), records))
            for _ in range(0, len(sids), _SAMPLES_PER_CLIENT)
        ]
        try:
            runs = [asyncio.ensure_future(one(sid, server.base_url, https[j // _SAMPLES_PER_CLIENT], gate)) for j, sid in enumerate(sids)]
            _, late = await asyncio.wait(runs, timeout=stage_timeout_s)
            for run in late:  # the round's bound: what has not finished is a timeout, abandoned
                run.cancel()
            if late:
                await asyncio.wait(late, timeout=_CANCEL_GRACE_S)
                for sid in sids:
                    results.setdefault(sid, (0.0, TIMEOUT))
                log.warning("agent function: %d sample(s) still running at agent.stage_timeout_s=%gs: timeouts", len(late), stage_timeout_s)
            for run in runs:
                if run.done() and not run.cancelled() and run.exception() is not None:
                    raise run.exception()
        finally:
            server.close(token)  # an abandoned agent's later requests are refused from here on
            await asyncio.wait([asyncio.ensure_future(http.aclose()) for http in https], timeout=_CANCEL_GRACE_S)
            await policy.aclose()

    t0 = time.perf_counter()
    before = collections.Counter(server.rejected)
    lines = _Lines()
    log.addHandler(lines)  # this batch's warnings (the server thread's too) go back to the stage's log
    try:
        _run_leaving_abandoned(main())
    finally:
        log.removeHandler(lines)
    if endpoint.engine_error is not None:
        raise endpoint.engine_error
    rejected = server.rejected - before  # a request without a sample id names no batch: counted by the one running
    out: list[AgentCompletion] = []
    for sid, (i, k) in samples.items():
        reward, status = results[sid]
        t = endpoint.finish(records[sid])
        if records[sid].failure is not None:
            status, reward = records[sid].failure, 0.0
        if status != OK or t is None:
            if status == OK:  # returned without a single request: nothing to train, and its number is no reward
                status, reward = NO_REQUEST, 0.0
            t = _failed(t, i, k, fmt, row_messages(rows[i]))
        out.append(t.completion(reward, status))
    stats = {
        "wall_s": time.perf_counter() - t0,
        "model_s": policy.model_s,
        "tool_s": 0.0,
        "batches": float(len(policy.batch_sizes)),
        **{f"rejected/{code}": float(n) for code, n in rejected.items()},
        "log": lines.lines,  # not a metric: the lines the stage logs (tasks/stages.py)
    }
    return out, stats


@functools.cache
def _policy_time_transport() -> type:
    """An httpx transport that marks each request's whole round trip as the policy's time on its sample's clock
    (the endpoint marks its own part too, for a harness that brings its own client): the hops between the
    client and the endpoint's thread are not the agent's either."""
    import httpx

    class PolicyTime(httpx.AsyncBaseTransport):
        def __init__(self, inner: httpx.AsyncBaseTransport, records: dict[str, SampleRecord]) -> None:
            self.inner, self.records = inner, records

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            rec = self.records.get(request.headers.get(SAMPLE_HEADER, ""))
            clock = rec.clock if rec is not None else None
            if clock is None:
                return await self.inner.handle_async_request(request)
            clock.enter()
            try:
                response = await self.inner.handle_async_request(request)
                await response.aread()  # the body too: it is the endpoint's answer arriving
                return response
            finally:
                clock.leave()

        async def aclose(self) -> None:
            await self.inner.aclose()

    return PolicyTime


@functools.cache
def _openai_ready() -> None:
    """openai builds its client machinery on first use (its resources are imported lazily: ~0.5 s on 2 cores, more
    under load): done once per process before any batch, not inside the first samples' bounds (the first agent's
    ran into a 1 s bound under load)."""
    import httpx
    import openai

    never_opened = httpx.AsyncClient()  # no request is made through it
    openai.AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="-", http_client=never_opened, max_retries=0).chat.completions.create  # noqa: B018


def run_agents(
    engine: RolloutEngine,
    agent: Any,
    rows: Sequence[dict],
    params: SamplingParams,
    source_settings: dict | None = None,
    max_prompt_tokens: int | None = None,
) -> tuple[list[AgentCompletion], dict[str, Any]]:
    """The ``agent`` config section's rollouts: ``agent.function`` against the endpoint (its samples carry the run's
    ``data.source_settings``), else the built-in loop."""
    if agent.function is None:
        return run_agent_config(engine, agent, rows, params)
    fmt = ChatFormat(engine.tokenizer, resolve_template(agent.chat_template))
    limits = AgentLimits(agent.max_turns, agent.max_tool_calls, agent.max_response_tokens, agent.max_tool_output_chars, max_prompt_tokens)
    tools = load_tools(agent.tools, agent.tool_timeout_s)
    return run_function_batch(
        engine, fmt, resolve_agent_function(agent.function), rows, params, limits,
        tool_schemas=lambda row: sample_tools(tools, row.get("extra_info")).schemas(),
        timeout_s=agent.function_timeout_s, max_concurrency=agent.max_concurrency, window_s=agent.batch_window_ms / 1000,
        stage_timeout_s=agent.stage_timeout_s,
        settings=source_settings,
    )  # fmt: skip
