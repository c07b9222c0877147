"""Rule-based reward functions, chosen by ``data_source``, and a sandboxed batch scorer.

A reward function is ``fn(response_text, ground_truth, extra_info) -> float``, or verl's
``compute_score(data_source, solution_str, ground_truth, extra_info)`` (recognised by its parameter
names and called by keyword). It may return a dict: its ``score`` is the reward, its other keys
per-sample metrics (verl's ``reward_extra_info``). ``score_batch`` runs them in a long-lived child
process so that a function which raises, hangs or kills its process costs only its own sample
(score 0.0, error recorded), never the batch.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib
import importlib.util
import inspect
import json
import math
import multiprocessing as mp
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING, Any

from rlstage.engines.modpath import import_module
from rlstage.engines.registry import Registry

if TYPE_CHECKING:
    from rlstage.engines.rollout.base import Completion

RewardFn = Callable[[str, str, dict], float]

REWARD_FNS: Registry[RewardFn] = Registry("reward function")

GSM8K_METHODS = ("strict", "flexible")

AnswerFn = Callable[[str, dict], Any]  # (response_text, extra_info) -> the answer (hashable), or None


@dataclass(frozen=True)
class RewardTraits:
    """What a reward function's registration declares besides its scores: what the eval reads of it and which rows
    it scores by default."""

    # the score from which an answer counts correct; None: above 0.5 (GSM8K's 0.1 format credit is not correct)
    correct_at: float | None = None
    # the answer it extracts from a response (what maj@n votes on); None: it extracts none (no maj@n)
    answer: AnswerFn | None = None
    # the rows' data_source values it scores by default (verl's default_compute_score: openai/gsm8k -> gsm8k); one
    # ending in "/*" stands for every source under that prefix (reasoning_gym/*: one scorer for every task)
    data_sources: tuple[str, ...] = ()


def register_reward_fn(
    name: str, *, correct_at: float | None = None, data_sources: tuple[str, ...] = (), answer: AnswerFn | None = None
) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register ``fn`` under ``name``. It must be a module-level function so the scorer can import it.
    ``correct_at``: the score from which the eval counts an answer correct, for a rule whose partial credit can
    pass one half (default: above 0.5). ``data_sources``: the rows' ``data_source`` values it scores by default (a
    source some earlier registration claims keeps its rule; ``"prefix/*"``: every source under the prefix).
    ``answer``: ``(response_text, extra_info) -> answer | None``, the answer maj@n votes on (None: no maj@n)."""
    return REWARD_FNS.register(name, traits=RewardTraits(correct_at, answer, tuple(data_sources)))


def _traits(reward_fn: str | None) -> RewardTraits:
    traits = REWARD_FNS.entry(reward_fn).traits if reward_fn in REWARD_FNS else None
    return traits if isinstance(traits, RewardTraits) else RewardTraits()


def correct_at(reward_fn: str | None) -> float | None:
    """The registered ``correct_at`` of a reward function (None: the default rule, or no rule scored the answer)."""
    return _traits(reward_fn).correct_at


def answer_extractor(reward_fn: str | None) -> AnswerFn | None:
    """The registered answer of a reward function (what maj@n votes on); None: it extracts none."""
    return _traits(reward_fn).answer


def answer_extractors() -> list[str]:
    """The registered reward functions that extract an answer, in registration order."""
    return [name for name in REWARD_FNS if answer_extractor(name) is not None]


def data_source_fns() -> dict[str, str]:
    """data_source (or ``prefix/*``) -> the reward function that scores it by default, from the registrations'
    ``data_sources`` (the first registration of a source keeps it: a built-in source keeps its rule)."""
    out: dict[str, str] = {}
    for name in REWARD_FNS:
        for source in _traits(name).data_sources:
            out.setdefault(source, name)
    return out


def registered_fn(data_source: str) -> str | None:
    """The reward function registered for ``data_source`` (its own name first, then a ``prefix/*``); None: none."""
    fns = data_source_fns()
    if data_source in fns:
        return fns[data_source]
    for source, name in fns.items():
        if source.endswith("/*") and data_source.startswith(source[:-1]):
            return name
    return None


