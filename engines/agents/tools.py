"""Tools for multi-turn rollouts: specs loaded by import path, the tool-call format, safe execution.

Tool-call format (Hermes / Qwen chat templates): the model writes, anywhere in its turn,

    <tool_call>{"name": "calculator", "arguments": {"expression": "123*456"}}</tool_call>

one tag per call (several per turn are allowed). ``arguments`` is a JSON object (a JSON string
holding an object is accepted too, as OpenAI's API sends it). Whatever goes wrong with a call — a
tag whose body is not that JSON, an unterminated tag, an unknown tool, arguments that fail the
tool's JSON schema, a tool that raises or runs past its timeout — becomes an ``error: ...`` tool
message the model sees next turn, with the failure counted by kind; nothing here raises into the
rollout.
"""

from __future__ import annotations

import ast
import asyncio
import functools
import inspect
import json
import math
import operator
import re
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema

from rlstage.engines.modpath import import_module
from rlstage.engines.registry import Registry
from rlstage.schemas.config import CALCULATOR_PATHS  # noqa: F401  re-exported: the tools' own names

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.S)
# verl's tools_kwargs may nest the per-sample arguments under these keys (BaseTool.create / execute).
_VERL_KWARGS_KEYS = {"create_kwargs", "execute_kwargs", "calc_reward_kwargs", "release_kwargs"}

# Outcome kinds of one call; every kind but "ok" counts as an error.
OK, MALFORMED, UNKNOWN, INVALID_ARGUMENTS, RAISED, TIMEOUT, LIMIT = (
    "ok", "malformed", "unknown_tool", "invalid_arguments", "raised", "timeout", "limit",
)  # fmt: skip


class ToolConfigError(ValueError):
    """A tool declaration that cannot work: the message is one line."""


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict  # JSON schema of the arguments object
    fn: Callable[..., Any]
    timeout_s: float

    @functools.cached_property
    def validator(self) -> Any:
        # Built once: jsonschema.validate re-checks the schema on every call (~2 ms, which starves the event loop).
        return jsonschema.validators.validator_for(self.parameters)(self.parameters)

    @property
    def is_async(self) -> bool:
        call = type(self.fn).__call__ if not inspect.isroutine(self.fn) else None  # an object with async __call__
        return inspect.iscoroutinefunction(self.fn) or (call is not None and inspect.iscoroutinefunction(call))

    def openai_schema(self) -> dict:
        """The OpenAI function-tool form that chat templates render into the prompt."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


# ---------------------------------------------------------------- loading


# Tools a config names by a plain name (``callable: calculator``) instead of an import path; a plugin registers more.
TOOLS: Registry[Callable[..., Any]] = Registry("tool")


def register_tool(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register a sync or async tool function under ``name`` (``agent.tools.<i>.callable: name``)."""
    return TOOLS.register(name)


def resolve_callable(path: str) -> Callable[..., Any]:
    """A registered tool's name, or ``package.module:attr`` (or ``package.module.attr``) -> the callable;
    ToolConfigError otherwise."""
    if ":" not in path and "." not in path:
        try:
            return TOOLS.entry(path).obj
        except ValueError as err:
            raise ToolConfigError(f"{err} (or an import path, package.module:function)") from None
    if ":" in path:
        module_name, qualname = path.split(":", 1)
    elif "." in path:
        module_name, qualname = path.rsplit(".", 1)
    else:
        raise ToolConfigError(f"{path!r} is not an import path (write package.module:function)")
    try:
        obj: Any = import_module(module_name)
    except Exception as err:  # ImportError, or whatever the module raised while importing
        raise ToolConfigError(f"cannot import {path!r}: {type(err).__name__}: {err}") from None
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ToolConfigError(f"cannot import {path!r}: module {module_name!r} has no attribute {qualname!r}") from None
    if not callable(obj):
        raise ToolConfigError(f"{path!r} is not callable (a {type(obj).__name__})")
    return obj


