"""Look into a run's experience with polars: lazy frames over the store's committed Parquet.

    from rlstage.infra.explore import Experience
    exp = Experience.open(ArtifactStore("./rlstage-runs"), "demo")
    exp.samples().filter(pl.col("score") == 0).select("iteration", "prompt", "response_text").collect()
    run_query(exp, "rewards").collect()

Only committed artifacts (those with a manifest) of the main version are read, one file per
iteration, through the store's own fsspec filesystem (a local folder or S3 with the store's
storage options): each frame is a pyarrow dataset scanned lazily, so a filter or a column
selection reads only what it needs. Files are not re-hashed here (training reads verify them);
the manifest's row count is checked against the Parquet footer when a frame is built.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Callable
from dataclasses import dataclass

import polars as pl

from rlstage.infra.store import MAIN, ArtifactStore, StoreError
from rlstage.schemas.manifest import Manifest
from rlstage.schemas.stages import STAGE_FILES

# Frame name -> the stage that commits it.
TABLES = {"rollouts": "rollout", "rewards": "reward", "experience": "advantage", "eval": "eval"}
# Experience columns that repeat the rollout's (tokens, mask) or the reward's score: joined once.
_REPEATED = ("group_id", "prompt_ids", "response_ids", "response_mask", "score")


class NotCommitted(StoreError):
    """The run, or the iteration asked for, has nothing committed to look at."""


def _runs_under(store: ArtifactStore) -> list[str]:
    """Names of the training runs under the store's root (folders holding a run.json)."""
    try:
        found = store.fs.glob(posixpath.join(store.fs._strip_protocol(store.root), "*", "run.json"))
    except (FileNotFoundError, OSError):
        return []
    return sorted(posixpath.basename(posixpath.dirname(p)) for p in found)


def _span(iterations: list[int]) -> str:
    if not iterations:
        return "none"
    contiguous = iterations == list(range(iterations[0], iterations[-1] + 1))
    return f"{iterations[0]}..{iterations[-1]}" if contiguous and len(iterations) > 2 else ", ".join(map(str, iterations))


@dataclass(frozen=True)
class Experience:
    """The committed rollouts, rewards, experience and evals of one run, per iteration."""

    store: ArtifactStore
    run: str
    iterations: tuple[int, ...]  # the iterations looked at (each has a committed rollout)
    version: str = MAIN
    sample_id: str | None = None  # one sample only (every frame filtered to it)

    @classmethod
    def open(
        cls, store: ArtifactStore, run: str, iterations: list[int] | None = None, version: str = MAIN, sample_id: str | None = None
    ) -> Experience:
        """Select ``iterations`` (default: every iteration with a committed rollout) of ``run``, and one sample."""
        committed = [it for it in store.iterations(run) if store.manifest(run, it, "rollout", version)]
        if not committed:
            runs = _runs_under(store)
            raise NotCommitted(
                f"run {run!r} has no committed rollouts under {store.root} "
                f"(runs there: {', '.join(runs) if runs else 'none'})"
            )
        missing = sorted(set(iterations or []) - set(committed))
        if missing:
            raise NotCommitted(
                f"run {run!r} has no committed rollout for iteration {', '.join(map(str, missing))} "
                f"(committed: {_span(committed)})"
            )
        return cls(store, run, tuple(sorted(iterations) if iterations else committed), version, sample_id)

    def _manifests(self, stage: str) -> list[Manifest]:
        found = (self.store.manifest(self.run, it, stage, self.version) for it in self.iterations)
        return [m for m in found if m is not None]

    def _scan(self, m: Manifest) -> pl.LazyFrame:
        import pyarrow.dataset as ds  # here: the CLI's parser imports this module for its query names

        uri = self.store.uri(m, STAGE_FILES[m.stage])
        dataset = ds.dataset(self.store.fs._strip_protocol(uri), format="parquet", filesystem=self.store.fs)
        rows = m.files[STAGE_FILES[m.stage]].rows
        if dataset.count_rows() != rows:  # from the footer: cheap, and catches a swapped file
            raise StoreError(f"{uri}: {dataset.count_rows()} rows, manifest says {rows}")
        return pl.scan_pyarrow_dataset(dataset).with_columns(iteration=pl.lit(m.iteration, pl.Int64))

    def frame(self, name: str) -> pl.LazyFrame:
        """One table (``rollouts``, ``rewards``, ``experience``, ``eval``) across the iterations, with ``iteration``."""
        if name not in TABLES:
            raise ValueError(f"unknown table {name!r}; known: {', '.join(TABLES)}")
        manifests = self._manifests(TABLES[name])
        if not manifests:
            raise NotCommitted(f"run {self.run!r} has no committed {TABLES[name]} in iterations {_span(list(self.iterations))}")
        # diagonal: a column added in a later release (schemas.artifacts.LATE_COLUMNS) is null in older iterations
        frame = pl.concat([self._scan(m) for m in manifests], how="diagonal_relaxed")
        return frame if self.sample_id is None or name == "eval" else frame.filter(pl.col("sample_id") == self.sample_id)

    def rollouts(self) -> pl.LazyFrame:
        return self.frame("rollouts")

    def rewards(self) -> pl.LazyFrame:
        return self.frame("rewards")

    def experience(self) -> pl.LazyFrame:
        return self.frame("experience")

    def samples(self) -> pl.LazyFrame:
        """Rollouts joined with their rewards and experience by (iteration, sample_id).

        Left joins: an iteration whose reward or advantage stage is not committed keeps its
        rollouts, with nulls in the later stages' columns.
        """
        keys = ["iteration", "sample_id"]
        out = self.rollouts()
        if self._manifests("reward"):
            # the failure kind is the rollout's, repeated in the rewards table
            out = out.join(self.rewards().drop("failure", strict=False), on=keys, how="left")
        if self._manifests("advantage"):
            out = out.join(self.experience().drop(*_REPEATED), on=keys, how="left")
        return out

    def metrics(self) -> pl.LazyFrame:
        """Each stage's metrics per iteration as the training flow logged them to MLflow, and its
        compute seconds (name ``compute_s``): iteration, stage, name, value. Iteration 0 (the
        initial policy's eval) is included."""
        iterations = sorted({0, *self.iterations})
        rows = [
            (m.iteration, stage, name, float(value))
            for stage in ("rollout", "reward", "advantage", "critic", "update", "eval")
            for m in (self.store.manifest(self.run, it, stage, self.version) for it in iterations)
            if m is not None
            for name, value in sorted({**m.meta.get("metrics", {}), "compute_s": m.meta.get("compute_s", 0.0)}.items())
        ]
        schema = {"iteration": pl.Int64, "stage": pl.String, "name": pl.String, "value": pl.Float64}
        return pl.DataFrame(rows, schema=schema, orient="row").lazy()


