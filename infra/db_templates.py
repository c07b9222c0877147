"""A new home's Prefect and MLflow databases start migrated: written from a schema that ships with rlstage
(``infra/db_templates/<kind>-<version>.sql``) instead of running every schema migration when the first server or
tracking store opens them (Prefect's ~6 CPU-s, most of a cold command's wait for its server here). Only for the
exact version the schema was dumped from: with any other installed version the database migrates as before.

Regenerate after a Prefect or MLflow upgrade: ``python -m rlstage.infra.db_templates dump`` (tests/infra/test_db_templates.py
fails until then).
"""

from __future__ import annotations

import importlib.metadata
import os
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

TEMPLATES = Path(__file__).with_name("db_templates")
KINDS = ("prefect", "mlflow")
# Environment settings that point Prefect's server at a database other than <PREFECT_HOME>/prefect.db
_PREFECT_DB_SETTINGS = ("PREFECT_API_DATABASE_CONNECTION_URL", "PREFECT_SERVER_DATABASE_CONNECTION_URL")


def template(kind: str) -> Path:
    """The schema file for the installed version of ``kind`` (which may not exist)."""
    return TEMPLATES / f"{kind}-{importlib.metadata.version(kind)}.sql"


def seed(kind: str, db: str | Path) -> bool:
    """Write the migrated, empty database of ``kind`` at ``db`` when nothing is there yet and a schema of the
    installed version ships; True if it did. A database someone else created meanwhile is never replaced, and
    Prefect's is left alone where another database is configured for its server."""
    db = Path(db)
    if db.exists() or (kind == "prefect" and any(os.environ.get(k) for k in _PREFECT_DB_SETTINGS)):
        return False
    schema = template(kind)
    if not schema.is_file():
        return False
    db.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{db.name}.", dir=db.parent)
    os.close(fd)
    try:
        con = sqlite3.connect(tmp)
        try:
            con.executescript(schema.read_text())
        finally:
            con.close()
        os.link(tmp, db)  # fails where another process put its database first: that one stays
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)


def seed_prefect_home(home: str | Path) -> bool:
    """``seed`` for the database of a Prefect server whose home is ``home``."""
    return seed("prefect", Path(home) / "prefect.db")


def seed_mlflow_uri(uri: str) -> bool:
    """``seed`` for a local MLflow tracking URI (``sqlite:///path``); any other URI is left alone."""
    return uri.startswith("sqlite:///") and seed("mlflow", uri.removeprefix("sqlite:///"))


def schema_of(db: Path) -> str:
    """The SQL that recreates ``db`` (schema and rows)."""
    con = sqlite3.connect(db)
    try:
        return "\n".join(con.iterdump()) + "\n"
    finally:
        con.close()


def migrated(kind: str, folder: Path) -> Path:
    """A database of ``kind`` migrated from nothing by the installed version itself, under ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    db = folder / f"{kind}.db"
    if kind == "prefect":
        env = {k: v for k, v in os.environ.items() if k not in _PREFECT_DB_SETTINGS}
        env.update(PREFECT_HOME=str(folder))
        subprocess.run([sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"], env=env, check=True,
                       capture_output=True)  # fmt: skip
        (folder / "prefect.db").rename(db)
    else:
        from mlflow.store.model_registry.sqlalchemy_store import SqlAlchemyStore as Registry
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore as Tracking

        Tracking(f"sqlite:///{db}", str(folder / "artifacts"))
        Registry(f"sqlite:///{db}")
        con = sqlite3.connect(db)
        with con:  # its Default experiment names this folder: MLflow creates it again where the store opens
            con.execute("DELETE FROM experiments")
        con.close()
    return db


def dump(out: Path = TEMPLATES) -> list[Path]:
    """Write the schema of each kind's installed version under ``out`` (other versions' files removed)."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in KINDS:
            path = out / template(kind).name
            path.write_text(schema_of(migrated(kind, Path(tmp) / kind)))
            for old in out.glob(f"{kind}-*.sql"):
                if old != path:
                    old.unlink()
            written.append(path)
    return written


if __name__ == "__main__":
    # dump  |  seed KIND DB  (infra/stack.sh, before it starts a server on a new home)
    if sys.argv[1:2] == ["dump"]:
        for p in dump():
            print(p)
    elif sys.argv[1:2] == ["seed"] and len(sys.argv) == 4:
        seed(sys.argv[2], sys.argv[3])
    else:
        sys.exit("usage: python -m rlstage.infra.db_templates dump | seed KIND DB")
