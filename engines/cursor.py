"""Which prompts an iteration trains on: a pure function of the iteration number.

Each epoch is a seeded permutation of the train split, so a resumed or replayed iteration
sees exactly the prompts it saw the first time, with no cursor state to save.
"""

from __future__ import annotations

import random


def prompt_batch(num_prompts: int, iteration: int, per_iteration: int, seed: int) -> list[int]:
    """Row indices of the train prompts for ``iteration`` (1-based)."""
    if num_prompts < 1:
        raise ValueError("the train split has no prompts")
    start = (iteration - 1) * per_iteration
    out: list[int] = []
    cache: dict[int, list[int]] = {}
    for pos in range(start, start + per_iteration):
        epoch, offset = divmod(pos, num_prompts)
        if epoch not in cache:
            perm = list(range(num_prompts))
            random.Random(seed * 7919 + epoch).shuffle(perm)
            cache[epoch] = perm
        out.append(cache[epoch][offset])
    return out
