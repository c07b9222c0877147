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

import math
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "bootstrap_metric",
    "flatten_validation_metrics",
    "majority_value",
    "pass_at_k",
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
    idx = np.random.RandomState(seed).choice(len(items), size=(n_bootstrap, subset_size), replace=True)
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


def _prompt_metrics(values: list[float], preds: list[Hashable] | None, seed: int) -> dict[str, float]:
    n = len(values)
    out = {f"mean@{n}": float(np.mean(values))}
    if n <= 1:
        return out
    out[f"std@{n}"] = float(np.std(values))
    for k in subset_sizes(n):
        (best, best_sd), (worst, worst_sd) = bootstrap_metric(values, k, [np.max, np.min], seed=seed)
        out.update({f"best@{k}/mean": best, f"best@{k}/std": best_sd, f"worst@{k}/mean": worst, f"worst@{k}/std": worst_sd})
        if preds is not None:
            votes = list(zip(preds, values, strict=True))
            [(maj, maj_sd)] = bootstrap_metric(votes, k, [lambda s: majority_value(list(s))], seed=seed)
            out.update({f"maj@{k}/mean": maj, f"maj@{k}/std": maj_sd})
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
