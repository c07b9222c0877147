"""Data preparation engines: every loader returns a table that conforms to ``schemas.artifacts.PROMPTS``.

Sources: a synthetic addition task (the tiny kit's verifiable task), GSM8K jsonl files and
verl-format parquet files. Bad input raises one ``DatasetError`` naming the file and the line (or row).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field

from rlstage.engines.data.verifiers_env import SOURCE as VERIFIERS_SOURCE
from rlstage.engines.data.verifiers_env import VerifiersError, VerifiersSettings, list_tasks
from rlstage.engines.registry import Registry
from rlstage.schemas.artifacts import PROMPTS, conform
from rlstage.schemas.config import KitConfig

ADDITION_SOURCE = "synthetic/addition"
MULTIPLY_SOURCE = "synthetic/multiply"
GSM8K_SOURCE = "openai/gsm8k"
# The instruction verl's gsm8k preprocessing appends, so rewards and prompts match verl's recipes.
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
VERL_REQUIRED_COLUMNS = ("data_source", "prompt", "reward_model")
# data.source -> its loader ``fn(path, split=None, **kw) -> prompts table`` (schemas.artifacts.PROMPTS); a plugin
# registers more. "synthetic" is the tiny kit's task (it needs "kit"): the data prep stage builds it from kit.*.
DATA_SOURCES: Registry[Callable[..., pa.Table]] = Registry("data source")


@dataclass(frozen=True)
class DataSourceTraits:
    """What a data source's registration declares besides its settings."""

    generates: bool = False  # it generates its prompts (both splits) instead of reading data.train_path/test_path


def register_data_source(
    name: str, *, settings: type[BaseModel] | None = None, generates: bool = False, needs: tuple[str, ...] = ()
) -> Callable[[Callable[..., pa.Table]], Callable[..., pa.Table]]:
    """Decorator: register a loader of prompts under ``name`` (a ``data.source``); ``settings``: the model of its
    ``data.source_settings``, passed to it as keyword arguments. ``generates``: it generates its prompts, called
    with ``path=None`` and ``split="train"``/``"test"``, and the config names no files. ``needs=("kit",)``: it is
    built from the tiny kit's settings (kit.*), which the data prep stage then reads."""
    return DATA_SOURCES.register(name, settings=settings, needs=needs, traits=DataSourceTraits(generates))


def generates_prompts(source: str) -> bool:
    """Whether data source ``source`` declares it generates its prompts (no data.train_path/test_path)."""
    traits = DATA_SOURCES.entry(source).traits
    return isinstance(traits, DataSourceTraits) and traits.generates


def uses_kit(source: str) -> bool:
    """Whether data source ``source`` is built from the tiny kit's settings (it declares ``needs=("kit",)``)."""
    return "kit" in DATA_SOURCES.entry(source).needs


@register_data_source("synthetic", generates=True, needs=("kit",))
def _synthetic(path: str | None = None, **kw: Any) -> pa.Table:
    """The addition task's ``split`` ("train"/"test", default "train"), with ``digits``/``train_size``/
    ``test_size``/``seed`` (defaults from ``KitConfig``)."""
    kit = KitConfig()
    split = kw.pop("split", "train")
    if split not in ("train", "test"):
        raise DatasetError(f"synthetic split must be 'train' or 'test', got {split!r}")
    params = {k: kw.pop(k, getattr(kit, k)) for k in ("digits", "train_size", "test_size", "seed")}
    if kw:
        raise TypeError(f"unexpected arguments for the synthetic source: {sorted(kw)}")
    train, test = make_addition_splits(**params)
    return train if split == "train" else test


class DatasetError(ValueError):
    """Unusable input data: the message names the file and, where there is one, the line or row."""


def _to_table(rows: list[dict[str, Any]]) -> pa.Table:
    # Building against the schema directly keeps empty tables and null messages typed.
    return conform(pa.Table.from_pylist(rows, schema=PROMPTS), PROMPTS)


