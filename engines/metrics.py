"""Held-out evaluation metrics as verl 0.9.1 reports them (``verl/trainer/ppo/metric_utils.py``).

Pure functions over per-sample lists, no I/O. Samples are grouped by data source and prompt uid; every
numeric variable (a score, an accuracy) gets per-prompt statistics over its N samples, averaged over the
prompts of the data source:

- ``mean@N``: mean of the N values; ``std@N``: their population std (``np.std``), only for N > 1;
- ``best@n/mean`` / ``best@n/std`` and ``worst@n/...``: bootstrap (1000 draws with replacement of n of the
  N values, numpy's legacy RandomState seeded 42 per call, as verl's ``np.random.seed(42)``) of the max /
  min; ``n`` runs over 2, 4, 8, ... below N and N itself;
- ``maj@n/mean`` / ``maj@n/std``: the same bootstrap of the majority vote, when every sample has an
  extracted answer (``pred``): the value of the FIRST sample whose answer is the most frequent one (ties go
  to the answer seen first).

``flatten_validation_metrics`` names them ``val-core/<source>/<var>/<metric>`` for the core variable
(``acc`` if present, else ``reward``) and its ``mean`` / ``maj`` / ``best`` metrics at the largest n, and
``val-aux/...`` for everything else. ``pass_at_k`` is the unbiased pass@k estimator of Chen et al. (2021).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np

from rlstage.engines.data.datasets import GSM8K_SOURCE
from rlstage.engines.rewards.rules import (
    answer_extractor,
    gsm8k_flexible,
    verl_gsm8k_answer,
)

__all__ = [
    "bootstrap_metric",
    "extract_answers",
    "flatten_validation_metrics",
    "held_out_metrics",
    "majority_value",
    "pass_at_k",
    "pass_at_k_metrics",
    "subset_sizes",
    "validation_metrics",
]


def bootstrap_metric(
    data: Sequence[Any],
    subset_size: int,
    reduce_fns: Sequence[Callable[[np.ndarray], float]],
    n_bootstrap: int = 1000,
    seed: int = 42,
) -> list[tuple[float, float]]:
    """(mean, std) over ``n_bootstrap`` resamples of ``subset_size`` items (with replacement) of each reducer.

    The indices are drawn once, ``RandomState(seed).choice(len(data), (n_bootstrap, subset_size))``: the
    same draws as verl's global ``np.random.seed(seed)`` without touching the global state.
    """
    items = np.empty(len(data), dtype=object)
    items[:] = list(data)
    idx = _draws(len(items), subset_size, seed, n_bootstrap)
    out = []
    for fn in reduce_fns:
        values = np.array([fn(items[row]) for row in idx], dtype=np.float64)
        out.append((float(np.mean(values)), float(np.std(values))))
    return out


def majority_value(votes: Sequence[tuple[Hashable, float]]) -> float:
    """Value of the first ``(answer, value)`` pair whose answer is the most frequent (first seen wins ties)."""
    by_answer: dict[Hashable, list[float]] = defaultdict(list)
    for answer, value in votes:
        by_answer[answer].append(value)
    winner = max(by_answer, key=lambda a: len(by_answer[a]))
    return by_answer[winner][0]


def subset_sizes(n: int) -> list[int]:
    """Bootstrap subset sizes for N samples: 2, 4, 8, ... below N, then N (none for N <= 1)."""
    if n <= 1:
        return []
    sizes, k = [], 2
    while k < n:
        sizes.append(k)
        k *= 2
    return sizes + [n]


def _draws(n: int, k: int, seed: int, n_bootstrap: int = 1000) -> np.ndarray:
    """The bootstrap's index draws: the same for every reducer of a (prompt, k), as verl re-seeds each call."""
    return np.random.RandomState(seed).choice(n, size=(n_bootstrap, k), replace=True)


def _majority_values(values: np.ndarray, answers: Sequence[Hashable], idx: np.ndarray) -> np.ndarray:
    """``majority_value`` of every draw row at once: most frequent answer, ties to the one drawn first."""
    codes = {a: i for i, a in enumerate(dict.fromkeys(answers))}
    coded = np.array([codes[a] for a in answers])[idx]  # (draws, k)
    onehot = coded[..., None] == np.arange(len(codes))  # (draws, k, answers)
    counts = onehot.sum(axis=1)
    k = idx.shape[1]
    first = np.where(onehot, np.arange(k)[None, :, None], k).min(axis=1)  # first draw of each answer
    winner = np.argmax(counts * (k + 1) - first, axis=1)  # most votes, then drawn first
    pos = first[np.arange(len(idx)), winner]
    return values[idx[np.arange(len(idx)), pos]]


