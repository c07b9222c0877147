"""Compare training runs side by side from MLflow: final/best key metrics, s/iteration, optional plots.

``python -m rlstage.flows.compare RUN [RUN ...] --tracking-uri URI [--experiment E] [--png out.png]``
``python -m rlstage.flows.compare RUN [RUN ...] --store ROOT``: the same table from the store's manifests.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import sys
from pathlib import Path
from typing import Any

from rlstage.infra.env import apply_defaults
from rlstage.infra.home import mlflow_uri
from rlstage.infra.tracking import RUN_NAME_TAG, metric_name

# Which way is "best" per metric: "max", "min_abs" (KL estimators: closest to 0; k1-style ones can go
# negative from sampling noise) or None (entropy and length have no better direction, so final only).
KEY_METRICS: dict[str, str | None] = {
    "critic/score/mean": "max",
    "val/accuracy": "max",
    "val/reward_mean": "max",
    "actor/ppo_kl": "min_abs",
    "actor/kl_loss": "min_abs",
    "actor/entropy": None,
    "response_length/mean": None,
}
# verl logs val-core/<data_source>/reward/mean@1; the data source may itself contain '/'.
VAL_CORE = re.compile(r"^val-core/.+/reward/" + re.escape(metric_name("mean@1")) + r"$")
TIMING = "timing_s/iteration"
SHORT = {
    "critic/score/mean": "score",
    "val/accuracy": "val_acc",
    "val/reward_mean": "val_reward",
    "actor/ppo_kl": "ppo_kl",
    "actor/kl_loss": "kl_loss",
    "actor/entropy": "entropy",
    "response_length/mean": "resp_len",
}
MAX_KNOWN_LISTED = 50  # keeps the unknown-run error to a readable length on a busy experiment


def _client(tracking_uri: str) -> Any:
    if tracking_uri.startswith("sqlite:///"):
        # MLflow would silently create an empty database at a mistyped path; say so instead.
        path = Path(tracking_uri.removeprefix("sqlite:///"))
        if not path.is_absolute():
            path = Path.cwd() / path
        if not path.exists() and str(path) != "/:memory:":
            raise ValueError(f"no MLflow database at {path} (tracking URI {tracking_uri})")
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


def _find_runs(client: Any, experiment: str, run_names: list[str]) -> dict[str, Any]:
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        known = sorted(e.name for e in client.search_experiments())
        raise ValueError(
            f"no MLflow experiment {experiment!r}; known experiments: {', '.join(known) or '(none)'}"
        )
    found: dict[str, Any] = {}
    for name in dict.fromkeys(run_names):
        quoted = name.replace("'", "\\'")
        runs = client.search_runs(
            [exp.experiment_id],
            filter_string=f"tags.`{RUN_NAME_TAG}` = '{quoted}'",
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
        if runs:
            found[name] = runs[0]
    missing = [n for n in run_names if n not in found]
    if missing:
        runs = client.search_runs([exp.experiment_id], max_results=1000)
        known = sorted({r.data.tags[RUN_NAME_TAG] for r in runs if RUN_NAME_TAG in r.data.tags})
        listed = ", ".join(known[:MAX_KNOWN_LISTED]) + (" ..." if len(known) > MAX_KNOWN_LISTED else "")
        raise ValueError(
            f"unknown run{'s' if len(missing) > 1 else ''} {', '.join(repr(m) for m in missing)} "
            f"in experiment {experiment!r}; known runs: {listed or '(none)'}"
        )
    return found


def _history(client: Any, run_id: str, key: str) -> list[tuple[int, float, int]]:
    """(step, value, timestamp) sorted by step; a step logged twice (a resumed run) keeps its latest value."""
    latest: dict[int, Any] = {}
    for m in client.get_metric_history(run_id, key):
        if m.step not in latest or m.timestamp >= latest[m.step].timestamp:
            latest[m.step] = m
    return [(s, float(latest[s].value), int(latest[s].timestamp)) for s in sorted(latest)]


def _summarize(hist: list[tuple[int, float, int]], direction: str | None) -> dict[str, Any]:
    final_step, final, _ = hist[-1]
    out: dict[str, Any] = {"final": final, "final_step": final_step, "best": None, "best_step": None}
    finite = [(s, v) for s, v, _ in hist if math.isfinite(v)]
    if direction and finite:
        key = (lambda sv: sv[1]) if direction == "max" else (lambda sv: -abs(sv[1]))
        # max() keeps the first maximum, so ties report the earliest iteration that reached it.
        out["best_step"], out["best"] = max(finite, key=key)
    return out


def _seconds_per_iteration(
    timing: list[tuple[int, float, int]], step_times: dict[int, int]
) -> tuple[float | None, str | None]:
    # Iteration 0 only evaluates the initial policy: it is no training iteration and would skew the mean.
    trained = [v for s, v, _ in timing if s > 0 and math.isfinite(v)]
    if trained:
        return statistics.fmean(trained), TIMING
    steps = sorted(step_times)
    deltas = [
        (step_times[b] - step_times[a]) / 1000 / (b - a) for a, b in zip(steps, steps[1:], strict=False)
    ]
    if deltas:
        # Median, not mean: a resumed run has one huge gap between its sessions.
        return statistics.median(deltas), "timestamps"
    return None, None


def _key_metrics(logged: set[str]) -> list[str]:
    """The key metrics a run logged, in table order: train, held-out (overall, per source), diagnostics."""
    val_core = sorted(k for k in logged if VAL_CORE.match(k))
    names = [k for k in KEY_METRICS if k in logged and KEY_METRICS[k] == "max"] + val_core
    return names + [k for k in KEY_METRICS if k in logged and KEY_METRICS[k] != "max"]


def _row(
    name: str,
    run_id: str | None,
    status: str,
    histories: dict[str, list[tuple[int, float, int]]],
    timing: list[tuple[int, float, int]],
    timing_source: str,
) -> dict:
    metrics: dict[str, dict[str, Any]] = {}
    history: dict[str, list[tuple[int, float]]] = {}
    step_times: dict[int, int] = {}
    for key, hist in [*histories.items(), (TIMING, timing)]:
        for s, _, t in hist:
            step_times[s] = max(step_times.get(s, t), t)
        if hist and key != TIMING:
            metrics[key] = _summarize(hist, "max" if VAL_CORE.match(key) else KEY_METRICS[key])
            history[key] = [(s, v) for s, v, _ in hist]
    s_per_iter, source = _seconds_per_iteration(timing, step_times)
    return {
        "run": name,
        "run_id": run_id,
        "status": status,
        "iterations": sum(1 for s in step_times if s > 0),
        "last_step": max(step_times) if step_times else None,
        "s_per_iter": s_per_iter,
        "s_per_iter_source": timing_source if source == TIMING else source,
        "metrics": metrics,
        "history": history,
    }


def compare_runs(
    run_names: list[str], tracking_uri: str, experiment: str = "rlstage", out_png: str | None = None
) -> list[dict]:
    """One dict per run (in the order given) with final/best key metrics, s/iteration and histories.

    Each dict: ``run``, ``run_id``, ``status``, ``iterations`` (trained iterations, i.e. steps > 0),
    ``last_step``, ``s_per_iter`` and ``s_per_iter_source`` (``timing_s/iteration`` or ``timestamps``),
    ``metrics`` ({name: {final, final_step, best, best_step}}; best is None where no direction applies)
    and ``history`` ({name: [(step, value), ...]}) for plotting.
    """
    if not run_names:
        raise ValueError("no run names given")
    client = _client(tracking_uri)
    found = _find_runs(client, experiment, run_names)
    rows: list[dict] = []
    for name in run_names:
        run = found[name]
        run_id = run.info.run_id
        logged = set(run.data.metrics)
        histories = {key: _history(client, run_id, key) for key in _key_metrics(logged)}
        timing = _history(client, run_id, TIMING) if TIMING in logged else []
        rows.append(_row(name, run_id, run.info.status, histories, timing, TIMING))
    if out_png:
        plot_runs(rows, out_png)
    return rows


def compare_stored_runs(
    run_names: list[str], store_root: str, storage_options: dict | None = None, out_png: str | None = None
) -> list[dict]:
    """The same rows as ``compare_runs``, from the store alone (no MLflow): the metrics each stage
    committed in its manifest (infra.explore). s/iteration is the stages' compute time (source
    ``compute_s``), without the orchestration time MLflow's ``timing_s/iteration`` includes."""
    from rlstage.infra.explore import Experience
    from rlstage.infra.store import ArtifactStore

    if not run_names:
        raise ValueError("no run names given")
    store = ArtifactStore(store_root, storage_options)
    rows: list[dict] = []
    for name in run_names:
        values: dict[str, dict[int, float]] = {}
        compute: dict[int, float] = {}
        for it, _stage, key, value in Experience.open(store, name).metrics().collect().iter_rows():
            if key == "compute_s":
                compute[it] = compute.get(it, 0.0) + value
            else:
                values.setdefault(metric_name(key), {})[it] = value
        histories = {k: [(s, values[k][s], 0) for s in sorted(values[k])] for k in _key_metrics(set(values))}
        timing = [(s, v, 0) for s, v in sorted(compute.items())]
        rows.append(_row(name, None, "stored", histories, timing, "compute_s"))
    if out_png:
        plot_runs(rows, out_png)
    return rows


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if v == 0 or (1e-3 <= abs(v) < 1e5) or not math.isfinite(v):
        return f"{v:.4f}"
    return f"{v:.3e}"


