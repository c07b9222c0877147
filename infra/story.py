"""What a replay or an extra evaluation adds to its run's story: a Prefect artifact under a key of the run
and an MLflow run nested in the training run's own (``infra/tracking.py: log_result``)."""

from __future__ import annotations

import re
import sys

from rlstage.infra.tracking import log_result
from rlstage.schemas.config import RunConfig


def artifact_key(run_name: str, what: str) -> str:
    """A Prefect artifact key of the run (Prefect allows lowercase letters, digits and dashes only)."""
    return re.sub(r"[^a-z0-9-]", "-", f"{run_name}-{what}".lower())


def _mlflow(cfg: RunConfig, *args) -> str | None:
    """The result as a nested MLflow run; a tracking store that fails leaves the result printed, not lost."""
    try:
        return log_result(cfg, *args)
    except Exception as err:  # the replay or eval is committed in the store: tracking is its report only
        first = (str(err).splitlines() or [""])[0]
        print(f"rlstage: warning: the result was not logged to MLflow: {type(err).__name__}: {first}", file=sys.stderr)
        return None


def publish_replay(cfg: RunConfig, summary: dict, overrides: list[str], replay_of: str) -> dict:
    """``summary`` (flows/replay.py: summarize) as a markdown artifact ``<run>-replay`` (a version per replay)
    and a nested MLflow run holding the replayed metrics and ``replay/<stage>/identical``."""
    from prefect.artifacts import create_markdown_artifact

    stage, it = summary["stage"], summary["iteration"]
    lines = [
        f"# Replay of `{stage}`, iteration {it}, run `{cfg.run_name}`",
        f"Version `{summary['version']}` of artifact `{replay_of}` · overrides: `{' '.join(overrides) or 'none'}`",
        f"· output: `{summary['artifact']}`",
        "",
        "Output checksums " + ("**equal** the stored ones." if summary["identical"] else "**differ** from the stored ones."),
        "",
        "| file | checksum equal |",
        "|---|---|",
        *(f"| {name} | {'yes' if same else 'no'} |" for name, same in sorted(summary["files_identical"].items())),
        "",
        "| metric | stored | replayed | difference |",
        "|---|---:|---:|---:|",
        *(f"| {k} | {a:.6g} | {b:.6g} | {b - a:.3g} |" for k, (a, b) in summary["metrics"].items()),
    ]
    key = artifact_key(cfg.run_name, "replay")
    create_markdown_artifact(
        markdown="\n".join(lines), key=key, description=f"rlstage run {cfg.run_name}: replay of {stage} at iteration {it}"
    )
    metrics = {k: b for k, (_, b) in summary["metrics"].items()}
    metrics[f"replay/{stage}/identical"] = float(summary["identical"])
    tags = {
        "rlstage.replay.identical": str(summary["identical"]).lower(),
        "rlstage.replay_of": replay_of,
        "rlstage.artifact": summary["artifact"],
    }
    run_id = _mlflow(
        cfg,
        f"replay {stage} iter-{it} {summary['version']}",
        f"replay/{it}/{stage}/{summary['version']}",
        metrics,
        it,
        tags,
        {"overrides": " ".join(overrides)},
    )
    return {"prefect_artifact": key, "mlflow_run_id": run_id}


def publish_eval(cfg: RunConfig, result: dict, overrides: list[str]) -> dict:
    """``result`` (flows/evaluate.py) as a table artifact ``<run>-eval`` (a version per evaluation) and a
    nested MLflow run holding its metrics at step = the iteration."""
    from prefect.artifacts import create_table_artifact

    it = result["iteration"]
    rows = [{"name": k, "value": f"{v:.6g}"} for k, v in sorted(result["metrics"].items())]
    rows += [{"name": k, "value": str(result[k])} for k in ("policy", "version", "artifact")]
    rows.append({"name": "overrides", "value": " ".join(overrides)})
    key = artifact_key(cfg.run_name, "eval")
    create_table_artifact(table=rows, key=key, description=f"rlstage run {cfg.run_name}: evaluation of iteration {it}'s policy")
    run_id = _mlflow(
        cfg,
        f"eval iter-{it} {result['version']}",
        f"eval/{it}/{result['version']}",
        result["metrics"],
        it,
        {"rlstage.eval_of": result["policy"], "rlstage.artifact": result["artifact"]},
        {"overrides": " ".join(overrides)},
    )
    return {"prefect_artifact": key, "mlflow_run_id": run_id}


def published(result: dict) -> str:
    """One line: where a replay's or an evaluation's result was published."""
    mlflow = f", MLflow run {result['mlflow_run_id']} (nested in the run's)" if result.get("mlflow_run_id") else ""
    return f"published: Prefect artifact {result['prefect_artifact']}{mlflow}"