def _prompt_metrics(values: list[float], preds: list[Hashable] | None, seed: int) -> dict[str, float]:
    n = len(values)
    out = {f"mean@{n}": float(np.mean(values))}
    if n <= 1:
        return out
    out[f"std@{n}"] = float(np.std(values))
    vals = np.asarray(values, dtype=np.float64)
    for k in subset_sizes(n):
        idx = _draws(n, k, seed)  # vectorised bootstrap_metric: the same draws, the same numbers
        best, worst = vals[idx].max(axis=1), vals[idx].min(axis=1)
        out.update(
            {
                f"best@{k}/mean": float(best.mean()),
                f"best@{k}/std": float(best.std()),
                f"worst@{k}/mean": float(worst.mean()),
                f"worst@{k}/std": float(worst.std()),
            }
        )
        if preds is not None:
            maj = _majority_values(vals, preds, idx)
            out.update({f"maj@{k}/mean": float(maj.mean()), f"maj@{k}/std": float(maj.std())})
    return out


def validation_metrics(
    data_sources: Sequence[str],
    uids: Sequence[Hashable],
    infos: dict[str, Sequence[Any]],
    seed: int = 42,
) -> dict[str, dict[str, dict[str, float]]]:
    """``{source: {variable: {metric: value}}}``: per-prompt metrics averaged over the source's prompts.

    ``infos`` maps a variable name to one value per sample; string-valued variables and ``None`` values
    are skipped; ``infos["pred"]`` (extracted answers) enables ``maj@n`` for prompts where every sample
    has one.
    """
    grouped: dict[str, dict[Hashable, dict[str, list]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for i, (src, uid) in enumerate(zip(data_sources, uids, strict=True)):
        for name, values in infos.items():
            grouped[src][uid][name].append(values[i])
    per_metric: dict[str, dict[str, dict[str, list[float]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for src, prompts in grouped.items():
        for var2vals in prompts.values():
            preds = var2vals.get("pred")
            for name, raw in var2vals.items():
                values = [v for v in raw if v is not None]
                if not values or isinstance(values[0], str):
                    continue
                usable = preds if preds is not None and len(preds) == len(values) and None not in preds else None
                for metric, value in _prompt_metrics([float(v) for v in values], usable, seed).items():
                    per_metric[src][name][metric].append(value)
    return {
        src: {name: {m: float(np.mean(v)) for m, v in metrics.items()} for name, metrics in variables.items()}
        for src, variables in per_metric.items()
    }


def flatten_validation_metrics(nested: dict[str, dict[str, dict[str, float]]]) -> dict[str, float]:
    """``val-core/<source>/<var>/<metric>`` for the core variable's mean/maj/best at the largest n, else
    ``val-aux/...`` (verl's trainer naming)."""
    flat: dict[str, float] = {}
    for src, variables in nested.items():
        core = "acc" if "acc" in variables else "reward"
        for name, metrics in variables.items():
            n_max = max(int(m.split("@")[-1].split("/")[0]) for m in metrics)
            for metric, value in metrics.items():
                is_core = name == core and metric.startswith(("mean", "maj", "best")) and f"@{n_max}" in metric
                flat[f"{'val-core' if is_core else 'val-aux'}/{src}/{name}/{metric}"] = value
    return flat


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: ``1 - C(n - c, k) / C(n, k)``.

    Computed as ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)`` (no large binomials); 1 when ``n - c < k``.
    Needs ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def is_correct(score: float, correct_at: float | None = None) -> bool:
    """Whether a rule score counts as a correct answer: at ``correct_at`` where the rule declares it (full credit,
    for a rule whose partial credit passes one half), else above 0.5, so a format credit (GSM8K's 0.1) is not one."""
    return score >= correct_at if correct_at is not None else score > 0.5


def pass_at_k_metrics(
    data_sources: Sequence[str], uids: Sequence[Hashable], correct: Sequence[bool], var: str = "reward"
) -> dict[str, float]:
    """``val-aux/<source>/<var>/pass@k``: the unbiased pass@k per prompt (its N samples, c correct), averaged
    over the source's prompts, for k in ``subset_sizes(N)`` (prompts with fewer than k samples are left out)."""
    counts: dict[str, dict[Hashable, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for src, uid, ok in zip(data_sources, uids, correct, strict=True):
        counts[src][uid][0] += 1
        counts[src][uid][1] += int(ok)
    out: dict[str, float] = {}
    for src, prompts in counts.items():
        n_max = max(n for n, _ in prompts.values())
        for k in subset_sizes(n_max):
            vals = [pass_at_k(n, c, k) for n, c in prompts.values() if n >= k]
            out[f"val-aux/{src}/{var}/pass@{k}"] = float(np.mean(vals))
    return out


def gsm8k_answer_metrics(rows: Sequence[dict]) -> dict[str, float]:
    """Over the GSM8K rows (``response_text``, ``ground_truth``, ``data_source``):
    ``val-aux/openai/gsm8k/format/mean@1``, the share of answers verl's strict rule parses (a final
    ``#### <number>``, what a real model learns before it learns to be right), and
    ``.../acc_flexible/mean@1``, the share whose last number is the ground truth's (rlstage's numeric match).
    Empty without GSM8K rows."""
    gsm = [r for r in rows if r["data_source"] == GSM8K_SOURCE]
    if not gsm:
        return {}
    key = f"val-aux/{GSM8K_SOURCE}"
    return {
        f"{key}/format/mean@1": float(np.mean([verl_gsm8k_answer(r["response_text"]) is not None for r in gsm])),
        f"{key}/acc_flexible/mean@1": float(np.mean([gsm8k_flexible(r["response_text"], r["ground_truth"], {}) for r in gsm])),
    }


def extract_answers(rows: Sequence[dict], reward_fns: Sequence[str]) -> list[Hashable | None] | None:
    """Each row's extracted answer under its reward function, or None when one of them has no extractor
    (then maj@n is not reported, as verl reports it only with a ``pred`` for every sample)."""
    answers = [answer_extractor(fn) for fn in reward_fns]
    if any(a is None for a in answers):
        return None
    return [a(r["response_text"], _extra(r["extra_info"])) for r, a in zip(rows, answers, strict=True)]


def held_out_metrics(
    rows: Sequence[dict],
    scores: Sequence[float],
    correct: Sequence[bool],
    greedy_n: int,
    uids: Sequence[Hashable] = (),
    reward_fns: Sequence[str] = (),
    require_maj: bool = False,
) -> dict[str, float]:
    """The eval stage's metrics over its scored answers (``rows`` as ``score_batch`` takes them): the first
    ``greedy_n`` greedy, one per prompt, then the sampled ones (``uids``: each one's prompt; ``reward_fns``: the
    rule that scored it, whose answer maj@n votes on). ``require_maj``: a sampled rule that extracts no answer fails
    the stage instead of leaving maj@n out."""
    sources = [r["data_source"] for r in rows]
    out = gsm8k_answer_metrics(rows[:greedy_n])  # the format a real model learns first
    for ds in sorted(set(sources)):
        g = [s for s, src in zip(scores[:greedy_n], sources[:greedy_n], strict=True) if src == ds]
        out[f"val-core/{ds}/reward/mean@1"] = float(np.mean(g))
    if len(rows) > greedy_n:  # the sampled answers, as verl reports them
        sampled = sources[greedy_n:]
        infos: dict[str, list] = {"reward": list(scores[greedy_n:])}
        preds = extract_answers(rows[greedy_n:], reward_fns)
        if preds is not None:
            infos["pred"] = preds
        elif require_maj:  # a verl parquet's sources, known only now
            missing = sorted({f for f in reward_fns if answer_extractor(f) is None})
            raise ValueError(
                f"trainer.eval_require_maj: reward function(s) {', '.join(missing)} of the held-out data extract no "
                "answer for maj@N to vote on; set reward.function to one that does, or trainer.eval_require_maj=false"
            )
        out.update(flatten_validation_metrics(validation_metrics(sampled, uids, infos)))
        out.update(pass_at_k_metrics(sampled, uids, correct[greedy_n:]))
    # the share of greedy answers scored correct; with a partial-credit rule the mean score differs
    out["val/accuracy"] = float(np.mean(correct[:greedy_n]))
    out["val/reward_mean"] = float(np.mean(scores[:greedy_n]))
    return out


def _extra(value: str | dict | None) -> dict:
    # The prompts table stores extra_info as JSON text (the scorer parses it the same way).
    return json.loads(value) if isinstance(value, str) and value else (value or {})
