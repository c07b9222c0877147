"""Checkpoint retention: the newest ``trainer.max_actor_ckpt_to_keep`` policy checkpoints keep their weights and
optimizer state, and so does every ``trainer.keep_checkpoint_every``-th iteration's; the others are pruned. The
critic's checkpoints (GAE) follow the same rule.

A pruned update (or critic) artifact keeps its id, metrics and inputs and is marked ``between_checkpoints``:
whoever needs its weights (a resume, a replay, an eval) rebuilds them from the nearest kept checkpoint by
re-running the updates from stored experience, exactly as for a policy between checkpoints
(``trainer.checkpoint_every``).
"""

from __future__ import annotations

from rlstage.infra.store import ArtifactStore
from rlstage.schemas.config import RunConfig
from rlstage.schemas.manifest import MODEL_DIR, STATE_DIR, Manifest

PRUNED = (MODEL_DIR + "/", STATE_DIR + "/")


def kept_iterations(checkpointed: list[int], keep_last: int, keep_every: int | None) -> set[int]:
    """Of the iterations holding a checkpoint, those retention keeps."""
    newest = set(sorted(checkpointed)[-keep_last:]) if keep_last > 0 else set()
    return newest | {it for it in checkpointed if keep_every and it % keep_every == 0}


def prune_checkpoints(cfg: RunConfig, store: ArtifactStore, through: int) -> list[Manifest]:
    """Prune the policy (and critic) checkpoints of iterations up to ``through`` that retention does not keep;
    returns them. Walks back from ``through`` and stops at the first pruned artifact: everything older was
    handled then."""
    t = cfg.trainer
    if t.max_actor_ckpt_to_keep is None:
        return []
    # A pipelined rollout still samples with the policy its iteration started from: that one stays too.
    keep_last = t.max_actor_ckpt_to_keep + t.async_staleness
    pruned = []
    for stage in ("update", "critic") if cfg.critic.enable else ("update",):
        held = {}
        for it in range(through, 0, -1):
            if stage == "update" and it % t.checkpoint_every:
                continue
            m = store.manifest(cfg.run_name, it, stage)
            if m is None:
                continue
            if m.meta.get("pruned"):
                break
            # a critic is rebuilt from the one before it: one stored without that reference stays whole
            if not m.meta.get("between_checkpoints") and (stage == "update" or "critic_ref" in m.meta):
                held[it] = m
        keep = kept_iterations(list(held), keep_last, t.keep_checkpoint_every)
        meta = {"between_checkpoints": True, "pruned": True}
        pruned += [store.prune(held[it], PRUNED, meta) for it in sorted(held) if it not in keep]
    return pruned


def stored_checkpoints(store: ArtifactStore, run: str) -> list[int]:
    """Iterations whose policy weights are stored (not rebuilt on demand), ascending."""
    out = []
    for it in store.iterations(run):
        m = store.manifest(run, it, "update")
        if m is not None and not m.meta.get("between_checkpoints"):
            out.append(it)
    return out