def _label(key: str) -> str:
    if key in SHORT:
        return SHORT[key]
    m = re.match(r"^val-core/(.+)/reward/", key)
    return f"{m.group(1)}@1" if m else key


def format_table(rows: list[dict]) -> str:
    """Fixed-width table: one line per run; per metric a final (and best, where one applies) column."""
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row["metrics"] if k not in keys]
    # Group header (metric) over sub-columns (final/best); a metric with no "best" gets only "final".
    groups: list[tuple[str, list[str]]] = [("", ["run"]), ("", ["iters"]), ("", ["s/iter"])]
    cells: list[list[str]] = [[r["run"], str(r["iterations"]), _fmt(r["s_per_iter"])] for r in rows]
    for key in keys:
        has_best = any(r["metrics"].get(key, {}).get("best") is not None for r in rows)
        subs = ["final", "best"] if has_best else ["final"]
        groups.append((_label(key), subs))
        for row, line in zip(rows, cells, strict=True):
            m = row["metrics"].get(key)
            line.append(_fmt(m["final"]) if m else "-")
            if has_best:
                line.append(_fmt(m["best"]) if m else "-")
    headers = [h for _, subs in groups for h in subs]
    widths = [max(len(h), *(len(line[i]) for line in cells)) for i, h in enumerate(headers)]
    top: list[str] = []
    i = 0
    for label, subs in groups:
        span = sum(widths[i : i + len(subs)]) + 2 * (len(subs) - 1)
        # A metric name longer than its columns widens them evenly, so final/best stay balanced under it.
        extra = len(label) - span
        for j in range(len(subs)):
            widths[i + j] += max(0, extra) // len(subs) + (1 if j < max(0, extra) % len(subs) else 0)
        span = max(span, len(label))
        top.append(label.center(span))
        i += len(subs)

    def line(values: list[str]) -> str:
        # The run column is left-aligned, numbers right-aligned so their decimals line up.
        pairs = enumerate(zip(values, widths, strict=True))
        return "  ".join(v.ljust(w) if j == 0 else v.rjust(w) for j, (v, w) in pairs)

    out = ["  ".join(top).rstrip(), line(headers).rstrip(), "  ".join("-" * w for w in widths)]
    out += [line(c).rstrip() for c in cells]
    return "\n".join(out)


