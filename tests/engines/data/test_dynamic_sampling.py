"""DAPO's dynamic sampling (algorithm.filter_groups): the filter on hand-made rounds, the extra rounds'
prompts and the bad settings (a run that drops groups: tests/integration/test_dynamic_sampling_run.py)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from rlstage.engines.data.cursor import extra_prompt_batch, prompt_batch
from rlstage.engines.data.dynamic_sampling import DynamicSamplingExhausted, GenRound, select_groups
from rlstage.schemas import artifacts as A
from rlstage.schemas.config import ConfigError, load_config
from tests_support import REPO, tiny_overrides


def _round(round_: int, groups: dict[int, list[float]], rule: dict[int, list[float]] | None = None, greedy=()) -> GenRound:
    """A round's rollouts and rewards: group id -> the scores of its samples (and of its greedy baseline)."""
    ro = {name: [] for name in A.ROLLOUTS.names}
    rw = {name: [] for name in A.REWARDS.names}
    for g, scores in groups.items():
        rows = [(k, s) for k, s in enumerate(scores)] + ([(-1, 9.0)] if g in greedy else [])
        for k, score in rows:
            for name in A.ROLLOUTS.names:
                ro[name].append(None)
            ro["sample_id"][-1] = f"p{g}/{round_}/{k}"
            ro["prompt_id"][-1] = f"p{g}"
            ro["group_id"][-1], ro["sample_index"][-1] = g, k
            for name, value in zip(A.REWARDS.names, [ro["sample_id"][-1], score, "f", None, None, None, None], strict=True):
                rw[name].append(value)
            if rule is not None and k >= 0:
                rw["score_rule"][-1] = rule[g][k]
    return GenRound(pa.table(ro, schema=A.ROLLOUTS), pa.table(rw, schema=A.REWARDS))


def test_flat_groups_are_dropped_more_rounds_fill_the_batch_and_it_is_trimmed_in_generation_order():
    first = _round(0, {0: [1.0, 1.0], 1: [0.0, 1.0], 2: [0.0, 0.0]})
    asked = []

    def more(r: int) -> GenRound:
        asked.append(r)
        return _round(r, {10: [1.0, 0.0], 11: [0.5, 0.25], 12: [0.3, 0.3]})

    sel = select_groups(first, more, target=2, max_rounds=3, metric="seq_reward")
    assert asked == [1]  # round 0 kept 1 of 2: one more round, which kept 2
    assert sel.rollouts.column("group_id").to_pylist() == [1, 1, 10, 10]  # group 11 has signal but the batch is full
    assert sel.rollouts.column("sample_id").to_pylist() == sel.rewards.column("sample_id").to_pylist()
    g = sel.groups.to_pydict()
    assert g["group_id"] == [0, 1, 2, 10, 11, 12] and g["round"] == [0, 0, 0, 1, 1, 1]
    assert g["has_signal"] == [False, True, False, True, True, False]
    assert g["in_batch"] == [False, True, False, True, False, False]
    assert g["metric_std"][1] == pytest.approx(0.5) and g["metric_std"][4] == pytest.approx(0.125)  # population std
    assert sel.metrics() == {
        "train/num_gen_batches": 2.0,
        "train/filter_groups/generated_groups": 6.0,
        "train/filter_groups/kept_groups": 3.0,
        "train/filter_groups/dropped_share": 0.5,
        "critic/score/mean": 0.5,  # of the trained batch: groups 1 and 10
        "critic/score/max": 1.0,
        "critic/score/min": 0.0,
    }


def test_a_full_first_round_generates_nothing_more_and_is_trimmed():
    first = _round(0, {0: [0.0, 1.0], 1: [1.0, 1.0], 2: [1.0, 0.0], 3: [0.0, 0.5]})
    sel = select_groups(first, lambda r: pytest.fail("no extra round needed"), target=2, max_rounds=1, metric="acc")
    assert sel.num_gen_batches == 1 and sel.rollouts.column("group_id").to_pylist() == [0, 0, 2, 2]


