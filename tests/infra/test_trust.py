"""Trust nothing in the store: a stored config cannot name code to import, signed manifests and run
documents refuse a writer without the key, and a reward function that fails on a batch stops its stage.
"""

from __future__ import annotations

import json
import signal
import uuid
from pathlib import Path

import pyarrow as pa
import pytest

from rlstage.engines.rewards import rules as R
from rlstage.flows.checks import check_run_config, record_run_config, stored_config, stored_config_with
from rlstage.infra.store import HMAC_KEY_ENV, ArtifactCorrupt, ArtifactStore, StoreError, parquet_bytes
from rlstage.schemas.config import ALLOWED_CALLABLES_ENV, ConfigError, RunConfig, load_config

# An attacker's module: importing it, or calling its function, leaves a marker file.
EVIL = """
import pathlib
pathlib.Path({marker!r}).write_text("imported")


def score(response_text, ground_truth, extra_info):
    pathlib.Path({marker!r}).write_text("called")
    return 1.0
"""


@R.register_reward_fn("test_always_raises")
def always_raises(response_text: str, ground_truth: str, extra_info: dict) -> float:
    raise KeyError(f"no field in {response_text!r}")


@pytest.fixture
def clean_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No allow-list, no store key: the user's own config folder is a fresh one."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(ALLOWED_CALLABLES_ENV, raising=False)
    monkeypatch.delenv(HMAC_KEY_ENV, raising=False)
    return tmp_path


def _victim(tmp_path: Path, edit) -> tuple[ArtifactStore, Path]:
    """A run recorded honestly, whose run.json a writer of the store then edits."""
    store = ArtifactStore(str(tmp_path / "store"))
    record_run_config(store, RunConfig(run_name="victim"))
    path = tmp_path / "store" / "victim" / "run.json"
    doc = json.loads(path.read_text())
    edit(doc["config"])
    path.write_text(json.dumps(doc))
    return store, path


@pytest.fixture
def evil_reward(clean_env: Path) -> tuple[ArtifactStore, Path, str]:
    marker = clean_env / "marker"
    module = clean_env / f"evil_reward_{uuid.uuid4().hex}.py"  # a fresh module name: imported anew
    module.write_text(EVIL.format(marker=str(marker)))
    ref = f"{module}:score"
    store, _ = _victim(clean_env, lambda c: c["reward"].update(function=ref))
    return store, marker, ref


def test_stored_reward_function_is_refused_by_replay_eval_and_nightly(evil_reward) -> None:
    from rlstage.flows.nightly import continuation_config

    store, marker, ref = evil_reward
    for load in (
        lambda: stored_config_with(store.root, "victim", [], "a replay"),
        lambda: stored_config_with(store.root, "victim", ["trainer.eval_n=2"], "an evaluation"),
        lambda: continuation_config("victim", store.root),
    ):
        with pytest.raises(ConfigError) as err:
            load()
        msg = str(err.value)
        assert "\n" not in msg and "reward.function" in msg and ref in msg and ALLOWED_CALLABLES_ENV in msg
    assert not marker.exists()


def test_nightly_takes_the_runs_code_named_again_and_nothing_else(evil_reward, capsys) -> None:
    """The refusal's advice works for ``nightly`` as written: ``rlstage nightly RUN reward.function=...`` names the
    stored code and is past the check (here it then stops at the run's missing stages); another value, or a setting
    that does not name code, is one line, before anything starts."""
    from rlstage.flows.checks import trusted_code
    from rlstage.flows.cli import main
    from rlstage.flows.nightly import continuation_config

    store, marker, ref = evil_reward
    assert main(["nightly", "victim", "--store", store.root]) == 2
    advice = capsys.readouterr().err.strip().splitlines()[-1]
    assert "give it in this command (reward.function=...)" in advice
    trusted = trusted_code(store, "victim", [f"reward.function={ref}"])
    assert trusted == {ref}
    assert continuation_config("victim", store.root, trusted=sorted(trusted)).reward.function == ref  # trusted now
    for given, needle in (
        ("reward.function=other.mod:score", f"run 'victim' was trained with {ref!r}, not 'other.mod:score'"),
        ("actor.optim.lr=0.1", "actor.optim.lr: a continued run keeps its stored settings"),
    ):
        assert main(["nightly", "victim", "--store", store.root, given]) == 2
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert needle in line and line.startswith("rlstage: config error:"), line
    assert not marker.exists()


