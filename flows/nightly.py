"""Nightly continuation: run K more iterations of a named run with its stored config."""

from __future__ import annotations

from prefect import flow

from rlstage.flows.checks import _diff, _identity, continuation_end, last_completed_iteration, stored_config
from rlstage.flows.training import resolve_config, run_training
from rlstage.infra.store import ArtifactStore
from rlstage.schemas.config import ConfigError, RunConfig, code_settings


def continuation_config(
    run_name: str,
    store_root: str,
    config_path: str | None = None,
    overrides: list[str] | None = None,
    trusted: list[str] | None = None,
) -> RunConfig:
    """The run's stored config, checked against the deployment's when one is given; the code its import paths
    ``trusted`` name (the command's own, ``rlstage nightly RUN reward.function=...``) may be imported."""
    store = ArtifactStore(store_root)
    given = None
    if config_path is not None or overrides:
        given = resolve_config(None, config_path, [*(overrides or []), f"run_name={run_name}"])
    # Code named by the deployment's own config may be imported; the stored copy must then agree with it.
    named = {path for _, path in code_settings(given.model_dump(mode="json"))} if given is not None else set()
    cfg = stored_config(store, run_name, trusted=named | set(trusted or ()))
    cfg = cfg.model_copy(update={"store": cfg.store.model_copy(update={"root": store_root})})
    if given is not None:
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
    trusted: list[str] | None = None,
) -> dict:
    """Continue ``run_name`` by ``iterations`` (up to its planned length when its lr decays over it): no gap,
    no repeat, the same MLflow run. ``trusted``: import paths of the run's code that the caller names again."""
    if iterations < 1:
        raise ConfigError(f"config error: iterations: must be >= 1, got {iterations}")
    cfg = continuation_config(run_name, store_root, config_path, overrides, trusted)
    done = last_completed_iteration(ArtifactStore(store_root), run_name)
    end = continuation_end(cfg, done, iterations)
    cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"iterations": end})})
    return run_training(cfg, first=done + 1)
