"""A reward function in verl's ``compute_score`` signature, with partial credit for each right digit.

``reward.function: digit_match``, or left unset: it scores the rows whose ``data_source`` is ``my_org/arith``.
"""

from __future__ import annotations

from rlstage.engines.rewards.rules import exact_match_answer, register_reward_fn


# correct_at: the eval counts 1.0 only as correct, since partial credit can pass one half
@register_reward_fn("digit_match", correct_at=1.0, data_sources=("my_org/arith",))
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1.0 for the exact answer (the response's first word); otherwise 0.9 times the share of digits in their
    right place, counted from the units. The ``acc`` key is logged beside the score as a per-sample metric."""
    answer = exact_match_answer(solution_str, extra_info or {})  # cut at an end-of-sequence marker
    if answer == ground_truth:
        return {"score": 1.0, "acc": 1.0}
    same = sum(a == b for a, b in zip(reversed(answer), reversed(ground_truth), strict=False))
    return {"score": 0.9 * same / max(len(answer), len(ground_truth), 1), "acc": 0.0}