def test_code_named_by_the_command_or_allow_listed_is_loaded(evil_reward, clean_env: Path, monkeypatch) -> None:
    store, marker, ref = evil_reward
    # Named by this invocation's own overrides: the user asked for it.
    from rlstage.engines.preflight import preflight

    cfg = stored_config(store, "victim", [f"reward.function={ref}"])
    preflight(cfg)  # every command checks that the reward function resolves before any stage
    assert cfg.reward.function == ref and marker.read_text() == "imported"  # the attack was real
    # Allow-listed in the user's config folder (outside the store).
    allow = clean_env / "xdg" / "rlstage" / "allowed_callables"
    allow.parent.mkdir(parents=True)
    allow.write_text(f"# reward functions this user trusts\n{ref}\n")
    assert stored_config(store, "victim").reward.function == ref
    allow.unlink()
    with pytest.raises(ConfigError, match="reward.function"):
        stored_config(store, "victim")
    monkeypatch.setenv(ALLOWED_CALLABLES_ENV, f"some.other:fn, {ref}")
    assert stored_config(store, "victim").reward.function == ref


def test_stored_tool_callable_is_refused_before_import(clean_env: Path, monkeypatch) -> None:
    marker = clean_env / "marker"
    (clean_env / "evil_tool.py").write_text(EVIL.format(marker=str(marker)))
    monkeypatch.syspath_prepend(str(clean_env))
    tool = {"name": "evil", "callable": "evil_tool:score"}
    store, _ = _victim(clean_env, lambda c: c["agent"].update(tools=[tool]))
    with pytest.raises(ConfigError, match=r"agent\.tools\.0\.callable: 'evil_tool:score' comes from the stored"):
        stored_config(store, "victim")
    assert not marker.exists()
    # The built-in calculator needs no allow-list.
    calc = {"name": "calculator", "callable": "rlstage.engines.agents.tools:calculator"}
    store, _ = _victim(clean_env, lambda c: c["agent"].update(tools=[calc]))
    assert stored_config(store, "victim").agent.tools[0].callable == "rlstage.engines.agents.tools:calculator"


def test_nightly_trusts_the_code_its_deployment_config_names(evil_reward) -> None:
    from rlstage.flows.nightly import continuation_config

    store, marker, ref = evil_reward
    # The deployment names the same function: it may run, and the stored copy must agree with it.
    from rlstage.engines.preflight import preflight

    cfg = continuation_config("victim", store.root, overrides=[f"reward.function={ref}"])
    preflight(cfg)
    assert cfg.reward.function == ref and marker.exists()


# ---------------------------------------------------------------- signed manifests


def _commit(store: ArtifactStore, values: list[int]):
    return store.commit(
        "r", 1, "reward", key="k", config_hash="c", code_version="v", inputs={},
        tables={"rewards.parquet": pa.table({"score": values})}, meta={"metrics": {"m": 0.1, "nan": float("nan")}},
    )  # fmt: skip


def _tamper(tmp_path: Path, values: list[int]) -> None:
    """Rewrite the data file and update the manifest's checksum to match: self-consistent, no key."""
    folder = tmp_path / "store" / "r" / "iter-000001" / "reward"
    data = parquet_bytes(pa.table({"score": values}))
    (folder / "rewards.parquet").write_bytes(data)
    manifest = json.loads((folder / "_manifest.json").read_text())
    import hashlib

    manifest["files"]["rewards.parquet"].update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data), rows=len(values))
    (folder / "_manifest.json").write_text(json.dumps(manifest))


