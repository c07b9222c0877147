"""Data preparation on its own: the run's prompts artifact (train and test splits), committed once.

A later training run of the same name and config reuses it (the stage is skipped as committed);
one with a conflicting config is refused, as for every invocation of a run.
"""

from __future__ import annotations

from prefect import flow

from rlstage.engines.preflight import preflight
from rlstage.flows.checks import check_inputs, check_run_config, record_run_config
from rlstage.flows.training import name_flow_run, resolve_config
from rlstage.infra.env import apply_defaults
from rlstage.infra.lease import run_lease
from rlstage.schemas.config import RunConfig
from rlstage.tasks import stages
from rlstage.tasks.runtime import store_for


@flow(name="rlstage-data-prep")
def prepare_data(
    config: RunConfig | None = None, config_path: str | None = None, overrides: list[str] | None = None
) -> dict:
    """Commit the prompts of ``config``'s run: synthetic task, GSM8K jsonl or verl-format parquet."""
    apply_defaults()
    cfg = resolve_config(config, config_path, overrides)
    name_flow_run(f"{cfg.run_name} data prep")
    check_inputs(cfg)
    preflight(cfg)
    store = store_for(cfg)
    store.check_writable()
    check_run_config(store, cfg)
    with run_lease(store, cfg.run_name, label="data-prep flow"):
        result = stages.result_of(stages.data_prep(cfg))  # no model involved: runs in the flow's process, not on Ray
        record_run_config(store, cfg)  # only once the data was read
    m = result.manifest
    return {
        "run": cfg.run_name,
        "executed": result.executed,
        "train": store.uri(m, "train.parquet"),
        "test": store.uri(m, "test.parquet"),
        "train_rows": m.meta["metrics"]["data/train_prompts"],
        "test_rows": m.meta["metrics"]["data/test_prompts"],
    }
