"""The stage registry in a run: eval executes again for a reward change, not for an actor change."""

from __future__ import annotations

from rlstage.schemas.config import load_config
from rlstage.tasks import kit as _kit  # noqa: F401  (registers the sft stage's task)

# ---------------------------------------------------------------- the pipeline


def test_eval_reexecutes_for_a_reward_change_and_not_for_an_actor_change(prefect_api, tmp_path):
    from rlstage.flows.evaluate import evaluate_run
    from rlstage.flows.training import train
    from tests_support import tiny_overrides

    root = str(tmp_path / "store")
    train(config=load_config(None, [f"store.root={root}", "run_name=views", *tiny_overrides(), "trainer.iterations=1"]))
    first = evaluate_run(run_name="views", iteration=1, store_root=root, overrides=["actor.optim.lr=0.5"])
    assert first["executed"]
    # actor.* is outside the eval stage's view: the same evaluation, answered from the committed one
    same = evaluate_run(run_name="views", iteration=1, store_root=root)
    assert not same["executed"] and same["version"] == first["version"]
    scored = evaluate_run(run_name="views", iteration=1, store_root=root, overrides=["reward.timeout_s=3"])
    assert scored["executed"] and scored["version"] != first["version"]
    assert scored["metrics"]["val/accuracy"] == first["metrics"]["val/accuracy"]

