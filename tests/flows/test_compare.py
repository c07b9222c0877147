"""flows.compare against a throwaway SQLite MLflow store: no servers, a few seconds."""

from __future__ import annotations

import os

os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"  # before mlflow is imported anywhere in this process

import pytest
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from rlstage.flows.compare import compare_runs, format_table, main
from rlstage.infra.tracking import RUN_NAME_TAG, metric_name

T0 = 1_700_000_000_000  # ms; fixed timestamps make the timestamp fallback deterministic
VAL_CORE = metric_name("val-core/synthetic/addition/reward/mean@1")

# run-a: verl names incl. timing and kl_loss; iteration 0 only evaluates (as flows.training logs it).
RUN_A: dict[int, dict[str, float]] = {
    0: {"val/accuracy": 0.25, VAL_CORE: 0.25, "timing_s/iteration": 100.0},
    1: {
        "critic/score/mean": 0.30,
        "actor/ppo_kl": 0.002,
        "actor/kl_loss": 0.010,
        "actor/entropy": 1.50,
        "response_length/mean": 40.0,
        "timing_s/iteration": 10.0,
    },
    2: {
        "critic/score/mean": 0.55,
        "val/accuracy": 0.50,
        VAL_CORE: 0.50,
        "actor/ppo_kl": -0.001,
        "actor/kl_loss": 0.020,
        "actor/entropy": 1.20,
        "response_length/mean": 36.0,
        "timing_s/iteration": 14.0,
    },
    3: {
        "critic/score/mean": 0.45,
        "actor/ppo_kl": 0.004,
        "actor/kl_loss": 0.015,
        "actor/entropy": 1.00,
        "response_length/mean": 30.0,
        "timing_s/iteration": 12.0,
    },
    4: {
        "critic/score/mean": 0.60,
        "val/accuracy": 0.40,
        VAL_CORE: 0.40,
        "actor/ppo_kl": 0.003,
        "actor/kl_loss": 0.030,
        "actor/entropy": 0.90,
        "response_length/mean": 28.0,
        "timing_s/iteration": 16.0,
    },
}
# run-b: no timing_s/iteration and no kl_loss; steps logged 5 s apart -> s/iter from timestamps.
RUN_B: dict[int, dict[str, float]] = {
    1: {
        "critic/score/mean": 0.20,
        "val/accuracy": 0.10,
        "actor/ppo_kl": 0.010,
        "actor/entropy": 2.0,
        "response_length/mean": 50.0,
    },
    2: {
        "critic/score/mean": 0.70,
        "val/accuracy": 0.35,
        "actor/ppo_kl": 0.020,
        "actor/entropy": 1.8,
        "response_length/mean": 45.0,
    },
    3: {
        "critic/score/mean": 0.65,
        "val/accuracy": 0.30,
        "actor/ppo_kl": 0.005,
        "actor/entropy": 1.7,
        "response_length/mean": 44.0,
    },
}


def _log(
    client: MlflowClient, exp_id: str, name: str, steps: dict[int, dict[str, float]], dt_s: float
) -> str:
    run_id = client.create_run(exp_id, run_name=name, tags={RUN_NAME_TAG: name}).info.run_id
    for step, values in steps.items():
        ts = T0 + int(step * dt_s * 1000)
        client.log_batch(run_id, metrics=[Metric(k, v, ts, step) for k, v in values.items()])
    client.set_terminated(run_id)
    return run_id


@pytest.fixture(autouse=True)
def _http_env(monkeypatch) -> None:
    # main() fills these in when unset; pinning them here keeps its defaults from leaking into other tests.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp_id = client.create_experiment("rlstage")
    _log(client, exp_id, "run-a", RUN_A, dt_s=60.0)
    _log(client, exp_id, "run-b", RUN_B, dt_s=5.0)
    # A resumed run re-logs a step: the later value of that step wins.
    run_b = client.search_runs([exp_id], f"tags.`{RUN_NAME_TAG}` = 'run-b'")[0].info.run_id
    client.log_batch(run_b, metrics=[Metric("critic/score/mean", 0.66, T0 + 3 * 5000 + 1, 3)])
    other = client.create_experiment("elsewhere")
    _log(client, other, "run-c", {1: {"critic/score/mean": 0.9}}, dt_s=1.0)
    return uri