def test_signed_manifest_refuses_a_self_consistent_tamper(clean_env: Path, monkeypatch) -> None:
    monkeypatch.setenv(HMAC_KEY_ENV, "team-secret")
    store = ArtifactStore(str(clean_env / "store"))
    m = _commit(store, [1, 0, 1])
    assert m.signature and store.manifest("r", 1, "reward").signature == m.signature  # NaN in meta reads back as null
    assert store.read_table(m, "rewards.parquet").column("score").to_pylist() == [1, 0, 1]
    _tamper(clean_env, [1, 1, 1])
    monkeypatch.delenv(HMAC_KEY_ENV)  # without the key the tamper goes unnoticed: checksums all match
    assert store.read_table(store.manifest("r", 1, "reward"), "rewards.parquet").column("score").to_pylist() == [1, 1, 1]
    monkeypatch.setenv(HMAC_KEY_ENV, "team-secret")
    with pytest.raises(ArtifactCorrupt, match=r"_manifest\.json: signature does not match \(RLSTAGE_STORE_HMAC_KEY\)"):
        store.manifest("r", 1, "reward")
    monkeypatch.setenv(HMAC_KEY_ENV, "another-key")
    _commit(store, [0])  # a writer with another key is refused as well
    monkeypatch.setenv(HMAC_KEY_ENV, "team-secret")
    with pytest.raises(ArtifactCorrupt, match="signature does not match"):
        store.manifest("r", 1, "reward")


def test_unsigned_manifests_and_documents_are_refused_with_a_key(clean_env: Path, monkeypatch) -> None:
    store = ArtifactStore(str(clean_env / "store"))
    _commit(store, [1])
    record_run_config(store, RunConfig(run_name="r"))
    assert store.manifest("r", 1, "reward").signature is None  # no key: today's behaviour
    monkeypatch.setenv(HMAC_KEY_ENV, "team-secret")
    with pytest.raises(ArtifactCorrupt, match=r"_manifest\.json is unsigned, but RLSTAGE_STORE_HMAC_KEY is set"):
        store.manifest("r", 1, "reward")
    with pytest.raises(ArtifactCorrupt, match=r"r/run\.json is unsigned"):
        stored_config(store, "r")
    monkeypatch.setenv(HMAC_KEY_ENV, "")
    with pytest.raises(StoreError, match="RLSTAGE_STORE_HMAC_KEY is set but empty"):
        store.manifest("r", 1, "reward")


def test_signed_run_document_refuses_an_edit(clean_env: Path, monkeypatch) -> None:
    monkeypatch.setenv(HMAC_KEY_ENV, "team-secret")
    store = ArtifactStore(str(clean_env / "store"))
    record_run_config(store, RunConfig(run_name="victim"))
    path = clean_env / "store" / "victim" / "run.json"
    assert "_signature" in json.loads(path.read_text()) and "_signature" not in store.get_json("victim", "run.json")
    assert stored_config(store, "victim").run_name == "victim"
    doc = json.loads(path.read_text())
    doc["config"]["reward"]["function"] = "gsm8k_flexible"  # a registered name: not code, but not the run's
    path.write_text(json.dumps(doc))
    with pytest.raises(ArtifactCorrupt, match=r"victim/run\.json: signature does not match"):
        stored_config(store, "victim")


# ---------------------------------------------------------------- nothing accepted silently


def _rows(texts: list[str]) -> list[dict]:
    return [{"response_text": t, "ground_truth": "ok", "data_source": "synthetic/addition", "extra_info": "{}"} for t in texts]


def test_a_reward_function_failing_on_the_whole_batch_stops_the_stage() -> None:
    from rlstage.tasks.stages import score_rows

    cfg = load_config(None, ["reward.function=test_always_raises"])
    with pytest.raises(R.RewardFailure) as err:
        score_rows(cfg, _rows(["a", "b", "c"]))
    assert str(err.value) == (
        "reward function test_always_raises failed on 3 of 3 samples (reward.stop_failure_share=1); "
        "first error: KeyError: \"no field in 'a'\""
    )


