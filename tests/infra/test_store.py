"""The artifact store on a local folder: visibility, verification, exactly-once commits."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pyarrow as pa
import pytest

from rlstage.infra.store import ArtifactCorrupt, ArtifactStore, CommitConflict, StoreError, parquet_bytes
from rlstage.schemas.artifacts import SCHEMA_VERSION

RUN = "run-1"


def table(n: int = 5, offset: int = 0) -> pa.Table:
    return pa.table(
        {
            "sample_id": [f"s{i + offset}" for i in range(n)],
            "score": pa.array([float(i) / 2 for i in range(n)], pa.float32()),
            "ids": [[i, i + 1, i + 2] for i in range(n)],
        }
    )


def commit(store: ArtifactStore, iteration: int | None = 1, stage: str = "rollout", key: str = "k1", **kw):
    kw.setdefault("tables", {"rollouts.parquet": table()})
    return store.commit(
        RUN, iteration, stage, key=key, config_hash="c", code_version="v0", inputs={"prompts": "abc"}, **kw
    )


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    s = ArtifactStore(str(tmp_path / "store"))
    s.backoff_base = 0.0  # retries in tests need no real sleeps
    return s


def test_round_trip(store: ArtifactStore, tmp_path: Path) -> None:
    assert store.manifest(RUN, 1, "rollout") is None
    m = commit(
        store,
        tables={"rollouts.parquet": table(), "metrics": table(2)},
        blobs={"notes.txt": b"hi"},
        meta={"metrics": {"a": 1.0}},
    )
    assert m.schema_version == SCHEMA_VERSION and m.key == "k1" and m.inputs == {"prompts": "abc"}
    assert len(m.artifact_id) == 32 and m.created_at.endswith("+00:00")
    assert set(m.files) == {"rollouts.parquet", "metrics.parquet", "notes.txt"}
    assert m.files["rollouts.parquet"].rows == 5 and m.files["notes.txt"].rows is None
    assert store.root == str(tmp_path / "store")
    folder = tmp_path / "store" / RUN / "iter-000001" / "rollout"
    assert store.artifact_dir(RUN, 1, "rollout") == str(folder)
    assert sorted(os.listdir(folder)) == [
        "_manifest.json",
        "metrics.parquet",
        "notes.txt",
        "rollouts.parquet",
    ]
    assert store.manifest(RUN, 1, "rollout") == m
    assert store.read_table(m, "rollouts.parquet").equals(table())
    assert store.read_table(m, "metrics").equals(table(2))  # the ".parquet" suffix is optional
    assert store.read_bytes(m, "notes.txt") == b"hi"
    assert store.uri(m, "rollouts") == str(folder / "rollouts.parquet")
    # Run-level artifacts live under data/, sibling versions under <stage>@<version>.
    d = commit(store, iteration=None, stage="data_prep")
    assert store.artifact_dir(RUN, None, "data_prep").endswith(f"{RUN}/data/data_prep")
    assert store.read_table(d, "rollouts").num_rows == 5
    with pytest.raises(StoreError, match="has no file 'nope'"):
        store.read_bytes(m, "nope")


def test_files_without_manifest_are_invisible_and_overwritten(store: ArtifactStore) -> None:
    folder = Path(store.artifact_dir(RUN, 1, "rollout"))
    folder.mkdir(parents=True)
    (folder / "rollouts.parquet").write_bytes(b"half-written garbage")
    (folder / "stray.bin").write_bytes(b"left by an interrupted attempt")
    assert store.manifest(RUN, 1, "rollout") is None
    assert store.committed(RUN, 1, "rollout", "k1") is None
    assert store.iterations(RUN) == [] and store.versions(RUN, 1, "rollout") == []
    m = commit(store)
    assert store.read_table(m, "rollouts").equals(table())
    assert not (folder / "stray.bin").exists()  # garbage not part of the new artifact is swept


def test_a_commit_stopped_before_its_manifest_is_invisible_and_redone(store: ArtifactStore) -> None:
    class Stopped(Exception):
        pass

    def stop() -> None:  # where the kill drill's SIGKILL lands: every data file written, no manifest
        assert sorted(os.listdir(store.artifact_dir(RUN, 1, "rollout"))) == ["rollouts.parquet"]
        raise Stopped

    with pytest.raises(Stopped):
        commit(store, before_manifest=stop)
    assert store.manifest(RUN, 1, "rollout") is None and store.iterations(RUN) == []
    m = commit(store)
    assert store.read_table(m, "rollouts").equals(table())


def test_flipped_byte_is_refused(store: ArtifactStore) -> None:
    m = commit(store)
    path = Path(store.uri(m, "rollouts.parquet"))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ArtifactCorrupt, match=r"rollouts\.parquet: sha256 .* manifest says") as e:
        store.read_table(m, "rollouts.parquet")
    assert str(path) in str(e.value)


def test_truncated_and_missing_files_are_refused(store: ArtifactStore) -> None:
    m = commit(store, blobs={"b.bin": b"0123456789"})
    blob = Path(store.uri(m, "b.bin"))
    blob.write_bytes(b"01234")
    with pytest.raises(ArtifactCorrupt, match=r"b\.bin: size 5 bytes, manifest says 10"):
        store.read_bytes(m, "b.bin")
    Path(store.uri(m, "rollouts.parquet")).unlink()
    with pytest.raises(ArtifactCorrupt, match=r"rollouts\.parquet: file listed in the manifest is missing"):
        store.read_table(m, "rollouts")


def test_row_count_mismatch_is_refused(store: ArtifactStore) -> None:
    m = commit(store)
    entry = m.files["rollouts.parquet"]
    lying = m.model_copy(update={"files": {"rollouts.parquet": entry.model_copy(update={"rows": 6})}})
    with pytest.raises(ArtifactCorrupt, match="5 rows, manifest says 6"):
        store.read_table(lying, "rollouts.parquet")


def test_unreadable_manifest_is_corrupt(store: ArtifactStore) -> None:
    m = commit(store)
    path = Path(store.artifact_dir(RUN, 1, "rollout")) / "_manifest.json"
    path.write_text("{not json")
    with pytest.raises(ArtifactCorrupt, match="_manifest.json is unreadable"):
        store.manifest(RUN, 1, "rollout")
    # A manifest copied to another folder would point reads elsewhere: refused.
    other = Path(store.artifact_dir(RUN, 2, "rollout"))
    other.mkdir(parents=True)
    (other / "_manifest.json").write_text(m.model_dump_json())
    with pytest.raises(ArtifactCorrupt, match="not its own location"):
        store.manifest(RUN, 2, "rollout")


def test_committed_checks_the_key(store: ArtifactStore) -> None:
    m = commit(store, key="abc")
    assert store.committed(RUN, 1, "rollout", "abc") == m
    assert store.committed(RUN, 1, "rollout", "other") is None
    assert store.committed(RUN, 2, "rollout", "abc") is None


def test_recommit_removes_old_manifest_first(store: ArtifactStore, monkeypatch: pytest.MonkeyPatch) -> None:
    old = commit(store, key="old", blobs={"old-only.bin": b"x"})
    seen: list[object] = []
    real_write = store._write

    def spy(path: str, data: bytes) -> None:
        # While new data files are written, the old artifact must already be invisible.
        seen.append(store.manifest(RUN, 1, "rollout"))
        real_write(path, data)

    monkeypatch.setattr(store, "_write", spy)
    new = commit(store, key="new", tables={"rollouts.parquet": table(3, offset=10)})
    assert seen and all(s is None for s in seen)
    assert new.artifact_id != old.artifact_id
    assert store.committed(RUN, 1, "rollout", "new") == new
    assert store.read_table(new, "rollouts").equals(table(3, offset=10))
    assert not Path(store.artifact_dir(RUN, 1, "rollout"), "old-only.bin").exists()
    with pytest.raises(ArtifactCorrupt):  # the old manifest no longer matches the files
        store.read_table(old, "rollouts")


def test_same_table_gives_identical_bytes(store: ArtifactStore) -> None:
    t = table(1000)
    a = commit(store, iteration=1, tables={"t.parquet": t})
    b = commit(store, iteration=2, tables={"t.parquet": pa.concat_tables([t.slice(0, 300), t.slice(300)])})
    assert a.files["t.parquet"] == b.files["t.parquet"]
    assert Path(store.uri(a, "t")).read_bytes() == Path(store.uri(b, "t")).read_bytes()
    assert parquet_bytes(t) == parquet_bytes(t)


def test_commit_conflict_when_manifest_appears(store: ArtifactStore, monkeypatch: pytest.MonkeyPatch) -> None:
    real_create = store._create_exclusive
    other = {}

    def racing(path: str, data: bytes) -> None:
        # Another writer commits between our data writes and our manifest create.
        Path(path).write_text(json.dumps({**json.loads(data), "artifact_id": "someone-else"}))
        other["path"] = path
        real_create(path, data)

    monkeypatch.setattr(store, "_create_exclusive", racing)
    with pytest.raises(CommitConflict, match="_manifest.json was committed by another writer"):
        commit(store)
    assert store.manifest(RUN, 1, "rollout").artifact_id == "someone-else"  # theirs stands


def test_exclusive_create_has_one_winner(store: ArtifactStore, tmp_path: Path) -> None:
    path = str(tmp_path / "store" / "race" / "_manifest.json")
    wins: list[int] = []
    losses: list[int] = []
    barrier = threading.Barrier(16)

    def go(i: int) -> None:
        barrier.wait()
        try:
            store._create_exclusive(path, str(i).encode())
            wins.append(i)
        except FileExistsError:
            losses.append(i)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1 and len(losses) == 15
    assert Path(path).read_text() == str(wins[0])
    assert os.listdir(Path(path).parent) == ["_manifest.json"]  # no temp files left


def test_put_json(store: ArtifactStore) -> None:
    assert store.get_json(RUN, "run.json") is None
    store.put_json(RUN, "run.json", {"a": 1}, exclusive=True)
    assert store.get_json(RUN, "run") == {"a": 1}  # the ".json" suffix is optional
    assert Path(store.root, RUN, "run.json").is_file()
    with pytest.raises(CommitConflict, match="run.json already exists"):
        store.put_json(RUN, "run.json", {"a": 2}, exclusive=True)
    assert store.get_json(RUN, "run.json") == {"a": 1}
    store.put_json(RUN, "run.json", {"a": 3})  # non-exclusive overwrites
    assert store.get_json(RUN, "run.json") == {"a": 3}
    store.delete_json(RUN, "run.json")
    store.delete_json(RUN, "run.json")  # missing is fine
    assert store.get_json(RUN, "run.json") is None


def test_unwritable_root(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    store = ArtifactStore(str(blocker / "store"))
    with pytest.raises(StoreError, match=f"store root {blocker / 'store'} cannot be written: "):
        store.check_writable()
    ArtifactStore(str(tmp_path / "ok")).check_writable()
    assert os.listdir(tmp_path / "ok") == []  # the probe is removed


def test_dirs_upload_and_fetch(store: ArtifactStore, tmp_path: Path) -> None:
    model = tmp_path / "model"
    (model / "sub").mkdir(parents=True)
    (model / "config.json").write_text('{"hidden": 8}')
    (model / "model.safetensors").write_bytes(os.urandom(3000))
    (model / "sub" / "tok.json").write_text("{}")
    m = commit(store, stage="update", dirs={"model": str(model)})
    assert {"model/config.json", "model/model.safetensors", "model/sub/tok.json"} <= set(m.files)
    out = store.fetch_dir(m, "model", str(tmp_path / "fetched"))
    for rel in ("config.json", "model.safetensors", "sub/tok.json"):
        assert Path(out, rel).read_bytes() == (model / rel).read_bytes()
    assert store.read_bytes(m, "model/config.json") == b'{"hidden": 8}'
    assert store.uri(m, "model") == str(Path(store.artifact_dir(RUN, 1, "update"), "model"))
    # A corrupted remote copy is refused, and no unverified file is left under the final name.
    remote = Path(store.artifact_dir(RUN, 1, "update"), "model", "model.safetensors")
    remote.write_bytes(b"x" * 3000)
    dst = tmp_path / "fresh"
    with pytest.raises(ArtifactCorrupt, match="model.safetensors: sha256"):
        store.fetch_dir(m, "model", str(dst))
    assert not (dst / "model.safetensors").exists()
    assert [p.name for p in dst.iterdir()] == ["config.json"]
    # Already-verified local files are kept: the warm copy needs no remote read.
    assert store.fetch_dir(m, "model", out) == out
    with pytest.raises(StoreError, match="has no folder 'weights'"):
        store.fetch_dir(m, "weights", str(dst))


def test_files_another_writer_put_are_committed_with_its_entries(store: ArtifactStore, tmp_path: Path) -> None:
    """A trainer rank puts its optimizer partition into the artifact; rank 0's commit lists it. Until then
    nothing of it is visible (a stale manifest goes first), and a listed file that is not there at its size
    fails the commit before any manifest."""
    old = commit(store, stage="update", dirs={"model": str(_folder(tmp_path / "m", b"weights"))})
    part = _folder(tmp_path / "part", os.urandom(500))
    entries = store.put_files(RUN, 1, "update", "trainer_state/rank-1", str(part))
    assert store.manifest(RUN, 1, "update") is None and old.files  # the stale commit is gone first
    assert set(entries) == {"trainer_state/rank-1/a.safetensors"}
    m = commit(store, stage="update", dirs={"model": str(_folder(tmp_path / "m2", b"new"))}, written=entries)
    assert m.files["trainer_state/rank-1/a.safetensors"] == entries["trainer_state/rank-1/a.safetensors"]
    fetched = store.fetch_dir(m, "trainer_state/rank-1", str(tmp_path / "got"))
    assert Path(fetched, "a.safetensors").read_bytes() == (part / "a.safetensors").read_bytes()
    lost = {"trainer_state/rank-2/a.safetensors": entries["trainer_state/rank-1/a.safetensors"]}
    with pytest.raises(StoreError, match=r"rank-2/a.safetensors: written by another writer as 500 bytes, found None"):
        commit(store, stage="update", key="k2", written=lost)
    assert store.manifest(RUN, 1, "update") is None


def _folder(path: Path, data: bytes) -> Path:
    path.mkdir(parents=True)
    (path / "a.safetensors").write_bytes(data)
    return path


def test_iterations_and_versions(store: ArtifactStore) -> None:
    commit(store, iteration=3)
    commit(store, iteration=1, stage="reward")
    commit(store, iteration=12, version="replay-b")
    commit(store, iteration=12)
    commit(store, iteration=12, version="replay-a")
    commit(store, iteration=None, stage="data_prep")
    Path(store.artifact_dir(RUN, 7, "rollout")).mkdir(parents=True)  # uncommitted: not listed
    assert store.iterations(RUN) == [1, 3, 12]
    assert store.versions(RUN, 12, "rollout") == ["main", "replay-a", "replay-b"]
    assert store.versions(RUN, 3, "rollout") == ["main"]
    assert store.versions(RUN, None, "data_prep") == ["main"]
    assert store.versions(RUN, 7, "rollout") == []
    assert store.iterations("other-run") == []
    m = store.manifest(RUN, 12, "rollout", version="replay-a")
    assert m is not None and m.version == "replay-a"
    assert store.artifact_dir(RUN, 12, "rollout", "replay-a").endswith("iter-000012/rollout@replay-a")
    store.delete(RUN, 12, "rollout", version="replay-a")
    assert store.versions(RUN, 12, "rollout") == ["main", "replay-b"]
    assert not Path(store.artifact_dir(RUN, 12, "rollout", "replay-a")).exists()
    store.delete(RUN, 12, "rollout", version="replay-a")  # idempotent


@pytest.mark.parametrize("bad", ["../etc", "a/b", "", ".hidden", "a..b", "-x", "sp ace"])
def test_bad_names_rejected(store: ArtifactStore, bad: str) -> None:
    with pytest.raises(StoreError, match="invalid run name"):
        store.manifest(bad, 1, "rollout")
    with pytest.raises(StoreError, match="invalid stage"):
        commit(store, stage=bad)
    with pytest.raises(StoreError, match="invalid version"):
        store.artifact_dir(RUN, 1, "rollout", version=bad)
    with pytest.raises(StoreError, match="invalid run name"):
        store.put_json(bad, "run.json", {})


def test_bad_file_names_and_iterations_rejected(store: ArtifactStore) -> None:
    for name in ("../x", "/abs", "a//b", "_manifest.json"):
        with pytest.raises(StoreError, match="invalid artifact file name"):
            commit(store, blobs={name: b""})
    with pytest.raises(StoreError, match="given twice"):
        commit(store, tables={"t": table()}, blobs={"t.parquet": b""})
    with pytest.raises(StoreError, match="invalid iteration"):
        commit(store, iteration=-1)
    with pytest.raises(StoreError, match="not JSON-serializable"):
        commit(store, meta={"x": object()})
    assert not Path(store.artifact_dir(RUN, 1, "rollout")).exists()  # nothing was written


def test_transient_errors_are_retried(store: ArtifactStore, monkeypatch: pytest.MonkeyPatch) -> None:
    m = commit(store)
    real_cat = store.fs.cat_file
    calls = {"n": 0}

    def flaky(path: str, *a, **kw) -> bytes:
        calls["n"] += 1
        if calls["n"] <= 2:
            raise ConnectionResetError("connection reset by peer")
        return real_cat(path, *a, **kw)

    monkeypatch.setattr(store.fs, "cat_file", flaky)
    assert store.read_table(m, "rollouts").equals(table())
    assert calls["n"] == 3
    calls["n"] = -10  # more failures than retries: a StoreError naming the URI
    with pytest.raises(StoreError, match=r"rollouts\.parquet: ConnectionResetError.*after 4 attempts"):
        store.read_table(m, "rollouts")

    def denied(path: str, *a, **kw) -> bytes:
        calls["n"] += 1
        raise PermissionError("denied")

    calls["n"] = 0
    monkeypatch.setattr(store.fs, "cat_file", denied)
    with pytest.raises(StoreError, match="PermissionError"):
        store.read_bytes(m, "rollouts.parquet")
    assert calls["n"] == 1  # permanent errors are not retried


def test_lost_reply_of_own_create_is_success(store: ArtifactStore, monkeypatch: pytest.MonkeyPatch) -> None:
    real_create = store._create_exclusive

    def landed_then_failed(path: str, data: bytes) -> None:
        # The put succeeded but its reply was lost; the retry then meets our own manifest.
        real_create(path, data)
        raise FileExistsError(path)

    monkeypatch.setattr(store, "_create_exclusive", landed_then_failed)
    m = commit(store)
    assert store.manifest(RUN, 1, "rollout") == m


def test_prefix_siblings_are_untouched(store: ArtifactStore) -> None:
    keep = [commit(store, stage="rollout"), commit(store, stage="roll", version="v2")]
    commit(store, stage="roll", blobs={"extra": b"1"})
    commit(store, stage="roll")
    store.delete(RUN, 1, "roll")
    assert store.versions(RUN, 1, "roll") == ["v2"]
    for m in keep:
        assert store.read_table(m, "rollouts").num_rows == 5


def test_prune_drops_files_keeps_the_id_and_stays_signed(store: ArtifactStore, monkeypatch: pytest.MonkeyPatch) -> None:
    from rlstage.infra.store import HMAC_KEY_ENV

    monkeypatch.setenv(HMAC_KEY_ENV, "team-secret")
    m = commit(store, stage="update", blobs={"model/w.safetensors": b"w" * 64, "trainer_state/s.json": b"{}"})
    pruned = store.prune(m, ("model/", "trainer_state/"), {"pruned": True})
    back = store.manifest(RUN, 1, "update")  # the signature is checked on read
    assert back == pruned and back.artifact_id == m.artifact_id and back.meta["pruned"]
    assert set(back.files) == {"rollouts.parquet"} and store.read_table(back, "rollouts.parquet").num_rows == 5
    folder = Path(store.artifact_dir(RUN, 1, "update"))
    assert sorted(p.name for p in folder.rglob("*") if p.is_file()) == ["_manifest.json", "rollouts.parquet"]
    assert store.prune(back, ("model/",), {"again": True}) is back  # nothing left to drop: untouched


def test_a_symbolic_link_inside_the_store_is_refused_never_followed(store: ArtifactStore, tmp_path: Path) -> None:
    """A file of an artifact replaced by a link (to /etc/passwd, or to a copy of its own bytes that passes the
    checksum) and an artifact folder replaced by a link are refused by every read; the root may be a link."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden": 8}')
    commit(store)
    m = commit(store, stage="update", dirs={"model": str(model)}, blobs={"b.bin": b"0123456789"})
    blob = Path(store.uri(m, "b.bin"))
    same = tmp_path / "same.bin"
    same.write_bytes(blob.read_bytes())  # what the link points at passes the checksum
    blob.unlink()
    blob.symlink_to(same)
    with pytest.raises(ArtifactCorrupt, match=rf"^{blob}: a symbolic link inside the store \(to {same}\); it is not followed$"):
        store.read_bytes(m, "b.bin")
    config = Path(store.uri(m, "model/config.json"))
    config.unlink()
    config.symlink_to("/etc/passwd")
    with pytest.raises(ArtifactCorrupt, match="a symbolic link inside the store"):
        store.fetch_dir(m, "model", str(tmp_path / "fetched"))
    assert not (tmp_path / "fetched" / "config.json").exists()
    # a whole artifact folder moved aside and linked back: its manifest is refused with it
    folder = Path(store.artifact_dir(RUN, 1, "update"))
    folder.rename(tmp_path / "aside")
    folder.symlink_to(tmp_path / "aside")
    with pytest.raises(ArtifactCorrupt, match="a symbolic link inside the store"):
        store.manifest(RUN, 1, "update")
    # a store whose root is reached through a link reads as usual
    (tmp_path / "root-link").symlink_to(tmp_path / "store")
    linked = ArtifactStore(str(tmp_path / "root-link"))
    assert linked.read_table(linked.manifest(RUN, 1, "rollout"), "rollouts.parquet").equals(table())


def test_a_manifest_entry_outside_its_artifact_is_refused_with_the_manifest(store: ArtifactStore) -> None:
    commit(store)
    path = Path(store.artifact_dir(RUN, 1, "rollout")) / "_manifest.json"
    doc = json.loads(path.read_text())
    doc["files"]["../../secret.txt"] = doc["files"]["rollouts.parquet"]
    path.write_text(json.dumps(doc))
    with pytest.raises(ArtifactCorrupt, match=r"_manifest\.json lists invalid file name '\.\./\.\./secret\.txt'"):
        store.manifest(RUN, 1, "rollout")
