"""engines/algorithms/correction.py: rollout correction (truncated and masked importance sampling) by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rlstage.engines import algorithms as A
from tests_support import T, close


# ---------------------------------------------------------------- rollout correction
def test_rollout_correction_token_sequence_icepop_and_normalisation():
    rollout = torch.zeros(2, 3)
    d = T([[math.log(3.0), math.log(0.5), 0.0], [math.log(1.5), math.log(0.2), 7.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # a garbage 7.0 sits in a masked slot
    w, m = A.rollout_correction(d, rollout, mask, rollout_is="token", rollout_is_threshold=2.0)
    close(w, [[2.0, 0.5, 1.0], [1.5, 0.2, 0.0]])  # TIS: truncated at 2, 0 where masked
    close(m["rollout_corr/rollout_is_ratio_fraction_high"], 1 / 5)
    close(m["rollout_corr/rollout_is_ratio_fraction_low"], 1 / 5)  # 0.2 < 1/2
    w, m = A.rollout_correction(d, rollout, mask, rollout_is="token", rollout_is_threshold="0.4_2.5")
    close(w, [[0.0, 0.5, 1.0], [1.5, 0.0, 0.0]])  # IcePop: outside [0.4, 2.5] -> 0, inside unchanged
    close(m["rollout_corr/rollout_is_oob_ratio"], 2 / 5)
    w, m = A.rollout_correction(d, rollout, mask, rollout_is="sequence", rollout_is_threshold=2.0)
    close(w, [[1.5, 1.5, 1.5], [0.3, 0.3, 0.0]])  # row products 1.5 and 0.3
    close(m["rollout_corr/rollout_is_max"], 1.5)
    w, m = A.rollout_correction(d, rollout, mask, rollout_is="token", rollout_is_threshold=2.0, rollout_is_batch_normalize=True)
    mean = (2.0 + 0.5 + 1.0 + 1.5 + 0.2) / 5
    close(w, T([[2.0, 0.5, 1.0], [1.5, 0.2, 0.0]]) / mean)
    close(m["rollout_corr/rollout_is_batch_norm_factor"], mean)
    w, m = A.rollout_correction(d, rollout, mask, rollout_is="sequence", rollout_is_threshold=2.0, rollout_is_batch_normalize=True)
    close(w, T([[1.5, 1.5, 1.5], [0.3, 0.3, 0.0]]) / 0.9)  # mean over rows, not tokens
    # the off-policy diagnostics
    close(m["rollout_corr/kl"], -(math.log(3.0) + math.log(0.5) + math.log(1.5) + math.log(0.2)) / 5)
    close(m["rollout_corr/chi2_token"], (9.0 + 0.25 + 1.0 + 2.25 + 0.04) / 5 - 1)
    none, m = A.rollout_correction(d, rollout, mask, rollout_is=None)
    assert none is None and "rollout_corr/k3_kl" in m


def test_config_refuses_bad_settings_in_one_line():
    from rlstage.engines.preflight import check_registered_names
    from rlstage.schemas.config import ConfigError, load_config

    def load(overrides):  # the CLI's loading: the model, then the names and needs against the registries
        check_registered_names(cfg := load_config(None, overrides))
        return cfg

    bad = {
        "rollout_is_threshold": (["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold='2_0.5'"], "IcePop band needs low < high"),
        "passk": (["algorithm.adv_estimator=grpo_passk", "rollout.n=1"], "needs groups of n >= 2"),
        "dro": (["actor.policy_loss=dro"], r"actor\.policy_loss\.dro_beta: Field required"),
        "otb": (["algorithm.adv_estimator=optimal_token_baseline"], "set actor.calculate_sum_pi_squared=true"),
        "bypass": (["actor.policy_loss=bypass_mode"], "bypass_mode=true"),
        "bypass_other": (["algorithm.rollout_correction.bypass_mode=true", "actor.policy_loss=gspo"], "leave actor.policy_loss"),
        "actor_copy": (["actor.rollout_correction.rollout_is=token"], "set it there"),
        "rs": (["algorithm.rollout_correction.rollout_rs=token_k1"], "rollout_rs"),
    }
    for key, (overrides, match) in bad.items():
        with pytest.raises(ConfigError, match=match) as err:
            load(overrides)
        assert "\n" not in str(err.value), key
    cfg = load_config(None, ["algorithm.rollout_correction.rollout_is=sequence", "algorithm.rollout_correction.rollout_is_threshold='0.5_2'"])
    assert cfg.algorithm.rollout_correction.rollout_is_threshold == "0.5_2"
    assert cfg.actor.rollout_correction == cfg.algorithm.rollout_correction
    assert cfg.actor.rollout_correction.enabled
