"""Which prompts an iteration trains on: a pure function of the iteration number.

Each epoch is a seeded permutation of the train split, so a resumed or replayed iteration
sees exactly the prompts it saw the first time, with no cursor state to save.
"""

from __future__ import annotations

import random


def _walk(num_prompts: int, start: int, count: int, seed: int | str) -> list[int]:
    """``count`` rows from position ``start`` of a stream of seeded per-epoch permutations."""
    if num_prompts < 1:
        raise ValueError("the train split has no prompts")
    out: list[int] = []
    cache: dict[int, list[int]] = {}
    for pos in range(start, start + count):
        epoch, offset = divmod(pos, num_prompts)
        if epoch not in cache:
            perm = list(range(num_prompts))
            random.Random(seed * 7919 + epoch if isinstance(seed, int) else f"{seed}:{epoch}").shuffle(perm)
            cache[epoch] = perm
        out.append(cache[epoch][offset])
    return out


def prompt_batch(num_prompts: int, iteration: int, per_iteration: int, seed: int) -> list[int]:
    """Row indices of the train prompts for ``iteration`` (1-based)."""
    return _walk(num_prompts, (iteration - 1) * per_iteration, per_iteration, seed)


def extra_prompt_batch(num_prompts: int, iteration: int, round_: int, per_iteration: int, seed: int, max_rounds: int) -> list[int]:
    """Row indices of dynamic sampling's extra generation round ``round_`` (1 .. max_rounds-1) of ``iteration``.

    A second stream of permutations, of which each iteration owns ``max_rounds - 1`` batches: the first
    round stays ``prompt_batch`` (the same first prompts as a run without dynamic sampling), no two
    iterations share a batch, and whether an earlier iteration needed extra rounds changes nothing later.
    Rows already in this iteration's earlier rounds are left out (the round may hold fewer prompts), unless
    that would leave none.
    """
    if not 1 <= round_ < max_rounds:
        raise ValueError(f"extra round {round_} outside 1..{max_rounds - 1}")
    start = ((iteration - 1) * (max_rounds - 1) + round_ - 1) * per_iteration
    taken = set(prompt_batch(num_prompts, iteration, per_iteration, seed))
    for earlier in range(1, round_):
        taken.update(_walk(num_prompts, start - (round_ - earlier) * per_iteration, per_iteration, f"extra-{seed}"))
    rows = _walk(num_prompts, start, per_iteration, f"extra-{seed}")
    fresh = [r for i, r in enumerate(rows) if r not in taken and r not in rows[:i]]
    return fresh or rows
