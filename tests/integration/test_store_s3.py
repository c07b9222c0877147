"""The artifact store against a real S3 protocol server (moto's), conditional writes included."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

pytest.importorskip("s3fs", reason="s3fs is not installed (pip install -e '.[dev]')")
pytest.importorskip("moto.server", reason="moto[server] is not installed (pip install -e '.[dev]')")
boto3 = pytest.importorskip("boto3", reason="boto3 is not installed (pip install -e '.[dev]')")

from rlstage.infra.env import free_port  # noqa: E402
from rlstage.infra.store import ArtifactCorrupt, ArtifactStore, CommitConflict  # noqa: E402

BUCKET = "rlstage-test"
CREDS = {"key": "testing", "secret": "testing"}
RUN = "run-s3"


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with pytest.MonkeyPatch.context() as mp:
        # Dummy credentials and no instance-metadata probing: nothing may leave the machine.
        for k, v in {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }.items():
            mp.setenv(k, v)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        exe = Path(sys.executable).with_name("moto_server")
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "moto.server"]
        proc = subprocess.Popen(
            [*cmd, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            deadline = time.monotonic() + 20
            while True:
                try:
                    urllib.request.urlopen(f"{url}/moto-api/", timeout=1).close()
                    break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        pytest.fail(f"moto server did not start on {url} (exit code {proc.poll()})")
                    time.sleep(0.05)
            # s3fs mkdir cannot create buckets in us-east-1: boto3 does it.
            boto3.client("s3", endpoint_url=url, region_name="us-east-1").create_bucket(Bucket=BUCKET)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def store(endpoint: str, request: pytest.FixtureRequest) -> ArtifactStore:
    # A prefix per test keeps tests independent on the shared server.
    s = ArtifactStore(f"s3://{BUCKET}/{request.node.name}/", {"endpoint_url": endpoint, **CREDS})
    s.backoff_base = 0.0
    return s


@pytest.fixture
def s3(endpoint: str):
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")


def table(n: int = 4) -> pa.Table:
    return pa.table({"sample_id": [f"s{i}" for i in range(n)], "ids": [[i, i + 1] for i in range(n)]})


def commit(store: ArtifactStore, iteration: int | None = 1, **kw):
    kw.setdefault("tables", {"rollouts.parquet": table()})
    return store.commit(
        RUN, iteration, "rollout", key="k", config_hash="c", code_version="v", inputs={}, **kw
    )


def key_of(store: ArtifactStore, uri: str) -> str:
    assert uri.startswith(f"s3://{BUCKET}/")
    return uri[len(f"s3://{BUCKET}/") :]


def test_round_trip(store: ArtifactStore, s3, tmp_path: Path) -> None:
    store.check_writable()
    assert store.root == f"s3://{BUCKET}/test_round_trip"
    assert store.manifest(RUN, 1, "rollout") is None
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "w.bin").write_bytes(os.urandom(1000))
    m = commit(store, blobs={"notes.txt": b"hi"}, dirs={"model": str(model)})
    folder = store.artifact_dir(RUN, 1, "rollout")
    assert folder == f"s3://{BUCKET}/test_round_trip/{RUN}/iter-000001/rollout"
    assert store.uri(m, "rollouts") == f"{folder}/rollouts.parquet"
    listed = s3.list_objects_v2(Bucket=BUCKET, Prefix=key_of(store, folder))["Contents"]
    assert sorted(o["Key"].rsplit("/", 1)[-1] for o in listed) == [
        "_manifest.json",
        "config.json",
        "notes.txt",
        "rollouts.parquet",
        "w.bin",
    ]
    assert store.manifest(RUN, 1, "rollout") == m
    assert store.committed(RUN, 1, "rollout", "k") == m
    assert store.read_table(m, "rollouts.parquet").equals(table())
    assert store.read_bytes(m, "notes.txt") == b"hi"
    out = store.fetch_dir(m, "model", str(tmp_path / "fetched"))
    assert Path(out, "w.bin").read_bytes() == (model / "w.bin").read_bytes()
    assert store.iterations(RUN) == [1]
    commit(store, version="replay")
    assert store.versions(RUN, 1, "rollout") == ["main", "replay"]
    store.delete(RUN, 1, "rollout", version="replay")
    assert store.versions(RUN, 1, "rollout") == ["main"]
    # A recommit replaces the artifact; files the new one lacks are swept.
    m2 = commit(store, tables={"rollouts.parquet": table(2)})
    assert store.read_table(m2, "rollouts").num_rows == 2
    assert set(m2.files) == {"rollouts.parquet"}
    listed = s3.list_objects_v2(Bucket=BUCKET, Prefix=key_of(store, folder))["Contents"]
    assert len(listed) == 2


def test_checksum_refusal(store: ArtifactStore, s3) -> None:
    m = commit(store)
    uri = store.uri(m, "rollouts.parquet")
    body = bytearray(s3.get_object(Bucket=BUCKET, Key=key_of(store, uri))["Body"].read())
    body[len(body) // 2] ^= 0xFF
    s3.put_object(Bucket=BUCKET, Key=key_of(store, uri), Body=bytes(body))
    with pytest.raises(ArtifactCorrupt, match=f"{uri}: sha256"):
        store.read_table(m, "rollouts")
    s3.delete_object(Bucket=BUCKET, Key=key_of(store, uri))
    with pytest.raises(ArtifactCorrupt, match=f"{uri}: file listed in the manifest is missing"):
        store.read_table(m, "rollouts")


def test_manifest_create_is_exactly_once(store: ArtifactStore, s3, monkeypatch: pytest.MonkeyPatch) -> None:
    path = f"{BUCKET}/test_manifest_create_is_exactly_once/x/_manifest.json"
    store._create_exclusive(path, b"first")
    with pytest.raises(FileExistsError):  # the server refuses the second If-None-Match: * put
        store._create_exclusive(path, b"second")
    assert store.fs.cat_file(path) == b"first"

    # Through commit(): another writer's manifest lands between our data writes and our create.
    real_create = store._create_exclusive

    def racing(p: str, data: bytes) -> None:
        s3.put_object(
            Bucket=BUCKET, Key=p.split("/", 1)[1], Body=data.replace(b'"key": "k"', b'"key": "theirs"')
        )
        real_create(p, data)

    monkeypatch.setattr(store, "_create_exclusive", racing)
    with pytest.raises(
        CommitConflict, match=r"s3://.*/rollout/_manifest\.json was committed by another writer"
    ):
        commit(store)
    assert store.manifest(RUN, 1, "rollout").key == "theirs"


def test_concurrent_creates_have_one_winner(store: ArtifactStore) -> None:
    path = f"{BUCKET}/test_concurrent_creates_have_one_winner/_manifest.json"
    wins: list[int] = []
    losses: list[int] = []
    barrier = threading.Barrier(8)

    def go(i: int) -> None:
        barrier.wait()
        try:
            store._create_exclusive(path, str(i).encode())
            wins.append(i)
        except FileExistsError:
            losses.append(i)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1 and len(losses) == 7
    assert store.fs.cat_file(path) == str(wins[0]).encode()


def test_put_json_exclusive(store: ArtifactStore) -> None:
    assert store.get_json(RUN, "run.json") is None
    store.put_json(RUN, "run.json", {"a": 1}, exclusive=True)
    with pytest.raises(
        CommitConflict, match=f"s3://{BUCKET}/test_put_json_exclusive/{RUN}/run.json already exists"
    ):
        store.put_json(RUN, "run.json", {"a": 2}, exclusive=True)
    assert store.get_json(RUN, "run.json") == {"a": 1}
    store.put_json(RUN, "run.json", {"a": 3})
    assert store.get_json(RUN, "run.json") == {"a": 3}
    store.delete_json(RUN, "run.json")
    assert store.get_json(RUN, "run.json") is None


def test_missing_bucket_is_not_writable(endpoint: str) -> None:
    from rlstage.infra.store import StoreError

    store = ArtifactStore("s3://no-such-bucket-here/p", {"endpoint_url": endpoint, **CREDS})
    with pytest.raises(StoreError, match="store root s3://no-such-bucket-here/p cannot be written"):
        store.check_writable()


def test_prefix_siblings_are_untouched(store: ArtifactStore) -> None:
    # S3 has no folders: replacing or deleting "roll" must not touch "rollout" or "roll@v2".
    def put(stage: str, version: str = "main", n: int = 3):
        return store.commit(
            RUN,
            1,
            stage,
            key="k",
            config_hash="c",
            code_version="v",
            inputs={},
            tables={"t": table(n)},
            blobs={f"{stage}-{version}.bin": b"x"},
            version=version,
        )

    keep = [put("rollout"), put("roll", "v2")]
    put("roll")
    put("roll", n=1)  # a recommit sweeps stale files of its own folder only
    assert store.versions(RUN, 1, "roll") == ["main", "v2"]
    store.delete(RUN, 1, "roll")
    assert store.versions(RUN, 1, "roll") == ["v2"]
    for m in keep:
        assert store.read_table(m, "t").num_rows == 3
        assert store.read_bytes(m, f"{m.stage}-{m.version}.bin") == b"x"


def test_unnamed_precondition_failure_is_a_conflict(
    store: ArtifactStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Some S3 servers omit <Condition> in the 412, which s3fs then reports as OSError(EINVAL).
    from botocore.exceptions import ClientError

    def refuse(path: str, data: bytes, mode: str = "overwrite") -> None:
        cause = ClientError({"Error": {"Code": "PreconditionFailed", "Message": "no"}}, "PutObject")
        raise OSError(22, "At least one of the pre-conditions you specified did not hold") from cause

    monkeypatch.setattr(store.fs, "pipe_file", refuse)
    with pytest.raises(CommitConflict, match="already exists"):
        store.put_json(RUN, "run.json", {}, exclusive=True)


def test_pipeline_runs_against_s3(endpoint: str, prefect_api, tmp_path: Path) -> None:
    """Two iterations with every artifact in S3 (moto on loopback), then a rerun that executes nothing."""
    from rlstage.flows.training import train
    from rlstage.schemas.config import load_config
    from tests_support import tiny_overrides

    cfg = load_config(
        None,
        [
            f"store.root=s3://{BUCKET}/pipeline",
            f"store.storage_options={{endpoint_url: '{endpoint}', key: testing, secret: testing}}",
            f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
            "run_name=s3run",
            *tiny_overrides(),
        ],
    )
    first = train(config=cfg)
    assert "iter-2/update" in first["executed"]
    store = ArtifactStore(cfg.store.root, cfg.store.storage_options)
    m = store.manifest("s3run", 2, "update")
    assert m is not None and "model/model.safetensors" in m.files
    assert store.read_table(store.manifest("s3run", 2, "rollout"), "rollouts.parquet").num_rows == 32
    assert train(config=cfg)["executed"] == []


def test_unreachable_endpoints_are_one_clear_error(prefect_api, tmp_path: Path) -> None:
    from rlstage.flows.training import train
    from rlstage.infra.store import StoreError
    from rlstage.infra.tracking import TrackingUnavailable
    from rlstage.schemas.config import load_config
    from tests_support import tiny_overrides

    closed = f"http://127.0.0.1:{free_port()}"
    base = ["run_name=unreach", *tiny_overrides()]
    cfg = load_config(None, [f"store.root={tmp_path / 'store'}", f"tracking.tracking_uri={closed}", *base])
    with pytest.raises(TrackingUnavailable, match="is unreachable"):
        train(config=cfg)
    assert not (tmp_path / "store" / "unreach").exists()  # nothing of the run (the root's write probe is gone)
    assert not any((tmp_path / "store").glob("*")) if (tmp_path / "store").exists() else True
    cfg = load_config(
        None,
        [
            f"store.root=s3://{BUCKET}/x",
            f"store.storage_options={{endpoint_url: '{closed}', key: testing, secret: testing}}",
            "store.retries=0",
            f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
            *base,
        ],
    )
    with pytest.raises(StoreError, match="cannot be written"):
        train(config=cfg)


def test_prune_on_s3(store: ArtifactStore, s3) -> None:
    m = commit(store, blobs={"model/w.safetensors": b"w" * 64})
    store.prune(m, ("model/",), {"pruned": True})
    back = store.manifest(RUN, 1, "rollout")
    assert back.artifact_id == m.artifact_id and set(back.files) == {"rollouts.parquet"} and back.meta["pruned"]
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=key_of(store, store.root))["Contents"]]
    assert not any("/model/" in k for k in keys) and store.read_table(back, "rollouts.parquet").num_rows == 4
