"""Tests of engines/metrics.py: verl's validation metrics and unbiased pass@k, computed by hand."""

from __future__ import annotations

import math
from itertools import combinations

import numpy as np
import pytest

from rlstage.engines import metrics as M


def test_mean_std_best_worst_by_hand():
    # prompt p1: values (1, 0); p2: (1, 1)
    out = M.validation_metrics(["d"] * 4, ["p1", "p1", "p2", "p2"], {"reward": [1.0, 0.0, 1.0, 1.0]})
    r = out["d"]["reward"]
    assert r["mean@2"] == pytest.approx((0.5 + 1.0) / 2)
    assert r["std@2"] == pytest.approx((0.5 + 0.0) / 2)  # population std of (1, 0) is 0.5
    # best of 2 draws with replacement from (1, 0) is 1 with probability 3/4; p2 is always 1
    assert r["best@2/mean"] == pytest.approx((0.75 + 1.0) / 2, abs=0.03)
    assert r["worst@2/mean"] == pytest.approx((0.25 + 1.0) / 2, abs=0.03)


def test_bootstrap_draws_equal_verl_global_seed_procedure():
    data = [0.1, 0.7, 0.3, 0.9, 0.5]
    ((best, best_sd),) = M.bootstrap_metric(data, 3, [np.max])
    state = np.random.get_state()
    np.random.seed(42)  # verl's procedure, written out independently
    idx = np.random.choice(len(data), size=(1000, 3), replace=True)
    np.random.set_state(state)
    maxes = [max(data[j] for j in row) for row in idx]
    assert best == pytest.approx(float(np.mean(maxes)))
    assert best_sd == pytest.approx(float(np.std(maxes)))


def test_majority_vote_by_hand():
    assert M.majority_value([("A", 0.9), ("B", 0.8), ("A", 0.7)]) == 0.9  # value of the first "A"
    assert M.majority_value([("B", 0.1), ("A", 1.0)]) == 0.1  # tie: the answer seen first
    # "3" (scored 0) wins a draw of three only when drawn at least twice: P = 7/27
    out = M.validation_metrics(["d"] * 3, ["p"] * 3, {"acc": [1.0, 1.0, 0.0], "pred": ["7", "7", "3"]})
    assert out["d"]["acc"]["maj@3/mean"] == pytest.approx(20 / 27, abs=0.04)
    out = M.validation_metrics(["d"] * 3, ["p"] * 3, {"acc": [1.0, 0.0, 0.0]})
    assert not any(k.startswith("maj") for k in out["d"]["acc"])  # no extracted answers: no maj@N


def test_subset_sizes_and_flat_names():
    assert M.subset_sizes(1) == [] and M.subset_sizes(2) == [2] and M.subset_sizes(8) == [2, 4, 8]
    assert M.subset_sizes(6) == [2, 4, 6]
    out = M.validation_metrics(["gsm"] * 4, ["p"] * 4, {"reward": [1.0, 0.0, 1.0, 1.0], "length": [3, 4, 5, 6]})
    flat = M.flatten_validation_metrics(out)
    assert flat["val-core/gsm/reward/mean@4"] == pytest.approx(0.75)
    assert "val-core/gsm/reward/best@4/mean" in flat and "val-aux/gsm/reward/best@2/mean" in flat
    assert "val-aux/gsm/reward/std@4" in flat and "val-aux/gsm/reward/worst@4/mean" in flat
    assert "val-aux/gsm/length/mean@4" in flat  # not the core variable


def test_pass_at_k_by_hand():
    assert M.pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)  # 1 - C(2,2)/C(4,2)
    assert M.pass_at_k(5, 0, 3) == 0.0
    assert M.pass_at_k(5, 5, 1) == 1.0
    assert M.pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the plain accuracy
    # against the definition: share of k-subsets with at least one correct sample
    samples = [1, 0, 0, 1, 0, 0, 0]
    subsets = list(combinations(samples, 3))
    assert M.pass_at_k(7, 2, 3) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
    assert M.pass_at_k(7, 2, 3) == pytest.approx(1 - math.comb(5, 3) / math.comb(7, 3))
    with pytest.raises(ValueError, match="k <= n"):
        M.pass_at_k(2, 1, 3)


