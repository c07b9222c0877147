"""infra.explore and `rlstage inspect` on a real two-iteration run, from a local folder and from S3.

Every query is checked against the same numbers computed from the store's verified reads
(ArtifactStore.read_table) with plain Python.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import polars as pl
import pytest
from test_store_s3 import BUCKET, CREDS, endpoint  # noqa: F401 - moto's S3 server on loopback (a fixture)

from rlstage.infra.explore import QUERIES, Experience, NotCommitted, run_query
from rlstage.infra.store import ArtifactStore

RUN = "explore"


@pytest.fixture(scope="module")
def first_run(prefect_api, tmp_path_factory):
    """A tiny two-iteration run of its own (a run name no other module trains: see the closing note)."""
    from rlstage.flows.training import train
    from rlstage.schemas.config import load_config
    from tests_support import tiny_overrides

    tmp = tmp_path_factory.mktemp("explore")
    cfg = load_config(None, [f"store.root={tmp / 'store'}", f"run_name={RUN}", *tiny_overrides()])
    return cfg, train(config=cfg)


@pytest.fixture(scope="module")
def local(first_run) -> ArtifactStore:
    cfg, _ = first_run
    return ArtifactStore(cfg.store.root)


def _tables(store: ArtifactStore, it: int) -> tuple[list[dict], list[dict], list[dict]]:
    read = [
        store.read_table(store.manifest(RUN, it, stage), name).to_pylist()
        for stage, name in (("rollout", "rollouts"), ("reward", "rewards"), ("advantage", "experience"))
    ]
    return read[0], read[1], read[2]


def _expected(store: ArtifactStore) -> dict:
    """Per iteration: reward mean per source, lengths, policy-token advantages, log-prob gaps by sample."""
    out: dict = {}
    for it in (1, 2):
        ro, rw, ex = _tables(store, it)
        score = {r["sample_id"]: r["score"] for r in rw}
        exp = {r["sample_id"]: r for r in ex}
        adv, gaps = [], {}
        for r in ro:
            e = exp[r["sample_id"]]
            mask = r["response_mask"]
            adv += [a for a, m in zip(e["advantages"], mask, strict=True) if m]
            gaps[r["sample_id"]] = max(
                abs(a - b) for a, b, m in zip(r["rollout_log_probs"], e["old_log_probs"], mask, strict=True) if m
            )
        sources = sorted({r["data_source"] for r in ro})
        out[it] = {
            "reward": {s: statistics.fmean(score[r["sample_id"]] for r in ro if r["data_source"] == s) for s in sources},
            "samples": len(ro),
            "lengths": [r["response_length"] for r in ro],
            "advantages": adv,
            "gaps": gaps,
            "score": score,
        }
    return out


def _check_against_store(exp: Experience, store: ArtifactStore) -> None:
    want = _expected(store)
    assert exp.iterations == (1, 2)

    samples = exp.samples().collect()
    assert samples.height == sum(w["samples"] for w in want.values())
    assert samples.select("iteration", "sample_id").is_unique().all()
    for row in samples.select("iteration", "sample_id", "score").iter_rows():
        assert row[2] == want[row[0]]["score"][row[1]], row  # joined on sample id, not on row order

    rewards = run_query(exp, "rewards").collect()
    got = {(r["iteration"], r["data_source"]): r for r in rewards.iter_rows(named=True)}
    assert set(got) == {(it, s) for it, w in want.items() for s in w["reward"]}
    for (it, source), r in got.items():
        assert r["reward_mean"] == pytest.approx(want[it]["reward"][source], abs=1e-6)
        assert 0.0 <= r["flat_groups"] <= 1.0

    lengths = {r["iteration"]: r for r in run_query(exp, "lengths").collect().iter_rows(named=True)}
    for it, w in want.items():
        assert lengths[it]["samples"] == w["samples"]
        assert lengths[it]["mean"] == pytest.approx(statistics.fmean(w["lengths"]))
        assert lengths[it]["max"] == max(w["lengths"])

    adv = {r["iteration"]: r for r in run_query(exp, "advantages").collect().iter_rows(named=True)}
    for it, w in want.items():
        assert adv[it]["tokens"] == len(w["advantages"])
        assert adv[it]["mean"] == pytest.approx(statistics.fmean(w["advantages"]), abs=1e-5)
        assert adv[it]["max"] == pytest.approx(max(w["advantages"]))

    gaps = run_query(exp, "logprob-gap", 5).collect()
    everything = sorted((g for it, w in want.items() for g in w["gaps"].values()), reverse=True)
    assert gaps.height == 5
    assert gaps["max_gap"].to_list() == pytest.approx(everything[:5])

    best = run_query(exp, "best", 3).collect()
    worst = run_query(exp, "worst", 3).collect()
    all_scores = sorted(s for w in want.values() for s in w["score"].values())
    assert best["score"].to_list() == all_scores[::-1][:3]
    assert worst["score"].to_list() == all_scores[:3]
    assert best["response_text"].null_count() == 0 and worst["prompt"].null_count() == 0

    # The stage metrics the flow logged to MLflow agree with the frames.
    metrics = exp.metrics().collect()
    for it, w in want.items():
        logged = metrics.filter(iteration=it, name="critic/score/mean")["value"].to_list()
        assert logged == [pytest.approx(statistics.fmean(w["score"].values()), abs=1e-6)]
    assert metrics.filter(iteration=0, name="val/accuracy").height == 1  # the initial policy's eval


def test_queries_on_a_local_run(local: ArtifactStore):
    exp = Experience.open(local, RUN)
    _check_against_store(exp, local)
    assert isinstance(exp.samples(), pl.LazyFrame)
    one = Experience.open(local, RUN, [2])
    assert one.rollouts().select("iteration").unique().collect()["iteration"].to_list() == [2]
    assert set(QUERIES) == {"rewards", "best", "worst", "lengths", "advantages", "logprob-gap", "trajectory"}


def test_inspect_cli(local: ArtifactStore, capsys):
    from rlstage.flows.cli import main

    assert main(["inspect", RUN, "--store", local.root, "--query", "lengths"]) == 0
    out = capsys.readouterr().out
    assert "truncated" in out and "p90" in out
    assert main(["inspect", RUN, "--store", local.root, "-q", "worst", "-n", "2", "-i", "2"]) == 0
    assert "response_text" in capsys.readouterr().out

    assert main(["inspect", RUN, "--store", local.root, "-q", "trajectory"]) == 2  # single-turn samples: none to show
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"rlstage: run '{RUN}' has no multi-turn (agent) samples in iterations 1, 2"]

    assert main(["inspect", RUN, "--store", local.root, "--iteration", "7"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"rlstage: run '{RUN}' has no committed rollout for iteration 7 (committed: 1, 2)"]
    assert main(["inspect", "never-ran", "--store", local.root]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "run 'never-ran' has no committed rollouts" in err[0] and f"runs there: {RUN}" in err[0]
    with pytest.raises(NotCommitted):
        Experience.open(local, RUN, [0])  # iteration 0 only evaluates: no rollouts


def test_uncommitted_files_are_not_read(local: ArtifactStore, tmp_path: Path):
    import shutil

    copy = tmp_path / "store"
    shutil.copytree(local.root, copy)
    store = ArtifactStore(str(copy))
    # An interrupted attempt: iteration 2's rollout files stay, its manifest is gone.
    (Path(store.artifact_dir(RUN, 2, "rollout")) / "_manifest.json").unlink()
    exp = Experience.open(store, RUN)
    assert exp.iterations == (1,)
    assert exp.samples().select("iteration").unique().collect()["iteration"].to_list() == [1]


def test_queries_on_s3(local: ArtifactStore, endpoint: str, monkeypatch, capsys):  # noqa: F811
    import s3fs

    from rlstage.flows.cli import main

    fs = s3fs.S3FileSystem(endpoint_url=endpoint, **CREDS)
    fs.put(str(Path(local.root) / RUN), f"{BUCKET}/explore/", recursive=True)
    root = f"s3://{BUCKET}/explore"
    exp = Experience.open(ArtifactStore(root, {"endpoint_url": endpoint, **CREDS}), RUN)
    _check_against_store(exp, ArtifactStore(root, {"endpoint_url": endpoint, **CREDS}))

    # The CLI takes the endpoint and credentials from the environment (as boto3 does).
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    assert main(["inspect", RUN, "--store", root, "-q", "rewards"]) == 0
    assert "reward_mean" in capsys.readouterr().out


def test_compare_from_the_store_matches_mlflow(first_run, local: ArtifactStore):
    from rlstage.flows.compare import compare_runs, compare_stored_runs, format_table, main
    from rlstage.infra.tracking import tracking_uri_for

    cfg, _ = first_run
    (stored,) = compare_stored_runs([RUN], local.root)
    (tracked,) = compare_runs([RUN], tracking_uri_for(cfg))
    assert stored["iterations"] == tracked["iterations"] == 2
    assert stored["s_per_iter_source"] == "compute_s" and stored["s_per_iter"] > 0
    assert set(stored["metrics"]) == set(tracked["metrics"])
    for key, m in stored["metrics"].items():
        steps, values = zip(*stored["history"][key], strict=True)
        assert list(steps) == [s for s, _ in tracked["history"][key]], key
        assert list(values) == pytest.approx([v for _, v in tracked["history"][key]]), key
        assert m["final"] == pytest.approx(tracked["metrics"][key]["final"]), key
    assert RUN in format_table([stored])
    assert main([RUN, "never-ran", "--store", local.root]) == 2