PANELS: list[tuple[str, list[str]]] = [
    ("train reward (critic/score/mean)", ["critic/score/mean"]),
    ("held-out accuracy", ["val/accuracy"]),
    ("KL", ["actor/ppo_kl", "actor/kl_loss"]),
    ("entropy (actor/entropy)", ["actor/entropy"]),
    ("response length (mean)", ["response_length/mean"]),
]
STYLES = ["-", "--", ":"]


def plot_runs(rows: list[dict], out_png: str) -> str:
    """Subplots of reward, held-out accuracy, KL, entropy and response length vs iteration, a line per run."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    # A bare Figure on an Agg canvas: no pyplot global state, no display needed.
    fig = Figure(figsize=(15, 8.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 3).ravel()
    colors = [f"C{i % 10}" for i in range(len(rows))]
    for ax, (title, keys) in zip(axes, PANELS, strict=False):
        for row, color in zip(rows, colors, strict=True):
            ks = list(keys)
            if keys == ["val/accuracy"] and "val/accuracy" not in row["history"]:
                ks = [k for k in row["history"] if VAL_CORE.match(k)]  # per-source accuracy when no overall
            for style, key in zip(STYLES, [k for k in ks if k in row["history"]], strict=False):
                pts = row["history"][key]
                suffix = "" if len(keys) == 1 and key == keys[0] else f" {_label(key)}"
                ax.plot(
                    [s for s, _ in pts],
                    [v for _, v in pts],
                    style,
                    color=color,
                    marker="o",
                    ms=3,
                    label=row["run"] + suffix,
                )
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # iterations are whole steps
        ax.grid(alpha=0.3)
        if title == "KL" and ax.has_data():
            ax.legend(fontsize="small")  # tells ppo_kl from kl_loss lines
    axes[-1].axis("off")
    handles = [Line2D([], [], color=c, label=r["run"]) for r, c in zip(rows, colors, strict=True)]
    axes[-1].legend(handles=handles, loc="center", title="runs")
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return str(out)


def _reason(err: Exception, tracking_uri: str) -> str:
    text = " ".join(str(err).split())
    if any(s in text for s in ("Failed to establish a new connection", "Max retries exceeded", "timed out")):
        return f"cannot reach the MLflow tracking server at {tracking_uri} ({text[:200]})"
    return text[:400]


def main(argv: list[str] | None = None) -> int:
    apply_defaults()
    # MLflow's default (7 retries, exponential backoff) would keep a typo'd server URI hanging for minutes.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    parser = argparse.ArgumentParser(
        prog="rlstage compare", description="Compare training runs tracked in MLflow"
    )
    parser.add_argument("runs", nargs="+", metavar="RUN", help="run names (the rlstage.run_name tag)")
    parser.add_argument(
        "--tracking-uri",
        default=os.environ.get("MLFLOW_TRACKING_URI") or mlflow_uri(),
        help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else the local home's store that runs log to)",
    )
    parser.add_argument("--experiment", default="rlstage", help="MLflow experiment (default: rlstage)")
    parser.add_argument("--png", default=None, help="also write plots of the runs to this PNG")
    parser.add_argument(
        "--store", default=None, help="read the runs' committed metrics from this store root instead of MLflow"
    )
    args = parser.parse_args(argv)
    if args.store:
        from rlstage.infra.store import StoreError

        try:
            rows = compare_stored_runs(args.runs, args.store, out_png=args.png)
        except (ValueError, StoreError) as err:
            print(f"rlstage compare: {err}", file=sys.stderr)
            return 2
        print(format_table(rows))
        return 0
    from mlflow.exceptions import MlflowException

    try:
        rows = compare_runs(args.runs, args.tracking_uri, args.experiment, args.png)
    except (ValueError, MlflowException, OSError) as err:
        print(f"rlstage compare: {_reason(err, args.tracking_uri)}", file=sys.stderr)
        return 2
    print(format_table(rows))
    if args.png:
        print(f"plots: {Path(args.png).resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