def test_final_best_and_timing(store: str) -> None:
    a, b = compare_runs(["run-a", "run-b"], store)
    assert (a["run"], b["run"]) == ("run-a", "run-b")
    ma, mb = a["metrics"], b["metrics"]
    assert ma["critic/score/mean"] == {"final": 0.60, "final_step": 4, "best": 0.60, "best_step": 4}
    assert (ma["val/accuracy"]["final"], ma["val/accuracy"]["best"], ma["val/accuracy"]["best_step"]) == (
        0.40,
        0.50,
        2,
    )
    assert (ma[VAL_CORE]["final"], ma[VAL_CORE]["best"]) == (0.40, 0.50)
    assert (ma["actor/ppo_kl"]["final"], ma["actor/ppo_kl"]["best"]) == (0.003, -0.001)  # closest to 0
    assert (ma["actor/kl_loss"]["final"], ma["actor/kl_loss"]["best"]) == (0.030, 0.010)
    assert ma["actor/entropy"]["final"] == 0.90 and ma["actor/entropy"]["best"] is None
    assert ma["response_length/mean"]["final"] == 28.0
    # Iteration 0 (eval only, 100 s) is not a training iteration.
    assert a["iterations"] == 4 and a["s_per_iter"] == pytest.approx(13.0)
    assert a["s_per_iter_source"] == "timing_s/iteration"
    assert (mb["critic/score/mean"]["final"], mb["critic/score/mean"]["best"]) == (0.66, 0.70)
    assert (mb["val/accuracy"]["final"], mb["val/accuracy"]["best"]) == (0.30, 0.35)
    assert "actor/kl_loss" not in mb
    assert b["iterations"] == 3 and b["s_per_iter"] == pytest.approx(5.0, abs=0.01)
    assert b["s_per_iter_source"] == "timestamps"
    assert [s for s, _ in a["history"]["val/accuracy"]] == [0, 2, 4]


def test_format_table(store: str) -> None:
    table = format_table(compare_runs(["run-a", "run-b"], store))
    lines = table.splitlines()
    assert len(lines) == 5 and len({len(line) for line in lines[1:3]}) == 1, table
    row_a = next(line for line in lines if line.startswith("run-a")).split()
    row_b = next(line for line in lines if line.startswith("run-b")).split()
    # run, iters, s/iter, score final/best, val_acc final/best, addition@1 final/best, ppo_kl, kl_loss, ...
    assert row_a[:9] == ["run-a", "4", "13.0000", "0.6000", "0.6000", "0.4000", "0.5000", "0.4000", "0.5000"]
    assert row_b[:2] == ["run-b", "3"] and float(row_b[2]) == pytest.approx(5.0, abs=0.01)
    assert row_b[3:7] == ["0.6600", "0.7000", "0.3000", "0.3500"]
    assert row_b[7:9] == ["-", "-"]  # no val-core metric in run-b
    for label in (
        "score",
        "val_acc",
        "synthetic/addition@1",
        "ppo_kl",
        "kl_loss",
        "entropy",
        "resp_len",
        "s/iter",
    ):
        assert label in lines[0] + lines[1]
    assert "28.0000" in table and "0.9000" in table  # resp_len and entropy finals of run-a


def test_png(store: str, tmp_path) -> None:
    out = tmp_path / "plots" / "compare.png"
    compare_runs(["run-a", "run-b"], store, out_png=str(out))
    data = out.read_bytes()
    assert len(data) > 0 and data[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_run(store: str) -> None:
    with pytest.raises(ValueError, match=r"unknown run 'nope'.*known runs: run-a, run-b") as err:
        compare_runs(["run-a", "nope"], store)
    assert "run-c" not in str(err.value)  # other experiments' runs are not offered
    with pytest.raises(ValueError, match=r"no MLflow experiment 'missing'.*elsewhere"):
        compare_runs(["run-a"], store, experiment="missing")


def test_cli(store: str, tmp_path, capsys) -> None:
    png = tmp_path / "cli.png"
    assert main(["run-a", "run-b", "--tracking-uri", store, "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "run-a" in out and "run-b" in out and str(png) in out and png.stat().st_size > 0
    assert main(["run-c", "--tracking-uri", store, "--experiment", "elsewhere"]) == 0
    assert "0.9000" in capsys.readouterr().out

    assert main(["run-a", "ghost", "--tracking-uri", store]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlstage compare: unknown run 'ghost'") and "\n" not in err
    assert main(["run-a", "--tracking-uri", f"sqlite:///{tmp_path / 'missing.db'}"]) == 2
    assert "no MLflow database" in capsys.readouterr().err
    assert not (tmp_path / "missing.db").exists()


def test_cli_unreachable_server(capsys) -> None:
    # Port 1 refuses at once; with retries at 0 (fixture above) this fails without backoff.
    assert main(["run-a", "--tracking-uri", "http://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlstage compare: cannot reach the MLflow tracking server at http://127.0.0.1:1")
    assert "\n" not in err


def test_cli_tracking_uri_from_env_else_the_home(store: str, monkeypatch, capsys, tmp_path) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    assert main(["run-b"]) == 0
    assert "run-b" in capsys.readouterr().out
    # Without it, the local home's store (where every command logs by default): here there is none yet.
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.setenv("RLSTAGE_HOME", str(tmp_path / "home"))
    assert main(["run-b"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"rlstage compare: no MLflow database at {tmp_path / 'home' / 'mlflow' / 'mlflow.db'}"), err
    assert "\n" not in err