def test_the_cap_counts_every_round_and_stops_with_one_line():
    first = _round(0, {0: [1.0, 1.0], 1: [0.0, 1.0]})
    with pytest.raises(DynamicSamplingExhausted) as err:
        select_groups(first, lambda r: _round(r, {10 + r: [0.0, 0.0]}), target=2, max_rounds=3, metric="acc")
    msg = str(err.value)
    assert "kept 1 of the 2 groups" in msg and "max_num_gen_batches=3" in msg and "4 groups" in msg and "\n" not in msg


def test_acc_compares_the_rule_score_before_overlong_shaping_and_seq_reward_the_shaped_one():
    # both samples correct (rule 1.0), one of them punished for its length: a signal only in the shaped score
    first = _round(0, {0: [1.0, 0.5], 1: [0.0, 1.0]}, rule={0: [1.0, 1.0], 1: [0.0, 1.0]})
    acc = select_groups(first, lambda r: pytest.fail("full"), target=1, max_rounds=1, metric="acc")
    shaped = select_groups(first, lambda r: pytest.fail("full"), target=2, max_rounds=1, metric="seq_reward")
    assert acc.groups.column("has_signal").to_pylist() == [False, True]
    assert shaped.groups.column("has_signal").to_pylist() == [True, True]


def test_a_remax_baseline_row_goes_with_its_group_and_is_no_sample_of_it():
    first = _round(0, {0: [1.0, 1.0], 1: [0.0, 1.0]}, greedy=(0, 1))
    sel = select_groups(first, lambda r: pytest.fail("full"), target=1, max_rounds=1, metric="seq_reward")
    assert sel.groups.column("samples").to_pylist() == [2, 2]  # the baseline's 9.0 would give group 0 signal
    assert sel.rollouts.column("sample_index").to_pylist() == [0, 1, -1]


def test_extra_round_prompts_are_a_pure_function_apart_from_the_first_round_and_other_iterations():
    first = set(prompt_batch(400, 3, 8, 0))
    r1, r2 = extra_prompt_batch(400, 3, 1, 8, 0, 3), extra_prompt_batch(400, 3, 2, 8, 0, 3)
    assert r1 == extra_prompt_batch(400, 3, 1, 8, 0, 3)
    assert not (set(r1) | set(r2)) & first and not set(r1) & set(r2)
    later = {row for r in (1, 2) for row in extra_prompt_batch(400, 4, r, 8, 0, 3)}
    assert not later & (set(r1) | set(r2))
    assert prompt_batch(400, 3, 8, 0) == prompt_batch(400, 3, 8, 0)  # the first round is untouched


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.filter_groups.enable=true"], "algorithm.filter_groups.max_num_gen_batches=0: dynamic sampling needs a cap"),
        (
            ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=4", "rollout.n=1",
             "algorithm.adv_estimator=reinforce_plus_plus"],
            "rollout.n=1: algorithm.filter_groups.enable drops groups",
        ),  # fmt: skip
        (
            ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=4",
             "algorithm.filter_groups.metric=seq_final_reward", "algorithm.use_kl_in_reward=true"],
            "algorithm.filter_groups.metric=seq_final_reward with algorithm.use_kl_in_reward",
        ),  # fmt: skip
        (["data.gen_batch_size=96", "data.prompts_per_iteration=64"], "data.gen_batch_size=96 differs from data.prompts_per_iteration=64 without algorithm.filter_groups.enable"),
        (["algorithm.filter_groups.metric=accuracy"], "algorithm.filter_groups.metric: unknown metric 'accuracy'; valid: acc, score, seq_reward, seq_final_reward"),
    ],
)
def test_unusable_dynamic_sampling_settings_are_one_line_naming_the_setting(overrides, message):
    from rlstage.engines.preflight import check_registered_names

    with pytest.raises(ConfigError) as err:
        check_registered_names(load_config(None, overrides))  # a registry's name: checked where the registry is
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_dapo_recipe_enables_dynamic_sampling():

    cfg = load_config(REPO / "configs" / "dapo.yaml", tiny_overrides())
    assert cfg.algorithm.filter_groups.enable and cfg.algorithm.filter_groups.max_num_gen_batches >= 2
