"""Checkpoint every k updates, resume in between: the same losses and artifacts as an uninterrupted run."""

from __future__ import annotations

import pytest

from rlstage.schemas.config import ConfigError, load_config
from tests_support import checksums, tiny_overrides


def _cfg(root, iterations: int):
    # An entropy bonus moves the weights even when the tiny model earns no reward yet.
    overrides = [f"store.root={root}", "run_name=ck", "trainer.checkpoint_every=2", "actor.entropy_coeff=0.01"]
    return load_config(None, [*tiny_overrides(), *overrides, f"trainer.iterations={iterations}"])


@pytest.mark.invariant("resumed == uninterrupted", "every artifact's checksum, the losses equal")
def test_resume_between_checkpoints_matches_an_uninterrupted_run(prefect_api, tmp_path):
    from rlstage.flows.replay import replay
    from rlstage.flows.training import train
    from rlstage.tasks.runtime import store_for

    reference = train(config=_cfg(tmp_path / "ref", 2))
    # Stopped after iteration 1, between checkpoints: the policy worker dies with the flow.
    train(config=_cfg(tmp_path / "res", 1))
    store = store_for(_cfg(tmp_path / "res", 2))
    first = store.manifest("ck", 1, "update")
    assert first.meta["between_checkpoints"] and "trainer_state/trainer_state.json" not in first.files
    resumed = train(config=_cfg(tmp_path / "res", 2))
    # iteration 2 rebuilt the policy of iteration 1 from its stored experience, not by rerunning the stage
    assert "iter-1/update" not in resumed["executed"] and "iter-2/rollout" in resumed["executed"]
    assert checksums(store, "ck", 2) == checksums(store_for(_cfg(tmp_path / "ref", 2)), "ck", 2)
    losses = [h.get("actor/pg_loss") for h in resumed["history"] if h["iteration"] > 1]
    assert losses == [h.get("actor/pg_loss") for h in reference["history"] if h["iteration"] > 1]
    assert all(h["actor/grad_norm"] > 0 for h in resumed["history"] if h["iteration"] > 1)  # the policy moved
    assert "trainer_state/trainer_state.json" in store.manifest("ck", 2, "update").files  # the k-th update is a checkpoint

    # A replay of iteration 2's rollout needs the policy of iteration 1: rebuilt, same checksums.
    assert replay(run_name="ck", iteration=2, stage="rollout", store_root=str(tmp_path / "res"))["identical"]
    # Rebuilding it under other actor settings would be another policy: refused.
    with pytest.raises(ConfigError, match="between checkpoints"):
        replay(run_name="ck", iteration=2, stage="update", store_root=str(tmp_path / "res"), overrides=["actor.optim.lr=0.01"])