def _json(obj: Any) -> str:
    # default=str keeps exotic parquet values (dates, bytes, decimals) instead of failing the load.
    return json.dumps(obj, ensure_ascii=False, sort_keys=True, default=str)


# ---------------------------------------------------------------- synthetic addition


def addition_problem(a: int, b: int) -> tuple[str, str]:
    """One addition problem: (prompt, answer), e.g. ``("What is 23+58? ", "81")``."""
    return f"What is {a}+{b}? ", str(a + b)


def _addition_table(pairs: Sequence[tuple[int, int]], split: str) -> pa.Table:
    rows = []
    for i, (a, b) in enumerate(pairs):
        prompt, answer = addition_problem(a, b)
        rows.append(
            {
                "prompt_id": f"addition-{split}-{i}",
                "prompt": prompt,
                "messages": None,  # a plain-text task: the tiny kit has no chat template
                "data_source": ADDITION_SOURCE,
                "ground_truth": answer,
                "extra_info": _json({"split": split, "index": i, "a": a, "b": b}),
            }
        )
    return _to_table(rows)


def make_addition_splits(
    digits: int, train_size: int, test_size: int, seed: int
) -> tuple[pa.Table, pa.Table]:
    """Disjoint, deterministic train/test splits of ``a+b`` with operands uniform in ``[0, 10**digits)``."""
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits}")
    if train_size < 0 or test_size < 0:
        raise ValueError(f"sizes must be >= 0, got train_size={train_size}, test_size={test_size}")
    base = 10**digits
    total = base * base
    wanted = train_size + test_size
    if wanted > total:
        raise ValueError(
            f"train_size={train_size} + test_size={test_size} = {wanted} distinct (a, b) pairs requested, "
            f"but only {total} exist for digits={digits}"
        )
    # Sampling pair indices without replacement makes the splits disjoint by construction; range() is lazy.
    picks = random.Random(seed).sample(range(total), wanted)
    pairs = [divmod(k, base) for k in picks]
    return _addition_table(pairs[:train_size], "train"), _addition_table(pairs[train_size:], "test")


# ---------------------------------------------------------------- synthetic multiplication (a tool task)


def multiply_question(a: int, b: int) -> str:
    return f"What is {a}*{b}?"


def _multiply_table(pairs: Sequence[tuple[int, int]], split: str) -> pa.Table:
    from rlstage.engines.models.tinykit import build_char_tokenizer

    kit_tokenizer = build_char_tokenizer()
    rows = []
    for i, (a, b) in enumerate(pairs):
        messages = [{"role": "user", "content": multiply_question(a, b)}]
        rows.append(
            {
                "prompt_id": f"multiply-{split}-{i}",
                # The text the kit's SFT trains on is what rollouts render from the messages (its chat template).
                "prompt": render_messages(messages, kit_tokenizer),
                "messages": messages,
                "data_source": MULTIPLY_SOURCE,
                "ground_truth": str(a * b),
                "extra_info": _json({"split": split, "index": i, "a": a, "b": b}),
            }
        )
    return _to_table(rows)