def test_vectorised_prompt_bootstrap_equals_the_generic_one():
    rng = np.random.default_rng(0)
    values = rng.integers(0, 2, 8).astype(float).tolist()
    preds = [str(x) for x in rng.integers(0, 3, 8)]
    out = M.validation_metrics(["d"] * 8, ["p"] * 8, {"acc": values, "pred": preds})["d"]["acc"]
    for k in (2, 4, 8):
        (best, best_sd), (worst, _) = M.bootstrap_metric(values, k, [np.max, np.min])
        [(maj, maj_sd)] = M.bootstrap_metric(list(zip(preds, values, strict=True)), k, [lambda s: M.majority_value(list(s))])
        assert out[f"best@{k}/mean"] == pytest.approx(best) and out[f"best@{k}/std"] == pytest.approx(best_sd)
        assert out[f"worst@{k}/mean"] == pytest.approx(worst)
        assert out[f"maj@{k}/mean"] == pytest.approx(maj) and out[f"maj@{k}/std"] == pytest.approx(maj_sd)


def test_answers_are_extracted_as_the_reward_function_reads_them():
    rows = [
        {"response_text": " 81<eos> more", "extra_info": {}},
        {"response_text": "so #### 1,200", "extra_info": {}},
    ]
    assert M.extract_answers(rows, ["exact_match", "gsm8k_strict"]) == ["81", "1200"]
    assert M.extract_answers(rows, ["exact_match", "my.module:score"]) is None  # no extractor: no maj@n


def test_a_reward_functions_answer_is_its_registrations_trait():
    from rlstage.engines.rewards import rules as R

    @R.register_reward_fn("test_answer_trait", answer=lambda text, extra: text.strip().upper())
    def scored(response_text: str, ground_truth: str, extra_info: dict) -> float:
        return 1.0

    try:
        rows = [{"response_text": " yes ", "extra_info": {}}]
        assert M.extract_answers(rows, ["test_answer_trait"]) == ["YES"]
        assert "test_answer_trait" in R.answer_extractors() and "gsm8k" not in R.answer_extractors()
    finally:
        R.REWARD_FNS.remove("test_answer_trait")


def test_gsm8k_format_share_and_flexible_accuracy_by_hand():
    g = "openai/gsm8k"
    rows = [
        {"data_source": g, "ground_truth": "18", "response_text": "16 - 3 - 4 = 9, 9 * 2 = 18.\n#### 18"},  # both
        {"data_source": g, "ground_truth": "18", "response_text": "She makes $18 every day."},  # right, no format
        {"data_source": g, "ground_truth": "3", "response_text": "#### 4"},  # format, wrong
        {"data_source": g, "ground_truth": "3", "response_text": "I am not sure."},  # neither
        {"data_source": "kit/addition", "ground_truth": "7", "response_text": "#### 7"},  # not GSM8K: left out
    ]
    assert M.gsm8k_answer_metrics(rows) == {
        "val-aux/openai/gsm8k/format/mean@1": 0.5,
        "val-aux/openai/gsm8k/acc_flexible/mean@1": 0.5,
    }
    assert M.gsm8k_answer_metrics(rows[4:]) == {}


def test_pass_at_k_metrics_by_hand():
    # prompt a: 4 samples, 1 correct; prompt b: 4 samples, 4 correct
    out = M.pass_at_k_metrics(["s"] * 8, ["a"] * 4 + ["b"] * 4, [True, False, False, False] + [True] * 4)
    assert out["val-aux/s/reward/pass@2"] == pytest.approx((0.5 + 1.0) / 2)  # 1 - C(3,2)/C(4,2) = 1/2
    assert out["val-aux/s/reward/pass@4"] == pytest.approx(1.0)
    assert set(out) == {"val-aux/s/reward/pass@2", "val-aux/s/reward/pass@4"}