def test_retention_prunes_old_weights_and_a_pruned_policy_is_rebuilt_exactly(prefect_api, tmp_path, capsys):
    """Keep the newest checkpoint plus every 2nd: iterations 1 and 3 lose their weights and optimizer state,
    the policy's and the critic's (GAE). They stay reachable: a replay of update 4 rebuilds the policy of
    iteration 3 from iteration 2's checkpoint and commits the same bytes, a replay of advantage 4 the critic
    likewise; an export names the iterations with stored weights."""
    from rlstage.flows.cli import main
    from rlstage.flows.replay import replay
    from rlstage.flows.retention import kept_iterations, stored_checkpoints
    from rlstage.flows.training import train
    from rlstage.infra.tracking import CHECKPOINT_TAG, PRUNED_TAG
    from rlstage.tasks.runtime import store_for

    assert kept_iterations([1, 2, 3, 4, 5], 2, 3) == {3, 4, 5} and kept_iterations([2, 4, 6], 1, None) == {6}
    root = tmp_path / "store"
    keep = ["trainer.checkpoint_every=1", "trainer.max_actor_ckpt_to_keep=1", "trainer.keep_checkpoint_every=2"]
    gae = ["algorithm.adv_estimator=gae", "critic.enable=true", "critic.ppo_mini_batch_size=16", "critic.micro_batch_size=8"]
    cfg = load_config(None, [*tiny_overrides(), f"store.root={root}", "run_name=ret", "actor.entropy_coeff=0.01", *keep, *gae])
    first = train(config=cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"iterations": 3})}))
    store = store_for(cfg)
    assert stored_checkpoints(store, "ret") == [2, 3]
    result = train(config=cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"iterations": 4})}))  # a night later
    assert stored_checkpoints(store, "ret") == [2, 4]
    updates = {it: store.manifest("ret", it, "update") for it in range(1, 5)}
    critics = {it: store.manifest("ret", it, "critic") for it in range(1, 5)}
    for stage, it in [(stage, it) for stage in ("update", "critic") for it in (1, 3)]:
        m = store.manifest("ret", it, stage)
        assert m.meta["pruned"] and m.meta["between_checkpoints"] and not any(f.startswith(("model/", "trainer_state/")) for f in m.files)
        assert not (root / "ret" / f"iter-{it}" / stage / "model").exists()  # the bytes are gone, not just unlisted
        assert store.read_table(m, "metrics.parquet").num_rows  # what stays is still verified and readable
    weights = {it: store.read_bytes(updates[it], "model/model.safetensors") for it in (2, 4)}
    values = {it: store.read_bytes(critics[it], "model/model.safetensors") for it in (2, 4)}
    history = first["history"] + result["history"]
    assert weights[2] != weights[4] and all(h["actor/grad_norm"] > 0 for h in history if h["iteration"])  # the policy moved
    assert values[2] != values[4]  # and so did the critic
    # Each invocation logs the policy it ends with in MLflow; iteration 3's was pruned a night later and says so.
    from mlflow import MlflowClient

    from rlstage.infra.tracking import tracking_uri_for

    client = MlflowClient(tracking_uri_for(cfg))
    models = client.search_logged_models([client.get_run(result["mlflow_run_id"]).info.experiment_id])
    pruned_tag = {m.tags[CHECKPOINT_TAG]: m.tags.get(PRUNED_TAG) for m in models if CHECKPOINT_TAG in m.tags}
    assert pruned_tag[updates[3].artifact_id] == "true" and pruned_tag[updates[4].artifact_id] is None
    # The update of iteration 4 replayed: its input policy (iteration 3) is rebuilt from iteration 2's checkpoint.
    assert replay(run_name="ret", iteration=4, stage="update", store_root=str(root))["identical"]
    # Its advantages need the critic of iteration 3: rebuilt from iteration 2's by re-running critic update 3.
    assert replay(run_name="ret", iteration=4, stage="advantage", store_root=str(root))["identical"]
    with pytest.raises(ConfigError, match="critic of iteration 3 was pruned .* other critic settings"):
        replay(run_name="ret", iteration=4, stage="advantage", store_root=str(root), overrides=["critic.optim.lr=0.01"])
    # An export of a pruned iteration is one line that names the reachable ones.
    capsys.readouterr()
    assert main(["export", "ret", "-i", "3", "--store", str(root), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "was pruned (trainer.max_actor_ckpt_to_keep=1); iterations with stored weights: 2, 4" in err, err
    with pytest.raises(ConfigError, match="trainer.keep_checkpoint_every=2 keeps extra checkpoints"):
        load_config(None, ["trainer.keep_checkpoint_every=2"])


def test_stored_bytes_that_do_not_load_are_one_line_from_inside_the_worker(prefect_api, tmp_path, capsys):
    """A pickle written under the trainer state's safetensors name with its manifest entry made to match (a
    self-consistent tamper): the policy worker that loads it (a Ray actor) refuses it, and the command prints that
    worker's one line, exit 2, as for any corrupt artifact; a weights file replaced by a link is refused by the store
    inside the worker the same way. Nothing of the pickle is ever unpickled."""
    import hashlib
    import json
    import pickle
    from pathlib import Path

    from rlstage.flows.cli import main
    from rlstage.flows.training import train
    from rlstage.infra.store import ArtifactStore

    overrides = [f"store.root={tmp_path / 'store'}", "run_name=tampered", *tiny_overrides(), "actor.entropy_coeff=0.01"]
    train(config=load_config(None, [*overrides, "trainer.iterations=1"]))
    store = ArtifactStore(str(tmp_path / "store"))
    folder = Path(store.artifact_dir("tampered", 1, "update"))
    doc = json.loads((folder / "_manifest.json").read_text())
    state = "trainer_state/trainer_state.safetensors"
    assert state in doc["files"]
    weights = folder / "model" / "model.safetensors"
    kept = tmp_path / "weights-copy.safetensors"
    kept.write_bytes(weights.read_bytes())  # its checksum passes: only the link is wrong
    weights.unlink()
    weights.symlink_to(kept)
    capsys.readouterr()
    assert main(["train", *overrides, "trainer.iterations=2"]) == 2
    err = [x for x in capsys.readouterr().err.strip().splitlines() if x.startswith("rlstage:")]
    assert err[-1] == f"rlstage: {weights}: a symbolic link inside the store (to {kept}); it is not followed", err
    weights.unlink()
    weights.write_bytes(kept.read_bytes())

    marker = tmp_path / "unpickled"

    class Exploit:
        def __reduce__(self):
            return (Path.touch, (marker,))

    payload = pickle.dumps({"state": Exploit()})
    (folder / state).write_bytes(payload)
    doc["files"][state] = {"sha256": hashlib.sha256(payload).hexdigest(), "bytes": len(payload), "rows": None}
    (folder / "_manifest.json").write_text(json.dumps(doc))
    capsys.readouterr()
    assert main(["train", *overrides, "trainer.iterations=2"]) == 2
    err = [x for x in capsys.readouterr().err.strip().splitlines() if x.startswith("rlstage:")]
    want = "rlstage: checkpoint tampered/iter-1/update: its stored files match the manifest but do not load: SafetensorError"
    assert err[-1].startswith(want), err
    assert "Traceback" not in err[-1] and "\x1b[" not in err[-1] and "ray::" not in err[-1]
    assert not marker.exists()
