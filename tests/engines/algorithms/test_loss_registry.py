"""engines/algorithms' registries: verl 0.9.1's names for every estimator, loss, aggregation and KL kind, each built in."""

from __future__ import annotations

import pytest
import torch

from rlstage.engines import algorithms as A
from tests_support import VERL_NAMES


@pytest.mark.parametrize("registry", sorted(VERL_NAMES))
def test_registries_hold_verls_names(registry):
    names = [n for n in getattr(A, registry) if getattr(A, registry).entry(n).module.startswith("rlstage.")]
    assert sorted(names) == sorted(VERL_NAMES[registry])


def test_estimators_declare_what_they_need():
    needs = {n: A.ADV_ESTIMATORS.entry(n).needs for n in A.ADV_ESTIMATORS}
    assert {n for n, k in needs.items() if "critic" in k} == {"gae"}
    assert {n for n, k in needs.items() if "sum_pi_squared" in k} == {"optimal_token_baseline", "tir_optimal_token_baseline"}
    # the estimators that compare samples within a prompt's group
    assert {n for n, k in needs.items() if "groups" in k} == {
        "grpo", "grpo_vectorized", "rloo", "rloo_vectorized", "reinforce_plus_plus_baseline", "opo", "gpg",
        "grpo_passk", "gdpo", "optimal_token_baseline", "tir_optimal_token_baseline",
    }  # fmt: skip


def test_unknown_names_list_valid_ones():
    with pytest.raises(ValueError, match="grpo"):
        A.get_adv_estimator("ppo")
    with pytest.raises(ValueError, match="cispo"):
        A.get_policy_loss("dapo")
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        A.agg_loss(torch.ones(1, 2), torch.ones(1, 2), "sum")
    with pytest.raises(ValueError, match="low_var_kl"):
        A.kl_penalty(torch.zeros(2), torch.zeros(2), "k4")


def test_reregistering_a_name_with_another_function_fails():
    with pytest.raises(ValueError, match="'grpo' is registered twice: by rlstage.engines.algorithms.advantages and by"):
        A.register_adv_estimator("grpo")(lambda **kw: None)
    with pytest.raises(ValueError, match="registered twice"):
        A.register_policy_loss("vanilla")(lambda *a, **kw: None)
    assert A.ADV_ESTIMATORS["grpo"] is A.grpo_advantage