def test_failure_share_threshold() -> None:
    ok, bad = R.RewardResult(1.0, "f"), R.RewardResult(0.0, "f", "ValueError: line one\n  line two")
    R.check_failures([ok, bad, bad], 1.0)  # default: only a batch that fails entirely stops
    R.check_failures([ok, ok, ok], 0.01)
    with pytest.raises(R.RewardFailure, match=r"failed on 2 of 3 samples .*first error: ValueError: line one line two$"):
        R.check_failures([ok, bad, bad], 0.5)
    with pytest.raises(R.RewardFailure):
        R.check_failures([bad], 1.0)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["data.source=gsm8k", "data.train_path=t.jsonl"], "data.test_path (the held-out set) is required for data.source=gsm8k"),
        (["actor.ppo_mini_batch_size=48", "actor.micro_batch_size=16"], "actor.ppo_mini_batch_size=48 does not divide the samples per iteration, data.prompts_per_iteration x rollout.n = 512"),
        (["reward.stop_failure_share=0"], "reward.stop_failure_share:"),
    ],
)  # fmt: skip
def test_inputs_refused_at_config_load(overrides, needle) -> None:
    from rlstage.engines.preflight import check_registered_names

    with pytest.raises(ConfigError) as err:  # as the CLI loads a config: the model, then against the registries
        check_registered_names(load_config(None, overrides))
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("function", "needle"),
    [
        ("exact_mtch", "reward.function: unknown reward function 'exact_mtch'"),
        ("/no/such/file.py:f", "reward.function: reward function file /no/such/file.py does not exist"),
        ("no_such_module_xyz:f", "cannot load reward function 'no_such_module_xyz:f': ModuleNotFoundError"),
    ],
)
def test_reward_functions_that_do_not_resolve_are_refused_before_any_stage(function, needle) -> None:
    from rlstage.engines.preflight import preflight

    with pytest.raises(ConfigError) as err:  # the config model is a leaf: it imports nothing it names
        preflight(load_config(None, [f"reward.function={function}"]))
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_a_failed_first_attempt_records_nothing(clean_env: Path) -> None:
    from rlstage.flows.checks import InputError, check_inputs

    store = ArtifactStore(str(clean_env / "store"))
    typo = load_config(None, ["run_name=r", "model.path=/no/such/model"])
    with pytest.raises(InputError, match="model.path /no/such/model: not a directory"):
        check_inputs(typo)
    assert store.get_json("r", "run.json") is None
    assert check_run_config(store, load_config(None, ["run_name=r"])) is False  # the corrected command may run


# ---------------------------------------------------------------- stopped cleanly


def test_sigint_and_sigterm_take_the_same_way_out() -> None:
    """SIGINT is stopped as SIGTERM is (the end-to-end run, with vLLM engines: tests/integration/test_pipeline_vllm.py), and its
    exit says which."""
    from rlstage.flows.cli import Stopped, _stop_on_signals

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        _stop_on_signals()
        handler = signal.getsignal(signal.SIGINT)
        assert handler is signal.getsignal(signal.SIGTERM)
        with pytest.raises(Stopped) as stopped:
            handler(signal.SIGINT, None)
        assert stopped.value.signum == signal.SIGINT
        assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL  # a second Ctrl-C forces
    finally:
        for sig, h in saved.items():
            signal.signal(sig, h)


def test_a_failed_batch_is_not_retried_but_a_lost_worker_is() -> None:
    from prefect.states import Failed

    from rlstage.tasks.stages import _retryable

    assert not _retryable(None, None, Failed(data=R.RewardFailure("reward function f failed on 3 of 3 samples")))
    assert _retryable(None, None, Failed(data=OSError("connection reset")))