def check_parameters_schema(schema: Any) -> None:
    """Arguments are a JSON object, so the schema must be a valid JSON schema of ``type: object``."""
    if not isinstance(schema, dict):
        raise ToolConfigError(f"parameters must be a JSON-schema object, got {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as err:
        where = "/".join(str(p) for p in err.absolute_path) or "<top>"
        raise ToolConfigError(f"not a valid JSON schema at {where}: {err.message}") from None
    if schema.get("type") != "object":
        raise ToolConfigError(f"parameters must have type 'object' (tool arguments are a JSON object), got {schema.get('type')!r}")


def load_tools(declared: list[Any], default_timeout_s: float) -> dict[str, ToolSpec]:
    """Config ``agent.tools`` entries (name, description, parameters, callable, timeout_s) -> specs by name."""
    out: dict[str, ToolSpec] = {}
    for t in declared:
        check_parameters_schema(t.parameters)
        out[t.name] = ToolSpec(
            name=t.name,
            description=t.description,
            parameters=t.parameters,
            fn=resolve_callable(t.callable),
            timeout_s=t.timeout_s or default_timeout_s,
        )
    return out


def _as_obj(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value) if value.strip() else None
        except json.JSONDecodeError:
            return None
    return value


@dataclass
class SampleTools:
    """What one sample may call: the offered specs and the hidden per-sample keyword arguments."""

    tools: dict[str, ToolSpec]
    kwargs: dict[str, dict] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)  # tool names the row asked for that no config declares

    def schemas(self) -> list[dict]:
        return [s.openai_schema() for s in self.tools.values()]


def sample_tools(configured: Mapping[str, ToolSpec], extra_info: Any) -> SampleTools:
    """Per-sample tools from a data row's ``extra_info``.

    * ``tools`` (an OpenAI-style list, as a verl parquet's ``tools`` column lands in extra_info):
      which configured tools this sample is offered, with the row's ``description`` / ``parameters``
      replacing the configured ones; without it every configured tool is offered.
    * ``tools_kwargs`` (verl): ``{tool: {"create_kwargs": {...}, "execute_kwargs": {...}}}`` or
      ``{tool: {kwarg: value}}`` — keyword arguments passed to the callable that the model never sees
      (e.g. the ground truth a checker needs); they override model arguments of the same name.

    When both are present the ``tools`` column decides what is offered: ``tools_kwargs`` entries for
    tools it does not list are ignored.
    """
    info = _as_obj(extra_info) or {}
    if not isinstance(info, dict):
        info = {}
    offered: dict[str, ToolSpec] = dict(configured)
    ignored: list[str] = []
    listed = _as_obj(info.get("tools"))
    if isinstance(listed, list):
        offered = {}
        for entry in listed:
            fn = entry.get("function", entry) if isinstance(entry, dict) else None
            name = fn.get("name") if isinstance(fn, dict) else None
            if not isinstance(name, str):
                continue
            if name not in configured:
                ignored.append(name)
                continue
            spec = configured[name]
            params = fn.get("parameters")
            try:
                check_parameters_schema(params)
            except ToolConfigError:
                params = spec.parameters  # a row with no (or a broken) schema keeps the configured one
            offered[name] = ToolSpec(name, fn.get("description") or spec.description, params, spec.fn, spec.timeout_s)
    kwargs: dict[str, dict] = {}
    raw = _as_obj(info.get("tools_kwargs"))
    if isinstance(raw, dict):
        for name, value in raw.items():
            if name not in offered or not isinstance(value, dict):
                continue
            if value and set(value) <= _VERL_KWARGS_KEYS:
                merged: dict = {}
                for key in ("create_kwargs", "execute_kwargs"):
                    merged.update(value.get(key) or {})
                kwargs[name] = merged
            else:
                kwargs[name] = dict(value)
    return SampleTools(offered, kwargs, ignored)