def make_multiply_splits(
    digits: int, train_size: int, test_size: int, seed: int
) -> tuple[pa.Table, pa.Table]:
    """Disjoint train/test splits of ``a*b`` with both operands exactly ``digits`` digits long.

    The tiny model cannot multiply 3-digit numbers in its head; with the calculator tool it only
    has to copy the operands into a call and the result into its answer (configs/agent_calc.yaml).
    """
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits}")
    low = 10 ** (digits - 1) if digits > 1 else 0
    span = 10**digits - low
    wanted = train_size + test_size
    if wanted > span * span:
        raise ValueError(f"{wanted} distinct (a, b) pairs requested, but only {span * span} exist for digits={digits}")
    picks = random.Random(seed).sample(range(span * span), wanted)
    pairs = [(low + k // span, low + k % span) for k in picks]
    return _multiply_table(pairs[:train_size], "train"), _multiply_table(pairs[train_size:], "test")


def make_task_splits(task: str, digits: int, train_size: int, test_size: int, seed: int) -> tuple[pa.Table, pa.Table]:
    """The kit's synthetic task by name (``kit.task``): "addition" or "multiply"."""
    if task == "addition":
        return make_addition_splits(digits, train_size, test_size, seed)
    if task == "multiply":
        return make_multiply_splits(digits, train_size, test_size, seed)
    raise ValueError(f"unknown synthetic task {task!r}; valid: addition, multiply")


# ---------------------------------------------------------------- GSM8K


def _check_file(path: str | Path) -> Path:
    p = Path(path)
    if not p.exists():
        raise DatasetError(f"{p}: file does not exist")
    if not p.is_file():
        raise DatasetError(f"{p}: not a file")
    if p.stat().st_size == 0:
        raise DatasetError(f"{p}: file is empty")
    return p


def gsm8k_ground_truth(answer: str) -> str | None:
    """The final answer after ``####`` with thousands separators removed, or None without a marker."""
    if "####" not in answer:
        return None
    return answer.split("####")[-1].replace(",", "").strip()


def _jsonl_objects(p: Path) -> list[tuple[int, dict[str, Any]]]:
    """A JSONL file's objects with their line numbers; one DatasetError naming the line for anything else."""
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise DatasetError(f"{p}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    out = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue  # blank lines (a trailing newline, say) are not rows
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise DatasetError(f"{p}:{lineno}: invalid JSON ({err.msg} at column {err.colno})") from None
        if not isinstance(obj, dict):
            raise DatasetError(f"{p}:{lineno}: expected a JSON object, got {type(obj).__name__}")
        out.append((lineno, obj))
    return out


@register_data_source("gsm8k")
def load_gsm8k(path: str, split: str | None = None) -> pa.Table:
    """GSM8K jsonl rows ``{"question", "answer"}`` -> prompts; ``split`` defaults to the file's stem."""
    p = _check_file(path)
    split = split or p.stem
    rows = []
    for lineno, obj in _jsonl_objects(p):
        for key in ("question", "answer"):
            if not isinstance(obj.get(key), str) or not obj[key].strip():
                raise DatasetError(f"{p}:{lineno}: row has no {key!r} (a non-empty string is required)")
        truth = gsm8k_ground_truth(obj["answer"])
        if truth is None:
            raise DatasetError(f"{p}:{lineno}: answer has no '####' final-answer marker")
        if not truth:
            raise DatasetError(f"{p}:{lineno}: answer has nothing after '####'")
        index = len(rows)
        prompt = f"{obj['question']} {GSM8K_INSTRUCTION}"
        rows.append(
            {
                "prompt_id": f"gsm8k-{split}-{index}",
                "prompt": prompt,
                "messages": [{"role": "user", "content": prompt}],
                "data_source": GSM8K_SOURCE,
                "ground_truth": truth,
                "extra_info": _json(
                    {"split": split, "index": index, "question": obj["question"], "answer": obj["answer"]}
                ),
            }
        )
    if not rows:
        raise DatasetError(f"{p}: file is empty (no rows)")
    return _to_table(rows)


# ---------------------------------------------------------------- verl-format parquet


def render_messages(messages: Sequence[dict[str, Any]], tokenizer: Any = None) -> str:
    """Chat messages -> prompt text: the tokenizer's chat template when it has one, else ``role: content`` lines."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


def _messages(value: Any, where: str) -> list[dict[str, str]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]  # some exports keep a bare string prompt
    if value is None or not isinstance(value, list | tuple) or not value:
        raise DatasetError(f"{where}: 'prompt' must be a non-empty list of chat messages")
    out = []
    for m in value:
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise DatasetError(f"{where}: every 'prompt' message needs string 'role' and 'content'")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _as_dict(value: Any, where: str, column: str) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, str):  # extra_info stored as a JSON string
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as err:
            raise DatasetError(f"{where}: {column!r} is not valid JSON ({err.msg})") from None
    if isinstance(value, list) and all(isinstance(kv, tuple) and len(kv) == 2 for kv in value):
        value = dict(value)  # Arrow map columns come back as (key, value) pairs
    if not isinstance(value, dict):
        raise DatasetError(f"{where}: {column!r} must be a struct/dict, got {type(value).__name__}")
    return value


@register_data_source("verl_parquet")
def load_verl_parquet(path: str, split: str | None = None) -> pa.Table:
    """A verl RL parquet (data_source, prompt, ability, reward_model, extra_info) -> prompts."""
    p = _check_file(path)
    split = split or p.stem
    try:
        table = pq.read_table(p)
    except (pa.ArrowException, OSError) as err:
        raise DatasetError(f"{p}: not a readable parquet file ({err})") from None
    missing = [c for c in VERL_REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise DatasetError(f"{p}: missing columns {missing} (has {table.column_names})")
    if table.num_rows == 0:
        raise DatasetError(f"{p}: file is empty (no rows)")
    known = {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    rows = []
    for index, rec in enumerate(table.to_pylist()):
        where = f"{p}: row {index}"
        source = rec["data_source"]
        if not isinstance(source, str) or not source:
            raise DatasetError(f"{where}: 'data_source' must be a non-empty string")
        messages = _messages(rec["prompt"], where)
        reward_model = _as_dict(rec["reward_model"], where, "reward_model")
        truth = reward_model.get("ground_truth")
        if truth is None:
            raise DatasetError(f"{where}: 'reward_model' has no 'ground_truth'")
        if isinstance(truth, str) and not truth.strip():  # nothing to score against: refused, not a silent 0
            raise DatasetError(f"{where}: 'reward_model.ground_truth' is empty (a row without its answer)")
        extra = _as_dict(rec.get("extra_info"), where, "extra_info")
        # Everything verl carries beside the prompt (ability, reward style, extra columns) stays in extra_info.
        if rec.get("ability") is not None:
            extra.setdefault("ability", rec["ability"])
        if reward_model.get("style") is not None:
            extra.setdefault("reward_style", reward_model["style"])
        for col in table.column_names:
            if col not in known:
                extra.setdefault(col, rec[col])
        rows.append(
            {
                "prompt_id": f"verl-{split}-{index}",
                "prompt": render_messages(messages),
                "messages": messages,
                "data_source": source,
                "ground_truth": truth if isinstance(truth, str) else _json(truth),
                "extra_info": _json(extra),
            }
        )
    return _to_table(rows)


# ---------------------------------------------------------------- your own prompts: JSONL or Parquet


class ColumnSettings(BaseModel):
    """``data.source_settings`` of ``data.source: jsonl`` / ``parquet``: which columns of your file hold what."""

    model_config = ConfigDict(extra="forbid")
    prompt_column: str = Field("prompt", description="the prompt: a string, or a list of chat messages {role, content}")
    answer_column: str = Field("answer", description="the reference answer the reward compares against (verl's ground_truth)")
    data_source: str = Field(
        "user", description="the rows' data_source: metrics are grouped by it and a registered reward may be chosen by it"
    )
    instruction: str = Field("", description="appended to each string prompt (e.g. \"Give only the final answer.\")")


def _records(p: Path) -> list[dict[str, Any]]:
    if p.suffix == ".parquet":
        try:
            return pq.read_table(p).to_pylist()
        except (pa.ArrowException, OSError) as err:
            raise DatasetError(f"{p}: not a readable parquet file ({err})") from None
    return [obj for _, obj in _jsonl_objects(p)]


def load_columns(path: str, split: str | None = None, **settings: Any) -> pa.Table:
    """Your own prompts file (JSONL, or Parquet by its ``.parquet`` suffix): a prompt and an answer column,
    named in ``data.source_settings``; every other column is kept in ``extra_info``."""
    s = ColumnSettings.model_validate(settings)
    p = _check_file(path)
    split = split or p.stem
    rows = []
    for index, rec in enumerate(_records(p)):
        where = f"{p}: row {index + 1}"
        for column in (s.prompt_column, s.answer_column):
            if rec.get(column) is None or (isinstance(rec.get(column), str) and not rec[column].strip()):
                raise DatasetError(f"{where}: no {column!r} column (data.source_settings names it; the row has {sorted(rec)})")
        prompt = rec[s.prompt_column]
        if isinstance(prompt, str):
            prompt = f"{prompt} {s.instruction}".strip()
        messages = _messages(prompt, where)
        answer = rec[s.answer_column]
        extra = {k: v for k, v in rec.items() if k not in (s.prompt_column, s.answer_column)}
        rows.append(
            {
                "prompt_id": f"{s.data_source}-{split}-{index}",
                "prompt": render_messages(messages),
                "messages": messages,
                "data_source": s.data_source,
                "ground_truth": answer if isinstance(answer, str) else _json(answer),
                "extra_info": _json({"split": split, "index": index, **extra}),
            }
        )
    if not rows:
        raise DatasetError(f"{p}: file is empty (no rows)")
    return _to_table(rows)


DATA_SOURCES.add("jsonl", load_columns, settings=ColumnSettings)
DATA_SOURCES.add("parquet", load_columns, settings=ColumnSettings)


# ---------------------------------------------------------------- prompt length


def drop_overlong(
    table: pa.Table, tokenizer: Any, max_prompt_length: int, refuse_in: str | None = None
) -> tuple[pa.Table, int]:
    """Rows whose rendered prompt (``engines.models.chat.render_prompt_ids``) fits ``max_prompt_length`` tokens, and
    how many were dropped (verl's ``filter_overlong_prompts``). With ``refuse_in`` (what the rows were read
    from) an overlong prompt raises instead, as verl's default ``truncation: error`` does."""
    from rlstage.engines.models.chat import render_batch

    lengths = [len(ids) for ids in render_batch(tokenizer, table.to_pylist())]
    keep = pa.array([n <= max_prompt_length for n in lengths], pa.bool_())
    kept = table.filter(keep)
    over = table.num_rows - kept.num_rows
    if over and refuse_in is not None:
        raise DatasetError(
            f"{refuse_in}: {over} of {table.num_rows} prompts are longer than data.max_prompt_length={max_prompt_length} "
            f"tokens after the chat template (the longest: {max(lengths)}); raise it, or set "
            "data.filter_overlong_prompts=true to drop them"
        )
    return kept, over


# ---------------------------------------------------------------- reasoning-gym

REASONING_GYM_SOURCE = "reasoning_gym"  # rows' data_source is "reasoning_gym/<task>" (its reward: engines/rewards.py)


class ReasoningGymSettings(BaseModel):
    """``data.source_settings`` of ``data.source: reasoning_gym``: a task of the reasoning-gym library (PyPI
    ``reasoning-gym``), generated with a seed into a training and a held-out split that share no question."""

    model_config = ConfigDict(extra="forbid")
    task: str = Field(description="a reasoning-gym task name (products, chain_sum, basic_arithmetic, ...)")
    config: dict[str, Any] = Field(
        default_factory=dict, description="the task's generator settings, its difficulty (products: min_digits, ...)"
    )
    train_size: int = Field(5000, ge=1, description="training prompts generated (questions of the held-out split removed)")
    test_size: int = Field(200, ge=1, description="held-out prompts, never trained on")
    seed: int = Field(0, description="seed of the generator: the held-out split uses it, the training split seed + 1")
    instruction: str = Field(
        "", description="appended to each question (e.g. \"Give only the final answer.\"; empty: the question as the task words it)"
    )
    answer: Literal["last_number", "whole"] = Field(
        "last_number",
        description="what the task's checker scores: the response's last number, or the whole response stripped",
    )


def _reasoning_gym_rows(s: ReasoningGymSettings, split: str, size: int, seed: int) -> list[dict[str, Any]]:
    import reasoning_gym  # an optional dependency ('.[tasks]'): only this source needs it

    try:
        dataset = reasoning_gym.create_dataset(s.task, size=size, seed=seed, **s.config)
    except Exception as err:  # the library's own refusal of a task name or a setting, in one line
        raise DatasetError(f"reasoning_gym task {s.task!r}: {type(err).__name__}: {' '.join(str(err).split())}") from None
    rows = []
    for index, entry in enumerate(dataset):
        prompt = f"{entry['question']} {s.instruction}".strip()
        rows.append(
            {
                "prompt_id": f"{s.task}-{split}-{index}",
                "prompt": prompt,
                "messages": [{"role": "user", "content": prompt}],
                "data_source": f"{REASONING_GYM_SOURCE}/{s.task}",
                "ground_truth": str(entry["answer"]),
                # The entry as generated: the task's checker reads its metadata (engines/rewards.py: reasoning_gym).
                "extra_info": _json({"split": split, "index": index, "task": s.task, "answer_from": s.answer, "entry": entry}),
            }
        )
    return rows


def reasoning_gym_tasks() -> list[str]:
    import reasoning_gym

    return sorted(reasoning_gym.factory.DATASETS)


@register_data_source(REASONING_GYM_SOURCE, settings=ReasoningGymSettings, generates=True)
def load_reasoning_gym(path: str | None = None, split: str = "train", **settings: Any) -> pa.Table:
    """A reasoning-gym task's ``split``: "test" (``test_size`` questions from ``seed``) or "train" (``train_size``
    from ``seed + 1``, without the held-out split's questions)."""
    if path:
        raise DatasetError(f"data source {REASONING_GYM_SOURCE!r} generates its prompts: it reads no file ({path})")
    s = ReasoningGymSettings.model_validate(settings)
    if importlib.util.find_spec("reasoning_gym") is None:
        raise DatasetError("data source reasoning_gym needs the reasoning-gym package: pip install 'rlstage[tasks]'")
    if s.task not in reasoning_gym_tasks():
        raise DatasetError(f"reasoning_gym has no task {s.task!r}; its tasks: {', '.join(reasoning_gym_tasks())}")
    test = _reasoning_gym_rows(s, "test", s.test_size, s.seed)
    if split == "test":
        return _to_table(test)
    if split != "train":
        raise DatasetError(f"reasoning_gym split must be 'train' or 'test', got {split!r}")
    held_out = {row["prompt"] for row in test}
    train = [row for row in _reasoning_gym_rows(s, "train", s.train_size, s.seed + 1) if row["prompt"] not in held_out]
    if not train:
        raise DatasetError(f"reasoning_gym task {s.task!r}: every training question is also held out (too few distinct questions)")
    return _to_table(train)


# ---------------------------------------------------------------- OpenEnv

OPENENV_SOURCE = "openenv"  # episodes of a running OpenEnv server; rlstage.engines.agents.openenv:episode plays them


class OpenEnvSettings(BaseModel):
    """``data.source_settings`` of ``data.source: openenv``: episodes of an OpenEnv environment (PyPI ``openenv-core``)
    whose server is already running. A prompt row is one episode: its seed, and as its prompt the text of the
    observation that ``reset(seed)`` returns (asked once at data prep). The agent
    ``rlstage.engines.agents.openenv:episode`` plays it; the environment's rewards are the sample's reward."""

    model_config = ConfigDict(extra="forbid")
    url: str = Field(description="the environment server's base URL (http://host:port or ws://host:port)")
    observation_field: str = Field("prompt", description="the observation's field whose text the policy reads, as a user message")
    action_field: str = Field("message", description="the action's field that the policy's reply fills")
    max_steps: int = Field(4, ge=1, description="steps of an episode at most (the environment's done ends it sooner)")
    train_size: int = Field(1000, ge=1, description="training episodes (seeds after the held-out ones)")
    test_size: int = Field(100, ge=1, description="held-out episodes, never trained on (seeds seed .. seed + test_size - 1)")
    seed: int = Field(0, ge=0, description="the first held-out episode's seed")
    timeout_s: float = Field(30.0, gt=0, description="seconds a reply of the environment server may take")


def observation_text(observation: Any, field: str) -> str:
    """The policy's view of an OpenEnv observation: its ``field``, which must hold text."""
    value = observation.get(field) if isinstance(observation, dict) else None
    if not isinstance(value, str):
        keys = ", ".join(sorted(observation)) if isinstance(observation, dict) else type(observation).__name__
        raise DatasetError(f"OpenEnv observation field {field!r} is not text (the observation has: {keys}); set observation_field")
    return value


def openenv_session(url: str, timeout_s: float) -> Any:
    """A session with an OpenEnv server (its WebSocket client, dict actions and observations): ``async with`` it."""
    from openenv.core.generic_client import GenericEnvClient

    return GenericEnvClient(base_url=url, connect_timeout_s=timeout_s, message_timeout_s=timeout_s)


async def _first_observations(s: OpenEnvSettings, seeds: list[int]) -> list[str]:
    gate = asyncio.Semaphore(32)  # connections at once: each is a session the server holds

    async def one(seed: int) -> str:
        async with gate, openenv_session(s.url, s.timeout_s) as env:
            return observation_text((await env.reset(seed=seed)).observation, s.observation_field)

    return await asyncio.gather(*(one(seed) for seed in seeds))


def _openenv_rows(s: OpenEnvSettings, split: str, seeds: list[int]) -> list[dict[str, Any]]:
    try:
        prompts = asyncio.run(_first_observations(s, seeds))
    except DatasetError:
        raise
    except Exception as err:  # the server's or the connection's failure, in one line
        raise DatasetError(f"OpenEnv server {s.url}: reset failed: {type(err).__name__}: {' '.join(str(err).split())}") from None
    episode = s.model_dump(include={"url", "observation_field", "action_field", "max_steps", "timeout_s"})
    return [
        {
            "prompt_id": f"{OPENENV_SOURCE}-{split}-{seed}",
            "prompt": prompt,
            "messages": [{"role": "user", "content": prompt}],
            "data_source": OPENENV_SOURCE,
            "ground_truth": "",  # the environment holds it
            "extra_info": _json({"split": split, "index": index, "seed": seed, "openenv": episode}),
        }
        for index, (seed, prompt) in enumerate(zip(seeds, prompts, strict=True))
    ]


@register_data_source(OPENENV_SOURCE, settings=OpenEnvSettings, generates=True)
def load_openenv(path: str | None = None, split: str = "train", **settings: Any) -> pa.Table:
    """An OpenEnv environment's episodes: "test" (seeds ``seed`` ..) or "train" (the next ``train_size`` seeds,
    without episodes whose first observation is a held-out one)."""
    if path:
        raise DatasetError(f"data source {OPENENV_SOURCE!r} asks its environment server for prompts: it reads no file ({path})")
    s = OpenEnvSettings.model_validate(settings)
    if importlib.util.find_spec("openenv") is None:
        raise DatasetError("data source openenv needs the openenv-core package: pip install 'rlstage[envs]'")
    test = _openenv_rows(s, "test", list(range(s.seed, s.seed + s.test_size)))
    if split == "test":
        return _to_table(test)
    if split != "train":
        raise DatasetError(f"openenv split must be 'train' or 'test', got {split!r}")
    held_out = {row["prompt"] for row in test}
    first = s.seed + s.test_size
    train = [r for r in _openenv_rows(s, "train", list(range(first, first + s.train_size))) if r["prompt"] not in held_out]
    if not train:
        raise DatasetError(f"OpenEnv server {s.url}: every training episode starts as a held-out one does (too few distinct starts)")
    return _to_table(train)


# ---------------------------------------------------------------- verifiers


def _verifiers_rows(split: str, tasks: list[dict[str, Any]], first: int) -> list[dict[str, Any]]:
    rows = []
    for index, task in enumerate(tasks, start=first):
        prompt = task["prompt"]
        messages = [{"role": "system", "content": task["system_prompt"]}] if task.get("system_prompt") else []
        messages += [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt or [])
        users = [m.get("content") for m in messages if m.get("role") == "user" and isinstance(m.get("content"), str)]
        if not users:
            raise DatasetError(f"verifiers task {task['key']}: its prompt has no text user message (only text prompts are supported)")
        rows.append(
            {
                "prompt_id": f"{VERIFIERS_SOURCE}-{split}-{index}",
                "prompt": users[-1],
                "messages": messages,
                "data_source": VERIFIERS_SOURCE,
                "ground_truth": "",  # the taskset scores its own episodes
                "extra_info": _json({"split": split, "index": index, "verifiers": {"key": task["key"], "data": task["data"]}}),
            }
        )
    return rows


@register_data_source(VERIFIERS_SOURCE, settings=VerifiersSettings, generates=True)
def load_verifiers(path: str | None = None, split: str = "train", **settings: Any) -> pa.Table:
    """A verifiers taskset's tasks, in its order: "test" (the first ``test_size``) or "train" (the next
    ``train_size``, without tasks whose prompt is a held-out one's)."""
    if path:
        raise DatasetError(f"data source {VERIFIERS_SOURCE!r} asks its taskset for prompts: it reads no file ({path})")
    if split not in ("train", "test"):
        raise DatasetError(f"verifiers split must be 'train' or 'test', got {split!r}")
    s = VerifiersSettings.model_validate(settings)
    try:
        tasks = list_tasks(s, s.test_size + s.train_size)  # one listing for both splits
    except VerifiersError as err:
        raise DatasetError(str(err)) from None
    test = _verifiers_rows("test", tasks[: s.test_size], 0)
    if split == "test":
        return _to_table(test)
    held_out = {row["prompt"] for row in test}
    train = [r for r in _verifiers_rows("train", tasks[s.test_size :], s.test_size) if r["prompt"] not in held_out]
    if not train:
        raise DatasetError(f"verifiers taskset {s.taskset!r}: no training task after the {len(test)} held-out ones (every one is held out)")
    return _to_table(train)


# ---------------------------------------------------------------- dispatcher


def load_prompts(source: str, path: str | None, **kw: Any) -> pa.Table:
    """Load prompts by ``data.source``.

    ``synthetic`` takes ``split`` ("train"/"test", default "train") and ``digits``/``train_size``/
    ``test_size``/``seed`` (defaults from ``KitConfig``); the file sources take ``split`` for prompt ids.
    """
    try:
        loader = DATA_SOURCES.entry(source).obj
    except ValueError as err:
        raise DatasetError(str(err)) from None
    if not generates_prompts(source) and not path:
        raise DatasetError(f"data source {source!r} needs a path")
    return loader(path, **kw)


def prepare_splits(source: str, train_path: str | None, test_path: str | None, settings: dict[str, Any]) -> tuple[pa.Table, pa.Table]:
    """The training and held-out prompts of ``data.source``: read from the two files, or generated (``settings``:
    ``data.source_settings``)."""
    if generates_prompts(source):
        return (load_prompts(source, None, split="train", **settings), load_prompts(source, None, split="test", **settings))
    train = load_prompts(source, train_path, **settings)
    if not test_path:
        return train, train.slice(0, 0)
    test = load_prompts(source, test_path, **settings)
    check_held_out(train, test, train_path, test_path)
    return train, test


def check_held_out(train: pa.Table, test: pa.Table, train_path: str, test_path: str) -> None:
    """No held-out prompt is also a training prompt: an eval on prompts the policy trains on measures memory."""
    seen = set(train.column("prompt").to_pylist())
    shared = sum(prompt in seen for prompt in test.column("prompt").to_pylist())
    if shared:
        raise DatasetError(
            f"{test_path}: {shared} of {test.num_rows} held-out prompts are also in {train_path}; "
            "the held-out split is never trained on: remove them from one file"
        )


def split_label(source: str, path: str | None, split: str) -> str:
    """How a one-line error names a split: its file, or the source that generated it."""
    return path if path else f"data.source={source} ({split} split)"