def default_reward_fn(data_source: str, by_data_source: dict[str, str] | None = None) -> str:
    """The reward function name for a ``data_source``: the config's own mapping (``reward.by_data_source``) first,
    then the registered one."""
    if by_data_source and data_source in by_data_source:
        return by_data_source[data_source]
    name = registered_fn(data_source)
    if name is None:
        raise ValueError(
            f"no reward function for data_source {data_source!r} (known: {', '.join(sorted(data_source_fns()))}); "
            f"map it with reward.by_data_source ({{{data_source}: gsm8k}}), or set reward.function to one of: "
            f"{', '.join(sorted(REWARD_FNS))} or module:function"
        )
    return name


# ---------------------------------------------------------------- reward functions

# Generated text may still carry end-of-sequence markers when decoded without skipping special tokens.
_EOS_MARKERS = ("<eos>", "</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>")


def exact_match_answer(response_text: str, extra_info: dict) -> str:
    """The answer ``exact_match`` compares: the first token, cut at the first eos marker or whitespace."""
    text = response_text.strip()
    markers = _EOS_MARKERS + ((extra_info["eos_token"],) if extra_info.get("eos_token") else ())
    for marker in markers:
        text = text.split(marker, 1)[0]
    parts = text.split(None, 1)
    return parts[0] if parts else ""


@register_reward_fn("exact_match", data_sources=("synthetic/addition", "synthetic/multiply"), answer=exact_match_answer)
def exact_match(response_text: str, ground_truth: str, extra_info: dict) -> float:
    """1.0 when the response's first token (cut at the first eos marker or whitespace) equals the ground truth."""
    return 1.0 if exact_match_answer(response_text, extra_info) == ground_truth.strip() else 0.0


# Like verl, only the tail is searched: answers come last, and regexes on huge strings are slow.
_GSM8K_CLIP_CHARS = 300
# verl's gsm8k patterns: digits, dots and commas, an optional minus; strict needs "#### " before it.
_VERL_NUMBER = r"-?[0-9.,]+"
_VERL_STRICT = re.compile("#### (" + _VERL_NUMBER + ")")
_VERL_FLEXIBLE = re.compile("(" + _VERL_NUMBER + ")")


def verl_gsm8k_answer(text: str, method: str = "strict") -> str | None:
    """verl's ``extract_solution``: the last ``#### <number>`` without ``,``/``$`` (strict), or the last
    number-like run that is not a lone ``.``, as written (flexible)."""
    if method not in GSM8K_METHODS:
        raise ValueError(f"unknown gsm8k method {method!r}; valid: {', '.join(GSM8K_METHODS)}")
    tail = text[-_GSM8K_CLIP_CHARS:]
    if method == "strict":
        found = _VERL_STRICT.findall(tail)
        return found[-1].replace(",", "").replace("$", "") if found else None
    found = _VERL_FLEXIBLE.findall(tail)
    valid = [m for m in found if m not in ("", ".")]
    # As verl's loop: when every match is a lone ".", the first match is what it ends on.
    return valid[-1] if valid else (found[0] if found else None)