# ---------------------------------------------------------------- parsing


@dataclass(frozen=True)
class ToolCall:
    name: str | None
    arguments: dict | None
    error: str | None = None  # set when the call could not be parsed


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>{...}</tool_call>`` in ``text``, in order; unparseable ones carry ``error``."""
    calls: list[ToolCall] = []
    end = 0
    for m in _CALL.finditer(text):
        end = m.end()
        body = m.group(1).strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as err:
            calls.append(ToolCall(None, None, f"invalid JSON ({err.msg} at column {err.colno})"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ToolCall(None, None, 'expected {"name": <string>, "arguments": {...}}'))
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):  # OpenAI sends arguments as a JSON string
            args = _as_obj(args) if args.strip() else {}
        if not isinstance(args, dict):
            calls.append(ToolCall(obj["name"], None, "arguments must be a JSON object"))
            continue
        calls.append(ToolCall(obj["name"], args))
    if CALL_OPEN in text[end:]:
        calls.append(ToolCall(None, None, f"{CALL_OPEN} without {CALL_CLOSE}"))
    return calls


# ---------------------------------------------------------------- execution


@dataclass(frozen=True)
class ToolOutcome:
    content: str  # the tool message the model sees
    status: str  # OK or the kind of failure
    seconds: float = 0.0  # the tool's own run time (a sync tool's time in its thread, not its wait for one)
    name: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == OK


def _timed_out(spec: ToolSpec, seconds: float) -> ToolOutcome:
    return ToolOutcome(f"error: tool {spec.name} timed out after {spec.timeout_s:g}s", TIMEOUT, seconds, spec.name)


async def _guarded(fn: Callable[..., Any], kwargs: dict) -> tuple[Any, BaseException | None]:
    # The tool's own exceptions (bad keyword arguments included) come back as values, so a
    # TimeoutError it raises is not our timeout.
    try:
        return await fn(**kwargs), None
    except asyncio.CancelledError:
        raise
    except (Exception, SystemExit) as err:  # a tool calling sys.exit is that call's failure
        return None, err


def _run_sync(fn: Callable[..., Any], kwargs: dict) -> tuple[Any, BaseException | None, float]:
    t0 = time.perf_counter()
    try:
        value, err = fn(**kwargs), None
    except (Exception, SystemExit) as exc:
        value, err = None, exc
    return value, err, time.perf_counter() - t0


@functools.lru_cache(maxsize=1)
def _default_executor() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(8, thread_name_prefix="rlstage-tool")


def _render_result(value: Any, max_chars: int) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= max_chars else text[:max_chars] + "...(truncated)"


async def execute_tool_call(
    call: ToolCall, tools: SampleTools, executor: Executor | None = None, max_chars: int = 2048
) -> ToolOutcome:
    """Run one parsed call; every failure comes back as an ``error: ...`` outcome, never as an exception."""
    if call.error is not None and call.name is None:
        return ToolOutcome(f"error: malformed tool call: {call.error}", MALFORMED)
    spec = tools.tools.get(call.name or "")
    if spec is None:
        names = ", ".join(sorted(tools.tools)) or "none"
        return ToolOutcome(f"error: unknown tool {call.name!r} (available: {names})", UNKNOWN, name=call.name)
    if call.error is not None:
        return ToolOutcome(f"error: malformed tool call: {call.error}", MALFORMED, name=spec.name)
    try:
        spec.validator.validate(call.arguments)
    except jsonschema.ValidationError as err:
        return ToolOutcome(f"error: invalid arguments for {spec.name}: {err.message}", INVALID_ARGUMENTS, name=spec.name)
    kwargs = {**(call.arguments or {}), **tools.kwargs.get(spec.name, {})}
    t0 = time.perf_counter()
    if spec.is_async:
        try:
            value, err = await asyncio.wait_for(_guarded(spec.fn, kwargs), spec.timeout_s)
        except TimeoutError:
            return _timed_out(spec, time.perf_counter() - t0)
        seconds = time.perf_counter() - t0
    else:
        job = (executor or _default_executor()).submit(_run_sync, spec.fn, kwargs)
        try:
            value, err, seconds = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(job)), spec.timeout_s)
        except TimeoutError:
            # A busy event loop can notice a finished call late: what counts is the tool's own run time.
            if not (job.done() and job.result()[2] <= spec.timeout_s):
                job.cancel()  # still queued: never runs; already running: its thread cannot be killed, it runs on
                return _timed_out(spec, time.perf_counter() - t0)
            value, err, seconds = job.result()
    if err is not None:
        return ToolOutcome(f"error: tool {spec.name} raised {type(err).__name__}: {err}", RAISED, seconds, spec.name)
    try:
        content = _render_result(value, max_chars)
    except (TypeError, ValueError) as render_err:
        return ToolOutcome(f"error: tool {spec.name} returned an unprintable result: {render_err}", RAISED, seconds, spec.name)
    return ToolOutcome(content, OK, seconds, spec.name)


# ---------------------------------------------------------------- the calculator


class CalculatorError(ValueError):
    pass


_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_CHARS = 256
_MAX_ABS = 10**100  # every intermediate stays below this, so no expression can eat the CPU
_MAX_EXPONENT = 1000


def _check(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result is not finite")
    if abs(value) > _MAX_ABS:
        raise CalculatorError("result too large")
    return value


def _eval_node(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval_node(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _check(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval_node(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval_node(node.left), _eval_node(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > _MAX_EXPONENT or (abs(left) > 1 and abs(right) * math.log10(abs(left)) > 100)):
            raise CalculatorError("exponent too large")
        try:
            return _check(_BINOPS[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result too large") from None
    what = type(node.op).__name__ if isinstance(node, ast.BinOp | ast.UnaryOp) else type(node).__name__
    raise CalculatorError(f"unsupported element {what} (numbers, + - * / // % ** and parentheses only)")


def format_number(value: int | float) -> str:
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.12g}"
    return str(value)


def calculate(expression: str) -> int | float:
    """Arithmetic on numbers with ``+ - * / // % **`` and parentheses, by walking a whitelisted AST.

    ``ast.parse`` only parses; nothing is compiled or evaluated by Python, and names, calls,
    attributes, comparisons and every other node are refused. Magnitudes and exponents are bounded.
    """
    if not isinstance(expression, str):
        raise CalculatorError("expression must be a string")
    if len(expression) > _MAX_CHARS:
        raise CalculatorError(f"expression longer than {_MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalculatorError(f"cannot parse {expression!r}") from None
    return _eval_node(tree)


@register_tool("calculator")
def calculator(expression: str) -> str:
    """The built-in calculator tool: ``{"expression": "123*456"}`` -> ``"56088"``."""
    return format_number(calculate(expression))


CALCULATOR_PARAMETERS: dict = {
    "type": "object",
    "properties": {"expression": {"type": "string", "description": "arithmetic, e.g. 123*456"}},
    "required": ["expression"],
    "additionalProperties": False,
}


# ---------------------------------------------------------------- config-time checks


def resolve_template(value: str | None) -> str | None:
    """``agent.chat_template``: a Jinja template, or the path of a file holding one."""
    if value is None:
        return None
    if "{%" in value or "{{" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ToolConfigError(f"{value!r} is neither a Jinja template nor an existing file")
    return path.read_text()


def agent_tokenizer(cfg: Any) -> Any | None:
    """The tokenizer the run's policy will have: ``model.path``'s, else the tiny kit's (None if unreadable yet)."""
    from rlstage.engines.models.chat import policy_tokenizer

    if cfg.model.path is not None and not Path(cfg.model.path).expanduser().is_dir():
        return None  # check_inputs reports the missing model directory (a .gguf is converted at run start)
    return policy_tokenizer(cfg.model.path)
