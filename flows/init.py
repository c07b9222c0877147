"""``rlstage init``: a commented starting config for a model folder and your prompt files.

The settings a user must choose come first, then the ones worth tuning next; each carries its help from the config
models (schemas/settings_help.py), so the file explains itself. It is written only after it loads and its files
read with the chosen columns: ``rlstage train -c <file>`` then starts from a config known to be valid.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rlstage.schemas.config import ConfigError, build_config
from rlstage.schemas.settings_help import help_of

# What a first run on a small model and a 2-core CPU can afford; every value is a starting point, not a tuned one.
TUNE_NEXT: dict[str, Any] = {
    "algorithm.adv_estimator": "grpo",
    "rollout.n": 8,
    "rollout.max_new_tokens": 128,
    "data.prompts_per_iteration": 8,
    "data.eval_size": 64,
    "data.max_prompt_length": 512,
    "actor.ppo_mini_batch_size": 32,
    "actor.micro_batch_size": 8,
    "actor.optim.lr": 1.0e-6,
    "trainer.iterations": 20,
    "model.torch_threads": 2,
}


@dataclass(frozen=True)
class InitChoices:
    model: str
    train: str
    test: str
    reward: str | None
    prompt_column: str = "prompt"
    answer_column: str = "answer"
    run_name: str = "mine"


def _source_of(path: str) -> str:
    return "parquet" if path.endswith(".parquet") else "jsonl"


def _short(text: str, limit: int = 100) -> str:
    first = " ".join(text.split()).split(". ")[0].rstrip(".")
    return first if len(first) <= limit else first[: limit - 3].rstrip() + "..."


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for dotted, value in flat.items():
        node = tree
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def _value(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str | dict) else yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def _lines(flat: dict[str, Any], helps: dict[str, str], tune_from: str) -> list[str]:
    """``flat`` (grouped by section) as nested YAML, each leaf under its help as a comment; a heading before the
    first of the settings to tune."""
    lines = ["# ---- choose these first"]
    opened: list[str] = []
    for dotted, value in flat.items():
        *parents, leaf = dotted.split(".")
        if dotted == tune_from:
            lines += ["", "# ---- tune these next (starting points for a small model on a CPU)"]
        common = 0
        while common < min(len(opened), len(parents)) and opened[common] == parents[common]:
            common += 1
        for depth in range(common, len(parents)):
            lines.append(f"{'  ' * depth}{parents[depth]}:")
        opened = parents
        pad = "  " * len(parents)
        lines += [f"{pad}# {_short(helps[dotted])}", f"{pad}{leaf}: {_value(value)}"]
    return lines


def render(choices: InitChoices) -> str:
    from rlstage.engines.data.datasets import ColumnSettings

    first: dict[str, Any] = {
        "run_name": choices.run_name,
        "model.path": choices.model,
        "data.source": _source_of(choices.train),
        "data.train_path": choices.train,
        "data.test_path": choices.test,
        "data.source_settings.prompt_column": choices.prompt_column,
        "data.source_settings.answer_column": choices.answer_column,
        "reward.function": choices.reward,
    }
    # each section once: the settings to tune of a section the first ones open go there, the others after
    tune = dict(TUNE_NEXT)
    flat: dict[str, Any] = {}
    for section in dict.fromkeys(k.split(".")[0] for k in first):
        flat |= {k: v for k, v in [*first.items(), *tune.items()] if k.split(".")[0] == section}
    rest = {k: v for k, v in tune.items() if k not in flat}
    columns = ColumnSettings.model_fields
    helps = {k: help_of(k) for k in [*first, *tune] if not k.startswith("data.source_settings.")}
    helps |= {f"data.source_settings.{name}": columns[name].description or "" for name in ("prompt_column", "answer_column")}
    lines = [
        "# rlstage config written by `rlstage init`. Train: rlstage train -c <this file>",
        "# Every setting, its default and the stages that read it: docs/reference/config.md",
        "",
        *_lines(flat | rest, helps, next(iter(rest))),
    ]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class RunConfigSummary:
    run_name: str
    source: str
    path: str


def write_config(choices: InitChoices, out: Path) -> RunConfigSummary:
    """Check ``choices`` and write the starting config to ``out`` (new); one-line errors as ConfigError/InputError."""
    from rlstage.flows.checks import check_inputs

    if out.exists():
        raise ConfigError(f"config error: --out {out} exists: choose another file (nothing was written)")
    if choices.reward is None:
        raise ConfigError(
            "config error: --reward: choose how answers are scored: a registered reward (exact_match, "
            "gsm8k_flexible, ...) or your own module:function"
        )
    text = render(choices)
    cfg = build_config(yaml.safe_load(text))
    check_inputs(cfg)  # the files read with these columns, the model folder holds a model
    from rlstage.engines.preflight import preflight

    preflight(cfg)
    out.write_text(text)
    return RunConfigSummary(cfg.run_name, cfg.data.source, str(out))