# ---------------------------------------------------------------------- queries
Query = Callable[[Experience, int], pl.LazyFrame]
QUERIES: dict[str, Query] = {}


def query(name: str) -> Callable[[Query], Query]:
    def register(fn: Query) -> Query:
        QUERIES[name] = fn
        return fn

    return register


def run_query(exp: Experience, name: str, limit: int = 10) -> pl.LazyFrame:
    if name not in QUERIES:
        raise ValueError(f"unknown query {name!r}; known: {', '.join(QUERIES)}")
    return QUERIES[name](exp, limit)


@query("rewards")
def reward_by_source(exp: Experience, limit: int) -> pl.LazyFrame:
    """Per iteration and data source: samples, mean/std reward, and the share of prompt groups whose
    samples all scored the same (their group-relative advantage is zero: nothing to learn from)."""
    s = exp.samples()
    flat = (
        s.group_by("iteration", "data_source", "group_id")
        .agg(pl.col("score").n_unique().alias("distinct"))
        .group_by("iteration", "data_source")
        .agg((pl.col("distinct") == 1).mean().alias("flat_groups"))
    )
    stats = s.group_by("iteration", "data_source").agg(
        pl.len().alias("samples"),
        pl.col("score").mean().alias("reward_mean"),
        pl.col("score").std().alias("reward_std"),
    )
    return stats.join(flat, on=["iteration", "data_source"]).sort("iteration", "data_source")


_SHOWN = ["iteration", "sample_id", "data_source", "score", "response_length", "prompt", "response_text", "ground_truth"]


def _shown(exp: Experience) -> list[str]:
    """The columns best/worst show: with ``failure`` (how an agent's sample failed) where any sample failed, so a
    timeout never reads as an ordinary 0.0 (read from the rollouts alone, not their join with the later stages)."""
    rollouts = exp.rollouts()
    if "failure" in rollouts.collect_schema().names() and rollouts.select(pl.col("failure").is_not_null().any()).collect().item():
        return [*_SHOWN[:4], "failure", *_SHOWN[4:]]
    return _SHOWN


@query("best")
def best_samples(exp: Experience, limit: int) -> pl.LazyFrame:
    """The highest-reward samples with their prompts and responses (ties: latest iteration first)."""
    return exp.samples().sort(["score", "iteration", "sample_id"], descending=[True, True, False]).head(limit).select(_shown(exp))


@query("worst")
def worst_samples(exp: Experience, limit: int) -> pl.LazyFrame:
    """The lowest-reward samples with their prompts and responses (ties: latest iteration first)."""
    return exp.samples().sort(["score", "iteration", "sample_id"], descending=[False, True, False]).head(limit).select(_shown(exp))


