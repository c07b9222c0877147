"""The CLI's own surface: version, help with choices and defaults."""

from __future__ import annotations

import pytest

from rlstage.flows.cli import main
from rlstage.schemas.stages import REPLAYABLE
from tests_support import REPO


def _out(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0
    return capsys.readouterr().out


def test_version(capsys):
    import subprocess
    from importlib.metadata import version

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert _out(capsys, ["--version"]).strip() == f"rlstage {version('rlstage')} (commit {commit})"


def test_every_help_names_its_docs_page(capsys):

    from rlstage.flows.cli import DOCS
    from rlstage.schemas.docs_site import page_url

    docs = REPO / "docs"
    assert page_url("reference/config.md") in " ".join(_out(capsys, ["--help"]).split())
    for name, page in DOCS.items():
        assert (docs / page).is_file(), page
        assert f"More: {page_url(page)}" in " ".join(_out(capsys, [name, "--help"]).split())


def test_help_lists_choices_and_defaults(capsys):
    replay = " ".join(_out(capsys, ["replay", "--help"]).split())
    assert f"one of: {', '.join(REPLAYABLE)}" in replay
    assert "store root of the run (default: ./rlstage-runs)" in replay
    nightly = " ".join(_out(capsys, ["nightly", "--help"]).split())
    assert "iterations to add (default: 1)" in nightly
    assert "(default: None)" not in nightly


def test_overrides_anywhere_and_a_mistyped_run_lists_the_runs(capsys, tmp_path):
    """`eval exp1 -i 7 trainer.eval_n=16` parses (overrides after options); a run that does not exist is one
    line naming the runs the store holds."""
    from rlstage.infra.store import ArtifactStore

    ArtifactStore(str(tmp_path)).put_json("exp1", "run.json", {"config": {}})
    for argv in (
        ["eval", "exp2", "-i", "7", "trainer.eval_n=16", "--store", str(tmp_path)],
        ["replay", "exp2", "3", "reward", "--store", str(tmp_path), "reward.function=exact_match"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"rlstage: run 'exp2' does not exist under {tmp_path}; runs there: exp1"]


def test_a_signal_raised_while_c_code_runs_is_reported_as_a_stop(capsys, monkeypatch):
    """SIGTERM's handler raises ``Stopped``; raised inside a C call it surfaces as the cause of a SystemError
    (seen when a training run was stopped mid-update): still a stop, not an internal error."""
    import signal

    from rlstage.flows import cli

    def stopped_inside_c_code(args):
        try:
            raise cli.Stopped(signal.SIGTERM)
        except cli.Stopped as stop:
            raise SystemError("<built-in method __new__> returned a result with an exception set") from stop

    monkeypatch.setattr(cli, "cmd_train", stopped_inside_c_code)  # bound when the parser is built
    assert main(["train"]) == 128 + signal.SIGTERM
    assert capsys.readouterr().err.strip() == "rlstage: stopped by SIGTERM; rerun the command to continue"
    assert cli._stopped(ValueError("x")) is None


def test_an_error_raised_in_a_ray_worker_is_its_own_one_line(capsys, monkeypatch):
    """A stage's worker that finds a checkpoint missing raises FileNotFoundError there; through ray.get it arrives
    wrapped (the worker's traceback, its process repr, colour codes): the user reads the worker's one line, exit 2."""
    from ray.exceptions import RayTaskError

    from rlstage.flows import cli

    line = "checkpoint r/iter-1/update (abc) is not committed"

    def raised_in_a_worker(args):
        trace = f"\x1b[36mray::PolicyWorker.acquire()\x1b[39m (pid=1, actor_id=ff)\n  File x\nFileNotFoundError: {line}"
        raise RayTaskError("PolicyWorker.acquire", trace, FileNotFoundError(line)).as_instanceof_cause()

    monkeypatch.setattr(cli, "cmd_train", raised_in_a_worker)
    assert main(["train"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"rlstage: {line}"]


def test_the_flows_import_without_the_model_libraries():
    """A command, a stage's Ray worker and a Prefect flow-run process import the flows; transformers and peft
    (~5 s here) load only where a model is loaded (a role worker, SFT), not with them."""
    import subprocess
    import sys

    code = (
        "import sys, rlstage.flows.training, rlstage.flows.replay, rlstage.flows.evaluate, rlstage.tasks.stages; "
        "print(sorted(m for m in ('transformers', 'peft', 'sklearn') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]


def test_the_learning_summary_says_what_it_measures(capsys):
    from rlstage.flows.cli import _summary

    exact = [{"iteration": 0, "val/accuracy": 0.5, "val/reward_mean": 0.5}, {"iteration": 2, "val/accuracy": 0.75, "val/reward_mean": 0.75}]
    _summary({"history": exact, "store": "s", "run": "r", "mlflow": "m"})
    out = capsys.readouterr().out
    assert "held-out accuracy (greedy answers scored correct):" in out and "mean reward" not in out
    assert "learning: 0.500 -> 0.750 (+25.0 points)" in out
    # GSM8K's format credit: 3 of 16 answers earned 0.1, none was correct (the case a user met)
    credit = [{"iteration": 0, "val/accuracy": 0.0, "val/reward_mean": 0.0}, {"iteration": 2, "val/accuracy": 0.0, "val/reward_mean": 0.019}]
    _summary({"history": credit, "store": "s", "run": "r", "mlflow": "m"})
    out = capsys.readouterr().out
    assert "iteration   2: 0.000   mean reward 0.019" in out and "learning: 0.000 -> 0.000 (+0.0 points)" in out


def test_a_run_whose_every_sample_scored_the_same_says_it_had_nothing_to_learn(capsys):
    """Every reward 0 (a reward function that never matches): the iteration line and the run's end say so."""
    from rlstage.flows.cli import _summary
    from rlstage.flows.records import flat_rewards

    flat = {"critic/score/mean": 0.0, "critic/score/max": 0.0, "critic/score/min": 0.0}
    assert flat_rewards(flat) and not flat_rewards({**flat, "critic/score/max": 1.0}) and not flat_rewards({})
    history = [{"iteration": 0, "val/accuracy": 0.0}, {"iteration": 1, **flat}, {"iteration": 2, "val/accuracy": 0.0, **flat}]
    _summary({"history": history, "store": "s", "run": "r", "mlflow": "m"})
    assert "warning: every sample of every iteration scored 0: no group had a signal to learn from" in capsys.readouterr().out
    history[1] = {**history[1], "critic/score/max": 1.0}  # one iteration had a signal: no warning
    _summary({"history": history, "store": "s", "run": "r", "mlflow": "m"})
    assert "warning" not in capsys.readouterr().out


def test_a_run_whose_every_group_scored_the_same_within_itself_says_so(capsys):
    """One prompt always right, the other always wrong: the batch's scores differ, yet no group has an advantage."""
    import numpy as np

    from rlstage.engines.tables import flat_group_share
    from rlstage.flows.cli import _summary
    from rlstage.flows.records import flat_rewards

    groups = np.array([0, 0, 1, 1, 2, 2])
    assert flat_group_share(groups, np.array([1.0, 1.0, 0.0, 0.0, 1.0, 1.0])) == 1.0
    assert flat_group_share(groups, np.array([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])) == 2 / 3
    within = {"critic/score/mean": 0.5, "critic/score/max": 1.0, "critic/score/min": 0.0, "reward/flat_group_share": 1.0}
    assert flat_rewards(within) and not flat_rewards({**within, "reward/flat_group_share": 0.5})
    _summary({"history": [{"iteration": 0, "val/accuracy": 0.5}, {"iteration": 1, "val/accuracy": 0.5, **within}], "store": "s", "run": "r", "mlflow": "m"})
    assert "warning: in every iteration each group's samples all scored the same: no group had a signal" in capsys.readouterr().out


def test_init_fits_a_small_context_takes_overrides_and_keeps_one_block_a_section(tmp_path):
    """The exported kit's 256-token context: its prompt and response lengths are cut to fit, an override lands in its
    section (YAML keeps the last block of a repeated key), and an unknown one is refused with the nearest name."""
    import json

    import yaml

    from rlstage.flows.init import InitChoices, render
    from rlstage.schemas.config import ConfigError, build_config

    model = tmp_path / "kit"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 256}))
    choices = InitChoices(str(model), "/data/t.parquet", "/data/v.parquet", "exact_match", data_source="verl_parquet",
                          overrides=("rollout.temperature=0.9", "run_name=kit"))  # fmt: skip
    text = render(choices)
    assert text.count("\nrollout:") == 1
    cfg = build_config(yaml.safe_load(text))
    assert cfg.data.max_prompt_length + cfg.rollout.max_new_tokens <= 256 and cfg.rollout.max_new_tokens >= 8
    assert (cfg.rollout.temperature, cfg.run_name, cfg.data.source) == (0.9, "kit", "verl_parquet")
    assert "prompt_column" not in text  # verl's parquet has its own columns
    with pytest.raises(ConfigError, match=r"rollout\.max_new_tokn: not a setting; did you mean rollout\.max_new_tokens\?"):
        render(InitChoices(str(model), "/t.jsonl", "/v.jsonl", "exact_match", overrides=("rollout.max_new_tokn=3",)))
