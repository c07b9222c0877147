"""DAPO's dynamic sampling in a run: flat groups dropped, prompts generated again, and a resumed iteration commits the same bytes."""

from __future__ import annotations

from rlstage.schemas.config import load_config
from tests_support import tiny_overrides


def test_a_run_drops_flat_groups_generates_again_and_a_resumed_iteration_commits_the_same_bytes(prefect_api, tmp_path):
    """The tiny kit's rewards are all 0, so the overlong shaping (responses past 6 of 8 tokens lose up to 1) is
    the signal: groups whose samples all have the same length penalty are dropped and more prompts generated."""
    import numpy as np
    from safetensors.torch import load

    from rlstage.flows.training import train
    from rlstage.tasks.runtime import store_for
    from tests_support import moving_overrides, update_weights, weights_moved

    cfg = load_config(
        None,
        [
            f"store.root={tmp_path}", "run_name=ds", *tiny_overrides(), *moving_overrides(),
            "reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=2",
            "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_reward",
            "algorithm.filter_groups.max_num_gen_batches=4", "trainer.iterations=1",
            "data.gen_batch_size=6",  # verl's: rounds of 6 prompts fill a batch of 8 groups (two rounds at least)
        ],
    )  # fmt: skip
    result = train(config=cfg)
    store = store_for(cfg)
    last = {h["iteration"]: h for h in result["history"]}[1]
    assert last["train/num_gen_batches"] >= 2 and last["train/filter_groups/dropped_share"] > 0
    fg = store.manifest("ds", 1, "filter_groups")
    groups = store.read_table(fg, "groups.parquet").to_pydict()
    assert sum(groups["in_batch"]) == 8 and max(groups["round"]) == last["train/num_gen_batches"] - 1
    assert not any(b and not s for b, s in zip(groups["in_batch"], groups["has_signal"], strict=True))
    assert store.read_table(store.manifest("ds", 1, "rollout"), "rollouts.parquet").num_rows == 6 * 4
    extra = store.read_table(fg, "extra_rollouts.parquet")
    assert extra.num_rows > 0 and all("/1.1/" in s for s in extra.column("sample_id").to_pylist()[:4])
    per_round = {r: sum(1 for x in groups["round"] if x == r) for r in set(groups["round"])}
    assert set(per_round.values()) <= {6} and per_round[0] == 6  # a later round may hold fewer: no repeated prompt
    # the update trained on exactly prompts_per_iteration x n samples, every group with signal
    adv = store.manifest("ds", 1, "advantage")
    assert adv.inputs["rollouts"] == adv.inputs["rewards"] == fg.artifact_id
    exp = store.read_table(adv, "experience.parquet")
    assert exp.num_rows == 8 * 4 and store.manifest("ds", 1, "update").inputs["experience"] == adv.artifact_id
    scores: dict[int, list[float]] = {}
    for g, s in zip(exp.column("group_id").to_pylist(), exp.column("score").to_pylist(), strict=True):
        scores.setdefault(g, []).append(s)
    assert len(scores) == 8 and all(len(v) == 4 and np.std(v) > 0 for v in scores.values())
    assert any(g >= 6 for g in scores)  # some groups come from an extra round (round r's ids start at 6 r)
    start = store.manifest("ds", 1, "update").meta["policy_ref"]
    init = store.manifest(start["run"], start["iteration"], start["stage"])
    assert weights_moved(load(store.read_bytes(init, "model/model.safetensors")), update_weights(store, "ds", 1))

    # an iteration killed before dynamic sampling committed: the rerun regenerates the same rounds, bytes and all
    before = {s: store.manifest("ds", 1, s).files for s in ("filter_groups", "advantage", "update")}
    store.delete("ds", 1, "filter_groups")
    again = train(config=cfg)
    assert again["executed"] == ["iter-1/filter_groups", "iter-1/advantage", "iter-1/update", "iter-1/eval"]
    assert {s: store.manifest("ds", 1, s).files for s in before} == before
    # a replay of the advantage stage finds its inputs: dynamic sampling's batch, not the first round's rollouts
    from rlstage.flows.replay import replay

    assert replay(run_name="ds", iteration=1, stage="advantage", store_root=str(tmp_path))["identical"]