@register_reward_fn("gsm8k", data_sources=("openai/gsm8k",))
def gsm8k(
    response_text: str,
    ground_truth: str,
    extra_info: dict,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """verl's gsm8k ``compute_score`` (ReFT, Trung et al. 2024): ``score`` when the extracted answer equals
    the ground truth as a string, ``format_score`` when an answer is extracted but differs, else 0."""
    answer = verl_gsm8k_answer(response_text, method)
    if answer is None:
        return 0.0
    return score if answer == ground_truth else format_score


# rlstage's own gsm8k comparison: "$1,234.50" and "1234.5" are the same number.
_NUMBER = r"-?\$?\d[\d,]*(?:\.\d+)?"
_STRICT = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")
_FLEXIBLE = re.compile(_NUMBER)


def _clean_number(s: str) -> str:
    return s.replace(",", "").replace("$", "").strip()


def extract_gsm8k_answer(text: str, method: str = "strict") -> str | None:
    """The final answer in ``text``: the last ``#### <number>`` (strict) or the last number (flexible)."""
    if method not in GSM8K_METHODS:
        raise ValueError(f"unknown gsm8k method {method!r}; valid: {', '.join(GSM8K_METHODS)}")
    tail = text[-_GSM8K_CLIP_CHARS:]
    found = (_STRICT if method == "strict" else _FLEXIBLE).findall(tail)
    return _clean_number(found[-1]) if found else None


def _same_number(answer: str | None, ground_truth: str) -> bool:
    if answer is None:
        return False
    truth = _clean_number(ground_truth)
    if answer == truth:
        return True
    try:  # "72.00" and "72" are the same answer
        return Decimal(answer) == Decimal(truth)
    except InvalidOperation:
        return False


_LAST_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def reasoning_gym_answer(response_text: str, answer_from: str = "last_number") -> str:
    """What a reasoning-gym checker is given: the response's last number (commas dropped), or the whole response."""
    text = response_text.strip()
    if answer_from == "whole":
        return text
    found = _LAST_NUMBER.findall(text[-_GSM8K_CLIP_CHARS:])
    return found[-1].replace(",", "") if found else text


# correct only at full credit: the checkers give partial credit to an answer that contains the truth (products:
# 645 answered 6450 scores 0.75)
@register_reward_fn("reasoning_gym", correct_at=1.0, data_sources=("reasoning_gym/*",))
def reasoning_gym_score(response_text: str, ground_truth: str, extra_info: dict) -> float:
    """The reasoning-gym task's own checker (``score_answer``) on the extracted answer, with the entry as
    generated (``extra_info["entry"]``, written by the data source)."""
    import reasoning_gym

    entry = extra_info.get("entry")
    task = extra_info.get("task")
    if not isinstance(entry, dict) or task not in reasoning_gym.factory.DATASETS:
        raise ValueError("a reasoning_gym row needs extra_info.task (a reasoning-gym task) and extra_info.entry")
    score = reasoning_gym.get_score_answer_fn(task)(reasoning_gym_answer(response_text, extra_info.get("answer_from", "last_number")), entry)
    return float(score)


@register_reward_fn("gsm8k_strict", answer=lambda text, extra: extract_gsm8k_answer(text, "strict"))
def gsm8k_strict(response_text: str, ground_truth: str, extra_info: dict) -> float:
    """rlstage's numeric gsm8k reward: 1.0 when the last ``#### <number>`` is the ground truth's number."""
    return 1.0 if _same_number(extract_gsm8k_answer(response_text, "strict"), ground_truth) else 0.0


@register_reward_fn("gsm8k_flexible", answer=lambda text, extra: extract_gsm8k_answer(text, "flexible"))
def gsm8k_flexible(response_text: str, ground_truth: str, extra_info: dict) -> float:
    """rlstage's numeric gsm8k reward: 1.0 when the last number in the response is the ground truth's."""
    return 1.0 if _same_number(extract_gsm8k_answer(response_text, "flexible"), ground_truth) else 0.0


# ---------------------------------------------------------------- the sandboxed scorer


@dataclass(frozen=True)
class RewardResult:
    score: float
    reward_fn: str
    error: str | None = None
    metrics: dict | None = None  # a dict return's other keys (verl's reward_extra_info)


# A function reference the child can import: (module name, qualified name, source file or None).
_Ref = tuple[str, str, str | None]
_MARGIN_S = 2.0  # grace beyond timeout_s before the parent declares the child stuck
_CHUNK = 512  # samples per message to the child: few IPC round trips for thousands of samples
_FLUSH_S = 0.1  # the child sends finished results at least this often, so a crash loses little work
_START_TIMEOUT_S = 120.0
# The largest reward the rewards table's float32 column holds (agents' rewards too): beyond it a score is stored as inf.
FLOAT32_MAX = 3.4028234663852886e38
# verl's reward signature: compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)
VERL_PARAMS = ("data_source", "solution_str", "ground_truth", "extra_info")


class _RewardTimeout(BaseException):
    """Raised by SIGALRM; a BaseException so that ``except Exception`` in a reward function can't swallow it."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise _RewardTimeout


def _load_ref(ref: _Ref) -> RewardFn:
    module_name, qualname, file = ref
    try:
        module = import_module(module_name)
    except ModuleNotFoundError:
        if not file:
            raise
        # Modules outside sys.path (e.g. pytest test files) are loaded from their file.
        spec = importlib.util.spec_from_file_location(module_name, file)
        if spec is None or spec.loader is None:
            raise
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{module_name}:{qualname} is not callable")
    return obj


def verl_style(fn: Callable) -> frozenset[str] | None:
    """The keywords a reward function with verl's signature takes (it names ``solution_str``), or None: it is called
    positionally as ``fn(response_text, ground_truth, extra_info)``."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        return None
    if "solution_str" not in params:
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return frozenset(VERL_PARAMS)
    return frozenset(n for n in VERL_PARAMS if n in params)


def _extra_value(value: Any) -> float | str | None:
    """A dict return's other value as a per-sample metric: numbers as floats, anything else as its text."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool | int | float):
        return float(value)
    return str(value)


def _score_one(
    fn: RewardFn,
    response: str,
    truth: str,
    extra: Any,
    timeout_s: float,
    kwargs: dict | None = None,
    data_source: str = "",
    verl: frozenset[str] | None = None,
) -> tuple[float, str | None, dict | None]:
    try:
        # Re-installed every call: a reward function may have replaced the handler.
        signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            info = json.loads(extra) if isinstance(extra, str) else (extra or {})
            if not isinstance(info, dict):
                raise ValueError(f"extra_info must be a JSON object, got {type(info).__name__}")
            if verl is not None:  # verl's reward manager calls it by keyword, with the sample's data_source
                given = {"data_source": data_source, "solution_str": response, "ground_truth": truth, "extra_info": info}
                value = fn(**{k: v for k, v in given.items() if k in verl}, **(kwargs or {}))
            else:
                value = fn(response, truth, info, **(kwargs or {}))
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        metrics = None
        if isinstance(value, dict):  # verl-style functions may return {"score": ..., "acc": ..., ...}
            if "score" not in value:
                raise ValueError(f"a reward returned as a dict needs a 'score' key, got keys {sorted(value)[:5]}")
            metrics = {str(k): _extra_value(v) for k, v in value.items() if k != "score"} or None
            value = value["score"]
        score = float(value)
        if not math.isfinite(score) or abs(score) > FLOAT32_MAX:
            raise ValueError(f"reward is not a finite float32: {score}")
        return score, None, metrics
    except _RewardTimeout:
        return 0.0, f"timeout after {timeout_s}s", None
    except BaseException as err:  # SystemExit and friends from a reward function are that sample's failure
        return 0.0, f"{type(err).__name__}: {err}", None


def _child_main(conn: Any, progress: Any) -> None:
    """The scorer process: score chunks of samples, bumping ``progress`` after each so the parent can watch."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when scoring stops
    fns: dict[_Ref, tuple[RewardFn, frozenset[str] | None] | BaseException] = {}
    conn.send("ready")
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # the parent went away
        if msg is None:
            return
        refs, tasks, timeout_s = msg
        out: list[tuple[float, str | None, dict | None]] = []
        last_flush = time.monotonic()
        for i, (ref_index, response, truth, extra, kwargs, source) in enumerate(tasks):
            ref = refs[ref_index]
            if ref not in fns:
                # Imported outside the timer (a half-imported module would poison later samples); the
                # parent's per-sample deadline still bounds it.
                try:
                    loaded = _load_ref(ref)
                    fns[ref] = (loaded, verl_style(loaded))
                except BaseException as err:
                    fns[ref] = err
            got = fns[ref]
            if isinstance(got, BaseException):
                out.append((0.0, f"{type(got).__name__}: cannot load reward function {ref[0]}:{ref[1]}: {got}", None))
            else:
                out.append(_score_one(got[0], response, truth, extra, timeout_s, kwargs, source, got[1]))
            progress.value = i + 1
            if time.monotonic() - last_flush > _FLUSH_S:
                conn.send(out)
                out, last_flush = [], time.monotonic()
        conn.send(out)


class _Worker:
    """One long-lived scorer child process, restarted when it dies or stops answering."""

    def __init__(self) -> None:
        self.proc: Any = None
        self.conn: Any = None
        self.progress: Any = None
        self.owner = os.getpid()

    def alive(self) -> bool:
        return self.proc is not None and self.owner == os.getpid() and self.proc.is_alive()

    def start(self) -> None:
        self.stop()
        ctx = mp.get_context("spawn")  # spawn: no inherited locks, CUDA state or threads from the trainer
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        progress = ctx.RawValue(ctypes.c_long, 0)
        proc = ctx.Process(
            target=_child_main, args=(child_conn, progress), name="rlstage-reward-scorer", daemon=True
        )
        try:
            proc.start()
        finally:
            child_conn.close()
        self.proc, self.conn, self.progress, self.owner = proc, parent_conn, progress, os.getpid()
        if not self.conn.poll(_START_TIMEOUT_S):
            self.stop()
            raise RuntimeError(f"reward scorer process did not start within {_START_TIMEOUT_S}s")
        try:
            self.conn.recv()
        except EOFError:
            proc.join(5)
            self.stop()
            raise RuntimeError(
                f"reward scorer process died on startup (exit code {proc.exitcode}); under the spawn "
                "start method the main module must guard its entry point with if __name__ == '__main__'"
            ) from None

    def stop(self) -> None:
        if self.proc is not None and self.owner == os.getpid():
            if self.proc.is_alive():
                try:
                    self.conn.send(None)
                except OSError:
                    pass
                self.proc.join(0.5)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)
            if self.conn is not None:
                self.conn.close()
        # After a fork the handles belong to the parent's child: forget them without touching it.
        self.proc = self.conn = self.progress = None

    def kill(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.stop()

    def run_chunk(
        self, refs: list[_Ref], tasks: list[tuple], timeout_s: float
    ) -> tuple[list[tuple[float, str | None, dict | None]], int | None, str]:
        """Score ``tasks`` in order until done or the child fails.

        Returns the results received (a prefix of ``tasks``) and, if the child failed, the index of the
        sample it was on and what happened; samples between the two were finished but lost with the child.
        """
        if not self.alive():
            self.start()
        self.progress.value = 0
        try:
            self.conn.send((refs, tasks, timeout_s))
        except OSError:  # it died between chunks (killed from outside, say): one fresh start, then give up
            self.start()
            self.progress.value = 0
            self.conn.send((refs, tasks, timeout_s))
        results: list[tuple[float, str | None, dict | None]] = []
        seen, seen_at = 0, time.monotonic()
        limit = timeout_s + _MARGIN_S
        while len(results) < len(tasks):
            if self.conn.poll(0.05):
                try:
                    results.extend(self.conn.recv())
                    continue
                except (EOFError, OSError):
                    self.proc.join(1.0)  # the pipe closed: let the exit land instead of spinning on poll
            done = self.progress.value
            now = time.monotonic()
            if done != seen:
                seen, seen_at = done, now
            if not self.proc.is_alive():
                failure = f"reward scorer process died (exit code {self.proc.exitcode})"
            elif now - seen_at > limit:
                failure = f"timeout after {timeout_s}s (scorer process unresponsive for {limit:.1f}s, killed)"
            else:
                continue
            self.kill()
            # Only the sample it was on is blamed (the last one if it died after finishing them all).
            return results, min(done, len(tasks) - 1), failure
        return results, None, ""


_POOL_LOCK = threading.Lock()
_POOL: list[_Worker] = []


def _ref_for(name: str) -> _Ref:
    if ":" in name:  # an import path "pkg.module:function" or "/path/to/file.py:function"
        target, qualname = name.rsplit(":", 1)
        if target.endswith(".py"):
            stem = os.path.splitext(os.path.basename(target))[0]
            return (f"_rlstage_reward_{stem}", qualname, os.path.abspath(target))
        return (target, qualname, None)
    fn = REWARD_FNS.get(name)
    if fn is None:
        raise ValueError(f"unknown reward function {name!r}; valid: {', '.join(sorted(REWARD_FNS))}")
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or "<" in qualname:
        raise ValueError(
            f"reward function {name!r} ({qualname}) is not a module-level function, so the scorer "
            "process cannot import it"
        )
    return (module, qualname, getattr(sys.modules.get(module), "__file__", None))


def check_reward_fn(name: str) -> None:
    """Raise ValueError (one line) unless ``name`` is a registered reward function or an import path that resolves."""
    ref = _ref_for(name)
    if ":" in name:
        if ref[2] is not None and not os.path.isfile(ref[2]):
            raise ValueError(f"reward function file {ref[2]} does not exist")
        try:
            _load_ref(ref)
        except Exception as err:  # whatever the module raised while importing
            raise ValueError(f"cannot load reward function {name!r}: {type(err).__name__}: {err}") from None


class RewardFailure(RuntimeError):
    """Too many samples of a batch failed to score: the message is one line quoting the first error."""


def check_failures(results: list[RewardResult], stop_share: float) -> None:
    """Raise RewardFailure when at least ``stop_share`` of ``results`` failed (1.0: all of them)."""
    errors = [r for r in results if r.error is not None]
    if errors and len(errors) >= stop_share * len(results):
        first = errors[0]
        quoted = " ".join(str(first.error).split())[:300]  # one line, whatever the function raised
        raise RewardFailure(
            f"reward function {first.reward_fn} failed on {len(errors)} of {len(results)} samples "
            f"(reward.stop_failure_share={stop_share:g}); first error: {quoted}"
        )


def completion_rows(prompts: list[dict], completions: Sequence[Completion]) -> list[dict]:
    """The rows ``score_batch`` takes, one per completion, its prompt found by ``prompt_index``."""
    return [
        {
            "response_text": c.text,
            "ground_truth": prompts[c.prompt_index]["ground_truth"],
            "data_source": prompts[c.prompt_index]["data_source"],
            "extra_info": prompts[c.prompt_index]["extra_info"],
        }
        for c in completions
    ]


def score_batch(
    rows: list[dict],
    *,
    timeout_s: float,
    function: str | None = None,
    gsm8k_method: str = "strict",
    format_score: float = 0.0,
    by_data_source: dict[str, str] | None = None,
) -> list[RewardResult]:
    """Score rows ``{response_text, ground_truth, data_source, extra_info}`` in order.

    ``function`` forces one reward function (a registered name or an import path ``module:function``);
    otherwise each row's ``data_source`` picks it. Every sample is bounded by ``timeout_s``; a sample
    whose function raises, hangs or crashes the scorer scores 0.0 with its error recorded.
    ``gsm8k_method`` and ``format_score`` are verl's ``gsm8k`` arguments (``reward.*`` in the config).
    """
    if gsm8k_method not in GSM8K_METHODS:
        raise ValueError(f"unknown gsm8k method {gsm8k_method!r}; valid: {', '.join(GSM8K_METHODS)}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    timeout_s = float(timeout_s)
    if function is not None:
        refs_by_name = {function: _ref_for(function)}
        names = [function] * len(rows)
        if ":" in function:  # fail fast on a typo rather than once per sample
            _load_ref(refs_by_name[function])
    else:
        names = [default_reward_fn(row.get("data_source"), by_data_source) for row in rows]
        refs_by_name = {n: _ref_for(n) for n in dict.fromkeys(names)}
    refs = list(refs_by_name.values())
    index_of = {n: refs.index(r) for n, r in refs_by_name.items()}
    gsm8k_kwargs = {"method": gsm8k_method, "format_score": format_score}
    tasks = [
        (
            index_of[n],
            row.get("response_text") or "",
            row.get("ground_truth") or "",
            row.get("extra_info"),
            gsm8k_kwargs if n == "gsm8k" else None,
            row.get("data_source") or "",
        )
        for n, row in zip(names, rows, strict=True)
    ]
    scored: list[tuple[float, str | None, dict | None]] = []
    blamed: dict[int, str] = {}  # row index -> why the scorer process failed on it
    with _POOL_LOCK:
        if not _POOL:
            _POOL.append(_Worker())
        worker = _POOL[0]
        pos = 0
        while pos < len(tasks):
            if pos in blamed:
                scored.append((0.0, blamed[pos], None))
                pos += 1
                continue
            # A chunk stops short of the next blamed sample so that it is never run twice.
            end = min([pos + _CHUNK, len(tasks)] + [i for i in blamed if i > pos])
            results, failed_at, failure = worker.run_chunk(refs, tasks[pos:end], timeout_s)
            if failed_at is not None:
                blamed[pos + failed_at] = failure
            scored.extend(results)
            pos += len(results)
    return [RewardResult(score, name, error, metrics) for (score, error, metrics), name in zip(scored, names, strict=True)]


def shutdown_scorer() -> None:
    """Stop the scorer process (the next ``score_batch`` starts a fresh one)."""
    with _POOL_LOCK:
        for worker in _POOL:
            worker.stop()
        _POOL.clear()


atexit.register(shutdown_scorer)


# ---------------------------------------------------------------- rule + reward model
# How a sample's rule reward (None: its source has no rule) meets its reward-model score.
COMBINE_MODES: dict[str, Callable[[float | None, float], float]] = {
    "replace": lambda rule, rm: rm,
    "add": lambda rule, rm: (rule or 0.0) + rm,
    "rule_first": lambda rule, rm: rm if rule is None else rule,
}


def has_rule(data_source: str, function: str | None, by_data_source: dict[str, str] | None = None) -> bool:
    """Whether a sample has a rule reward: a forced reward.function, the config's mapping, or one registered for its
    source."""
    return (
        function is not None
        or data_source in (by_data_source or {})
        or registered_fn(data_source) is not None
    )


def combine_scores(mode: str, rule: list[float | None], rm: list[float]) -> list[float]:
    try:
        fn = COMBINE_MODES[mode]
    except KeyError:
        raise ValueError(f"unknown reward_model.combine {mode!r}; valid: {', '.join(COMBINE_MODES)}") from None
    return [fn(r, m) for r, m in zip(rule, rm, strict=True)]
