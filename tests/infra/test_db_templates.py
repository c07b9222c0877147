"""infra/db_templates.py: a new home's Prefect and MLflow databases start from the shipped schema of the installed
versions, which must be exactly what their own migrations produce."""

from __future__ import annotations

import importlib.metadata
import sqlite3

import pytest

from rlstage.infra import db_templates
from rlstage.infra.db_templates import KINDS, seed, seed_mlflow_uri, seed_prefect_home


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> dict:
    """Each kind's database migrated from nothing by its installed version (once for the module's tests)."""
    return {kind: db_templates.migrated(kind, tmp_path_factory.mktemp(kind)) for kind in KINDS}


def test_the_shipped_schemas_are_what_the_installed_versions_migrate_to(tmp_path, fresh):
    for kind in KINDS:
        assert db_templates.template(kind).is_file(), (
            f"no schema ships for {kind} {importlib.metadata.version(kind)}: run python -m rlstage.infra.db_templates dump"
        )
    for kind in KINDS:
        assert seed(kind, tmp_path / f"shipped-{kind}.db")
        assert _normalized(tmp_path / f"shipped-{kind}.db") == _normalized(fresh[kind]), (
            f"{db_templates.template(kind)} is stale: run python -m rlstage.infra.db_templates dump"
        )


def _normalized(db) -> dict:
    """Each schema entry's SQL as a set of lines, and every row: a migration's order of constraints and indexes
    varies from run to run (sets), what they declare does not."""
    con = sqlite3.connect(db)
    try:
        entries = {(t, n): frozenset(ln.strip().rstrip(",").strip() for ln in sql.splitlines())
                   for t, n, sql in con.execute("SELECT type, name, sql FROM sqlite_master WHERE sql IS NOT NULL")}  # fmt: skip
        rows = {n: sorted(map(repr, con.execute(f'SELECT * FROM "{n}"'))) for (t, n) in entries if t == "table"}
    finally:
        con.close()
    return {"schema": entries, "rows": rows}


def _version(db) -> str:
    con = sqlite3.connect(db)
    try:
        return con.execute("SELECT version_num FROM alembic_version").fetchone()[0]
    finally:
        con.close()


def test_a_new_database_is_seeded_once_and_an_existing_one_is_kept(tmp_path, monkeypatch, fresh):
    for k in db_templates._PREFECT_DB_SETTINGS:
        monkeypatch.delenv(k, raising=False)
    assert seed_prefect_home(tmp_path / "prefect")
    db = tmp_path / "prefect" / "prefect.db"
    assert _version(db) == _version(fresh["prefect"])
    con = sqlite3.connect(db)
    with con:
        con.execute("UPDATE alembic_version SET version_num = 'mine'")
    con.close()
    assert not seed_prefect_home(tmp_path / "prefect") and _version(db) == "mine"  # never replaced
    assert [p.name for p in db.parent.iterdir()] == ["prefect.db"]  # no temporary file left
    # another database configured, another tracking backend, another version: nothing written
    monkeypatch.setenv("PREFECT_API_DATABASE_CONNECTION_URL", "postgresql+asyncpg://x")
    assert not seed_prefect_home(tmp_path / "other") and not seed("prefect", tmp_path / "other" / "prefect.db")
    assert not (tmp_path / "other").exists()
    assert not seed_mlflow_uri("http://127.0.0.1:5000") and not seed_mlflow_uri(f"postgresql://{tmp_path}/m")
    monkeypatch.setattr(db_templates, "TEMPLATES", tmp_path / "none")
    assert not seed("mlflow", tmp_path / "m.db") and not (tmp_path / "m.db").exists()


def test_a_seeded_mlflow_store_makes_its_default_experiment_where_it_opens(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}"
    assert seed_mlflow_uri(uri)
    client = MlflowClient(uri)
    (default,) = client.search_experiments()
    assert default.name == "Default" and str(tmp_path) not in db_templates.template("mlflow").read_text()
    run = client.create_run(client.create_experiment("mine"))
    client.log_metric(run.info.run_id, "reward", 1.0)
    assert client.get_metric_history(run.info.run_id, "reward")[0].value == 1.0


@pytest.mark.parametrize("kind", KINDS)
def test_the_schema_holds_no_path_of_the_machine_it_was_dumped_on(kind):
    text = db_templates.template(kind).read_text()
    assert "/tmp/" not in text and "/work/" not in text and "/home/" not in text