@query("lengths")
def length_distribution(exp: Experience, limit: int) -> pl.LazyFrame:
    """Response length per iteration: mean, quantiles, max and the share cut off at the token limit."""
    length = pl.col("response_length")
    return (
        exp.rollouts()
        .group_by("iteration")
        .agg(
            pl.len().alias("samples"),
            length.mean().alias("mean"),
            length.quantile(0.1).alias("p10"),
            length.median().alias("p50"),
            length.quantile(0.9).alias("p90"),
            length.max().alias("max"),
            (pl.col("finish_reason") == "length").mean().alias("truncated"),
        )
        .sort("iteration")
    )


def _policy_tokens(frame: pl.LazyFrame, *columns: str) -> pl.LazyFrame:
    """One row per generated response token (response_mask 1) with ``columns`` aligned to it."""
    return frame.explode(["response_mask", *columns]).filter(pl.col("response_mask") == 1)


@query("advantages")
def advantage_distribution(exp: Experience, limit: int) -> pl.LazyFrame:
    """Advantages over the policy's response tokens per iteration: mean, std, quantiles, share of zeros."""
    adv = pl.col("advantages")
    return (
        _policy_tokens(exp.experience().select("iteration", "response_mask", "advantages"), "advantages")
        .group_by("iteration")
        .agg(
            pl.len().alias("tokens"),
            adv.mean().alias("mean"),
            adv.std().alias("std"),
            adv.min().alias("min"),
            adv.quantile(0.1).alias("p10"),
            adv.median().alias("p50"),
            adv.quantile(0.9).alias("p90"),
            adv.max().alias("max"),
            (adv == 0).mean().alias("zero"),
        )
        .sort("iteration")
    )


@query("logprob-gap")
def logprob_gap(exp: Experience, limit: int) -> pl.LazyFrame:
    """Samples whose sampler log-probs differ most from the trainer's recomputed ones (max over tokens)."""
    cols = ["iteration", "sample_id", "response_mask", "rollout_log_probs", "old_log_probs"]
    tokens = _policy_tokens(
        exp.samples().select(cols).drop_nulls(["rollout_log_probs", "old_log_probs"]),
        "rollout_log_probs",
        "old_log_probs",
    ).with_columns(gap=(pl.col("rollout_log_probs") - pl.col("old_log_probs")).abs())
    per_sample = tokens.group_by("iteration", "sample_id").agg(
        pl.col("gap").max().alias("max_gap"), pl.col("gap").mean().alias("mean_gap"), pl.len().alias("tokens")
    )
    shown = exp.samples().select("iteration", "sample_id", "score", "response_text")
    return (
        per_sample.join(shown, on=["iteration", "sample_id"])
        .sort(["max_gap", "iteration", "sample_id"], descending=[True, False, False])
        .head(limit)
    )


@query("trajectory")
def trajectories(exp: Experience, limit: int) -> pl.LazyFrame:
    """The turns of the multi-turn (agent) samples with the most turns, latest iteration first (``-s``: one
    sample): who spoke, its tokens in the trajectory, the seconds the turn took, and what was said."""
    rollouts = exp.rollouts()
    have = rollouts.collect_schema().names()
    timed = "turn_seconds" in have  # runs of rlstage 0.1 have no turn timing
    picked = (
        rollouts.filter(pl.col("messages_json").is_not_null())
        .sort(["num_turns", "iteration", "sample_id"], descending=[True, True, False])
        .head(limit)
        .select("iteration", "sample_id", "prompt_length", "messages_json", "turn_bounds", *(["turn_seconds"] * timed))
        .collect()
    )
    if picked.is_empty():
        which = f"multi-turn (agent) sample {exp.sample_id!r}" if exp.sample_id else "multi-turn (agent) samples"
        raise NotCommitted(f"run {exp.run!r} has no {which} in iterations {_span(list(exp.iterations))}")
    rows = []
    for r in picked.iter_rows(named=True):
        messages = json.loads(r["messages_json"])
        first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
        rows += [(r["iteration"], r["sample_id"], 0, m["role"], r["prompt_length"] if i == 0 else None, None, m["content"])
                 for i, m in enumerate(messages[:first])]  # fmt: skip
        turns: list[list[dict]] = []  # an assistant message, or the tool / user messages that answer it
        for m in messages[first:]:
            if m["role"] == "assistant" or not turns or turns[-1][0]["role"] == "assistant":
                turns.append([m])
            else:
                turns[-1].append(m)
        seconds = r.get("turn_seconds") or [None] * len(r["turn_bounds"])
        for k, (said, bounds, took) in enumerate(zip(turns, r["turn_bounds"], seconds, strict=False), start=1):
            content = "\n".join(m["content"] for m in said)
            rows.append((r["iteration"], r["sample_id"], k, bounds["role"], bounds["end"] - bounds["start"], took, content))
    schema = {"iteration": pl.Int64, "sample_id": pl.String, "turn": pl.Int64, "role": pl.String, "tokens": pl.Int64,
              "seconds": pl.Float64, "content": pl.String}  # fmt: skip
    return pl.DataFrame(rows, schema=schema, orient="row").lazy()
