"""Nightly continuation: run K more iterations of a named run with its stored config."""

from __future__ import annotations

from prefect import flow

from flows.training import _diff, _identity, resolve_config, run_training, stored_config
from infra.store import ArtifactStore
from schemas.config import ConfigError, RunConfig


def last_completed_iteration(store: ArtifactStore, run: str) -> int:
    """The highest iteration whose update is committed (0 when none is)."""
    done = [it for it in store.iterations(run) if it > 0 and store.manifest(run, it, "update") is not None]
    return max(done, default=0)


def continuation_config(
    run_name: str, store_root: str, config_path: str | None = None, overrides: list[str] | None = None
) -> RunConfig:
    """The run's stored config, checked against the deployment's when one is given."""
    store = ArtifactStore(store_root)
    cfg = stored_config(store, run_name)
    cfg = cfg.model_copy(update={"store": cfg.store.model_copy(update={"root": store_root})})
    if config_path is not None or overrides:
        given = resolve_config(None, config_path, [*(overrides or []), f"run_name={run_name}"])
        diff = _diff(_identity(cfg), _identity(given))
        if diff:
            raise ConfigError(f"config error: nightly run {run_name!r} conflicts with its stored config ({diff[0]})")
    return cfg


@flow(name="rlstage-nightly")
def nightly(
    run_name: str,
    iterations: int = 1,
    store_root: str = "./rlstage-runs",
    config_path: str | None = None,
    overrides: list[str] | None = None,
) -> dict:
    """Continue ``run_name`` by ``iterations``: no gap, no repeat, the same MLflow run."""
    if iterations < 1:
        raise ConfigError(f"config error: iterations: must be >= 1, got {iterations}")
    cfg = continuation_config(run_name, store_root, config_path, overrides)
    done = last_completed_iteration(ArtifactStore(store_root), run_name)
    cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"iterations": done + iterations})})
    return run_training(cfg, first=done + 1)
