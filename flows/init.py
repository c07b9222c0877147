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

from rlstage.schemas.config import ConfigError, build_config, dotted, nested
from rlstage.schemas.docs_site import page_url
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


# Without a GPU: an iteration of a ~100M-parameter model in minutes on a few cores (init prints its estimate).
CPU_SIZES: dict[str, Any] = {
    "rollout.n": 4,
    "rollout.max_new_tokens": 64,
    "data.prompts_per_iteration": 4,
    "data.eval_size": 16,
    "actor.ppo_mini_batch_size": 16,
    "trainer.iterations": 10,
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
    data_source: str | None = None  # None: by the train file's suffix (parquet or jsonl)
    overrides: tuple[str, ...] = ()  # dotted settings written over the starting points


def _source_of(path: str) -> str:
    return "parquet" if path.endswith(".parquet") else "jsonl"


def absolute(path: str) -> str:
    """A path of the config as an absolute one: the file is read from wherever `rlstage train` runs."""
    return str(Path(path).expanduser().resolve())


def context_of(model: str) -> int | None:
    """The model's context length in tokens from its config.json (None: a GGUF file, or none is named)."""
    try:
        config = json.loads((Path(model) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if isinstance(config.get(key), int) and config[key] > 0:
            return config[key]
    return None


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def fitted(context: int | None, tune: dict[str, Any]) -> dict[str, Any]:
    """The prompt and response lengths of ``tune`` cut to fit ``context``: a quarter of it for the response."""
    prompt, new = tune["data.max_prompt_length"], tune["rollout.max_new_tokens"]
    if context is None or prompt + new <= context:
        return {}
    new = min(new, max(8, context // 4))
    return {"data.max_prompt_length": context - new, "rollout.max_new_tokens": new}


def _short(text: str, limit: int = 100) -> str:
    first = " ".join(text.split()).split(". ")[0].rstrip(".")
    return first if len(first) <= limit else first[: limit - 3].rstrip() + "..."


def _value(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str | dict) else yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def _lines(flat: dict[str, Any], helps: dict[str, str], tune_from: str) -> list[str]:
    """``flat`` (grouped by section) as nested YAML, each leaf under its help as a comment; a heading before the
    first of the settings to tune."""
    lines = ["# ---- choose these first"]
    opened: list[str] = []
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        if key == tune_from:
            lines += ["", "# ---- tune these next (starting points for a small model; smaller where this machine has no GPU)"]
        common = 0
        while common < min(len(opened), len(parents)) and opened[common] == parents[common]:
            common += 1
        for depth in range(common, len(parents)):
            lines.append(f"{'  ' * depth}{parents[depth]}:")
        opened = parents
        pad = "  " * len(parents)
        lines += [f"{pad}# {_short(helps[key])}", f"{pad}{leaf}: {_value(value)}"]
    return lines


def _help(key: str) -> str:
    from rlstage.schemas.config import nearest_setting

    try:
        return help_of(key)
    except KeyError:
        near = nearest_setting(key)
        raise ConfigError(f"config error: {key}: not a setting" + (f"; did you mean {near}?" if near else "")) from None


def render(choices: InitChoices) -> str:
    from rlstage.engines.data.datasets import ColumnSettings
    from rlstage.schemas.config import parse_overrides

    source = choices.data_source or _source_of(choices.train)
    first: dict[str, Any] = {
        "run_name": choices.run_name,
        "model.path": choices.model,
        "data.source": source,
        "data.train_path": choices.train,
        "data.test_path": choices.test,
        **({"data.source_settings.prompt_column": choices.prompt_column, "data.source_settings.answer_column": choices.answer_column}
           if source in ("jsonl", "parquet") else {}),
        "reward.function": choices.reward,
    }  # fmt: skip
    # each section once: the settings to tune of a section the first ones open go there, the others after
    tune = {**TUNE_NEXT, **(CPU_SIZES if not _has_gpu() else {})}
    tune |= fitted(context_of(choices.model), tune)
    given = dotted(parse_overrides(list(choices.overrides)))
    first |= {k: v for k, v in given.items() if k in first}
    tune |= {k: v for k, v in given.items() if k not in first}
    flat: dict[str, Any] = {}
    for section in dict.fromkeys(k.split(".")[0] for k in first):
        flat |= {k: v for k, v in [*first.items(), *tune.items()] if k.split(".")[0] == section}
    rest = {k: v for k, v in tune.items() if k not in flat}
    flat, rest = dotted(nested(flat)), dotted(nested(rest))  # a section's settings together: YAML keeps one block a key
    columns = ColumnSettings.model_fields
    first = {k: v for k, v in first.items() if v is not None or k == "reward.function"}
    helps = {k: _help(k) for k in [*first, *tune] if not k.startswith("data.source_settings.")}
    helps |= {k: columns[k.rsplit(".", 1)[1]].description or "" if k.rsplit(".", 1)[1] in columns else "" for k in [*first, *tune]
              if k.startswith("data.source_settings.")}  # fmt: skip
    lines = [
        "# rlstage config written by `rlstage init`. Train: rlstage train -c <this file>",
        "# Its paths are absolute: the file trains from any folder.",
        f"# Every setting, its default and the stages that read it: {page_url('reference/config.md')}",
        "",
        *_lines(flat | rest, helps, next(iter(rest))),
    ]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class RunConfigSummary:
    run_name: str
    source: str
    path: str
    estimate: str | None = None


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
    return RunConfigSummary(cfg.run_name, cfg.data.source, str(out), estimate(cfg))


def estimate(cfg: Any) -> str | None:
    """A rough time per iteration on this machine, from one short generation of the model at the rollout's batch:
    a line for the user, or None where it cannot be measured (a GPU, a GGUF file, no model folder)."""
    import time

    import torch

    if torch.cuda.is_available() or not cfg.model.path or not Path(cfg.model.path, "config.json").is_file():
        return None
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(cfg.model.torch_threads)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32).eval()
    batch, steps, prompt = cfg.data.prompts_per_iteration * cfg.rollout.n, 8, min(64, cfg.data.max_prompt_length)
    ids = torch.full((batch, prompt), 1, dtype=torch.long)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
        per_step = (time.perf_counter() - t0) / steps
    new = cfg.rollout.max_new_tokens
    generate_s = per_step * new + per_step * new * (cfg.data.eval_size or 64) / batch
    minutes = 2 * generate_s / 60  # the update (old log-probs, forward and backward) costs about as much again
    return (
        f"about {minutes:.0f} min an iteration on this machine's CPU ({batch} samples of up to {new} new tokens; "
        f"generation measured at {batch / per_step:.0f} tokens/s), {minutes * cfg.trainer.iterations / 60:.1f} h for "
        f"trainer.iterations={cfg.trainer.iterations}: lower rollout.max_new_tokens or data.prompts_per_iteration to go faster"
    )



