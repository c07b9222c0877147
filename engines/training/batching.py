"""Planning micro-batches and the shared mini-batch loop (model inputs and forwards: ``engines/training/forward.py``).

Micro-batches hold either a fixed number of samples (``micro_batch_size``, the default) or as many as fit
a token budget (``micro_batch_tokens``): the tokens the forward actually processes, i.e. the packed row
length with packing and rows x padded width without. With a token budget (and with data parallelism or
``token-sum``) each micro-batch's loss is ``agg_loss`` with the mini-batch's global counts (``AggNorm``,
global over data-parallel ranks, as verl's ``global_batch_info``), so the accumulated gradient equals that
of the whole mini-batch as one batch for every ``loss_agg_mode``; the fixed-count mode keeps verl's
``len(micro) / len(mini)`` scaling, bit for bit as before.
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from rlstage.engines.algorithms import AggNorm, agg_norm
from rlstage.engines.models.device import model_device
from rlstage.engines.training.forward import (
    NO_GRAD_SCALE,
    check_packing_supported,
    model_inputs,
    pad_right,
    to_device,
)
from rlstage.schemas.config import ActorConfig, CriticConfig, OptimConfig


# ====================================================================== micro-batch planning
def micro_batch_cost(
    prompt_lens: Sequence[int], response_lens: Sequence[int], packed: bool, prompts: int | None = None
) -> int:
    """Tokens one forward processes: the packed row length, or rows x padded width; with ``prompts`` distinct
    prompts shared (``build_shared_inputs``), each prompt once at the padded prompt width plus the responses."""
    if packed:
        return sum(prompt_lens) + sum(response_lens)
    if prompts is not None:
        return prompts * max(prompt_lens, default=0) + len(response_lens) * max(response_lens, default=0)
    return len(prompt_lens) * (max(prompt_lens, default=0) + max(response_lens, default=0))


def check_sequences_fit(
    idx: Iterable[int],
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    budget: int,
    setting: str,
) -> None:
    """A sequence longer than the token budget fits in no micro-batch: an error naming ``setting``."""
    for i in idx:
        p, r = len(prompt_ids[i]), len(response_ids[i])
        if p + r > budget:
            raise ValueError(
                f"{setting}={budget} is smaller than one sequence ({p} prompt + {r} response tokens): "
                f"raise {setting} to at least {p + r}"
            )


def plan_micro_batches(
    idx: Sequence[int],
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    *,
    count: int,
    budget: int | None,
    packed: bool,
    setting: str,
    shared: bool = False,
) -> list[list[int]]:
    """Split sample ids ``idx`` into micro-batches: ``count`` at a time, or up to ``budget`` tokens each.

    With a budget and padding, the samples are sorted longest first and cut where the micro-batches process the
    fewest tokens, padding included (``cheapest_cuts``); with shared prompts a prompt counts once per micro-batch,
    and both the prompt-grouped order and the response-length order are tried. With packing there is no padding:
    the given order is kept and filled greedily. A sequence longer than the budget is an error naming ``setting``.
    """
    order = list(idx)
    if shared:
        first: dict[tuple[int, ...], int] = {}
        for i in order:
            first.setdefault(tuple(prompt_ids[i]), i)
        order.sort(key=lambda i: (-len(prompt_ids[i]), first[tuple(prompt_ids[i])], -len(response_ids[i])))
    if budget is None:
        return [order[u : u + count] for u in range(0, len(order), count)]
    check_sequences_fit(order, prompt_ids, response_ids, budget, setting)
    if not packed:
        if not shared:
            order.sort(key=lambda i: len(prompt_ids[i]) + len(response_ids[i]), reverse=True)
            return cheapest_cuts(order, prompt_ids, response_ids, budget, shared=False)[1]
        by_length = sorted(order, key=lambda i: (-len(response_ids[i]), -len(prompt_ids[i])))
        return min(cheapest_cuts(o, prompt_ids, response_ids, budget, shared=True) for o in (order, by_length))[1]
    plans: list[list[int]] = []
    current: list[int] = []
    for i in order:
        trial = current + [i]
        if current and micro_batch_cost([len(prompt_ids[j]) for j in trial], [len(response_ids[j]) for j in trial], True) > budget:
            plans.append(current)
            trial = [i]
        current = trial
    if current:
        plans.append(current)
    return plans


# What a forward/backward costs besides its tokens (kernel launches, Python, the optimizer's hooks), in tokens:
# without it the cheapest cuts of distinct lengths would be one row each.
MICRO_BATCH_OVERHEAD_TOKENS = 64


def cheapest_cuts(
    order: Sequence[int], prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]], budget: int,
    *, shared: bool,
) -> tuple[float, list[list[int]]]:
    """``order`` cut into consecutive padded micro-batches of at most ``budget`` tokens each, the cuts chosen (dynamic
    programming) for the fewest tokens processed plus ``MICRO_BATCH_OVERHEAD_TOKENS`` each; (that total, the plans).

    A micro-batch's cost only grows as it takes more samples, so each start stops extending at the budget: the
    work is ``len(order)`` times the samples a budget holds.
    """
    n = len(order)
    best = [0.0] + [math.inf] * n
    start = [0] * (n + 1)
    for i in range(n):
        width_p = width_r = 0
        prompts: set[tuple[int, ...]] = set()
        for j in range(i, n):
            k = order[j]
            width_p, width_r = max(width_p, len(prompt_ids[k])), max(width_r, len(response_ids[k]))
            rows = j - i + 1
            if shared:
                prompts.add(tuple(prompt_ids[k]))
                cost = len(prompts) * width_p + rows * width_r
            else:
                cost = rows * (width_p + width_r)
            if cost > budget and rows > 1:
                break
            if best[i] + cost + MICRO_BATCH_OVERHEAD_TOKENS < best[j + 1]:
                best[j + 1], start[j + 1] = best[i] + cost + MICRO_BATCH_OVERHEAD_TOKENS, i
    plans: list[list[int]] = []
    end = n
    while end:
        plans.append(list(order[start[end] : end]))
        end = start[end]
    return best[n], plans[::-1]


# ====================================================================== exact loss weighting
def metric_weight(mask: torch.Tensor, norm: AggNorm) -> float:
    """A micro-batch's share of the mini-batch's policy tokens (times ``dp_size``): token-mean metrics computed
    on a micro-batch, weighted by it and summed (and averaged over ranks), are the mini-batch's. The LOSS needs
    no weight: ``agg_loss`` divides by the global counts itself (``AggNorm.agg_kwargs``)."""
    tokens = norm.tokens if norm.tokens > 0 else 1.0  # an empty mini-batch: agg_loss divides by 1 too
    return float(mask.sum()) / tokens * norm.dp_size


@dataclass(frozen=True)
class MicroBatch:
    """One forward/backward: the sample ids and how its loss enters the mini-batch gradient.

    Fixed-count mode (``norm`` None): the loss is scaled by ``scale = len(idx) / mini_len``, verl's scaling.
    Exact mode (a token budget, data parallelism, or ``token-sum``): each loss term is ``agg_loss`` with the
    mini-batch's global counts ``norm`` (``scale`` is 1) and the metrics come back weighted, to be summed
    per mini-batch.
    """

    idx: list[int]
    mini_len: int
    norm: AggNorm | None
    # A pass with its response mask zeroed (no loss, gradient or metric): it keeps a rank in step with peers that
    # run more micro-batches (ZeRO 2-3 collectives in every backward).
    filler: bool = False

    @property
    def scale(self) -> float:
        return len(self.idx) / self.mini_len if self.norm is None else 1.0


def split_to_count(plans: list[list[int]], count: int) -> list[list[int]]:
    """``plans`` with the largest micro-batch halved until there are ``count`` (or every one holds one sample).

    A half of a micro-batch costs no more tokens than the whole, so each stays within its token budget.
    """
    plans = [list(p) for p in plans]
    while len(plans) < count:
        i = max(range(len(plans)), key=lambda j: len(plans[j]), default=None)
        if i is None or len(plans[i]) < 2:
            break
        half = len(plans[i]) // 2
        plans[i : i + 1] = [plans[i][:half], plans[i][half:]]
    return plans


# ====================================================================== the shared loop
def adamw(params: list[torch.nn.Parameter], optim: OptimConfig) -> torch.optim.AdamW:
    """AdamW as ``optim`` sets it; ``fused`` picks torch's one-kernel step, else torch's default loop."""
    return torch.optim.AdamW(
        params, lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay, fused=True if optim.fused else None
    )


def lr_lambda(optim: OptimConfig, total_steps: int) -> Callable[[int], float]:
    """Linear warm-up from 0, then constant, cosine or linear decay down to ``min_lr_ratio`` at ``total_steps``.

    The multiplier of optimizer step ``step`` (0-based), as HF's/verl's ``get_cosine_schedule_with_warmup``:
    ``step / warmup_steps`` during warm-up, then ``min + (1 - min) * decay(progress)``.
    """

    def fn(step: int) -> float:
        if step < optim.warmup_steps:
            return step / optim.warmup_steps
        if optim.lr_schedule == "constant":
            return 1.0
        span = max(1, total_steps - optim.warmup_steps)
        progress = min(1.0, (step - optim.warmup_steps) / span)
        if optim.lr_schedule == "cosine":
            decay = 0.5 * (1 + math.cos(math.pi * progress))
        else:
            decay = 1 - progress
        return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * decay

    return fn


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """What the optimizer steps: every weight, or a LoRA policy's adapters (its base is frozen)."""
    return [p for p in model.parameters() if p.requires_grad]


class MiniBatchTrainer:
    """What the actor and the critic share: AdamW + schedule, micro-batch planning and the epoch loop.

    Subclasses set ``metric_prefix`` and call ``_train_epochs`` with their micro-step. ``DeepSpeedActor``
    overrides ``_zero_grad`` and ``_optimizer_step`` and sets ``dp_rank``/``dp_size``.
    """

    metric_prefix = "train"
    model: torch.nn.Module
    cfg: ActorConfig | CriticConfig
    pad_id: int
    # Data parallelism: every rank gets the whole batch and trains the ``dp_rank``-th contiguous slice of each
    # global mini-batch (the same shuffle on every rank), so N ranks step exactly as one process would.
    dp_rank: int = 0
    dp_size: int = 1

    def __init__(self, model: torch.nn.Module, cfg: ActorConfig | CriticConfig, pad_id: int, total_steps: int) -> None:
        self.model = model
        self.cfg = cfg
        self.pad_id = pad_id
        if cfg.packing:
            check_packing_supported(model)
        o = cfg.optim
        self.optimizer = adamw(trainable_parameters(model), o)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(o, o.total_steps or total_steps))

    @property
    def _shared(self) -> bool:
        """Whether the samples of a prompt share its forward (``actor.share_prompts``; the critic does not)."""
        return False

    @property
    def _whole_groups(self) -> bool:
        """Whether a mini-batch holds a prompt's samples together (``actor.group_mini_batches``; not the critic)."""
        return False

    # ---- inputs (these use only model, cfg and pad_id: a bare instance can run the no-grad passes)
    @property
    def device(self) -> torch.device:
        return model_device(self.model)

    def _inputs(
        self, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]], device: torch.device | None = None
    ) -> dict:
        inputs = model_inputs(prompt_ids, response_ids, self.pad_id, self.cfg.packing, self._shared)
        return to_device(inputs, device or self.device)

    def _micro_inputs(
        self, batch: dict[str, list], idx: list[int], *fields: str, filler: bool = False
    ) -> tuple[dict, list[torch.Tensor]]:
        """Model inputs of the samples ``idx`` and their per-token ``fields``, padded to the response width.

        ``filler``: the response mask is all 0, so the micro-batch's loss, gradient and metrics are 0.
        """
        device = self.device  # once: finding it walks the model's modules (~25 us), a fifth of the engine's cost over a raw loop
        inputs = self._inputs([batch["prompt_ids"][i] for i in idx], [batch["response_ids"][i] for i in idx], device)
        R = inputs["response_width"]
        out = [pad_right([batch[f][i] for i in idx], 0.0, torch.float32, R).to(device) for f in fields]
        return inputs, [t.zero_() if filler and f == "response_mask" else t for f, t in zip(fields, out, strict=True)]

    def _no_grad_chunks(
        self, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]]
    ) -> Iterator[tuple[list[int], dict]]:
        """(sample ids, model inputs) chunks covering every sample once, for the no-grad passes."""
        cfg = self.cfg
        scale = 1 if cfg.packing else NO_GRAD_SCALE
        budget = None
        if cfg.micro_batch_tokens is not None:
            # The configured budget is the limit for a single sequence, in every pass.
            check_sequences_fit(
                range(len(prompt_ids)), prompt_ids, response_ids, cfg.micro_batch_tokens, f"{self.metric_prefix}.micro_batch_tokens"
            )
            budget = cfg.micro_batch_tokens * scale
        plans = plan_micro_batches(
            range(len(prompt_ids)),
            prompt_ids,
            response_ids,
            count=cfg.micro_batch_size * scale,
            budget=budget,
            packed=cfg.packing,
            setting=f"{self.metric_prefix}.micro_batch_tokens",
            shared=self._shared,
        )
        for ids in plans:
            yield ids, self._inputs([prompt_ids[i] for i in ids], [response_ids[i] for i in ids])

    def _micro_batches(self, batch: dict[str, list], mini: list[int], local: list[int]) -> list[MicroBatch]:
        """This rank's micro-batches of ``local`` (its slice of the global mini-batch ``mini``).

        With several ranks, every rank runs as many micro-batches as the rank with the most (verl's
        same_micro_num_in_dp): under ZeRO 2-3 each backward (and ZeRO-3's forward) is a collective, so a rank
        that ran fewer would leave its peers waiting. Every rank holds the whole batch, so it plans its peers'
        slices itself; halving a micro-batch keeps the loss weights exact, and a rank short of samples with
        policy tokens runs filler passes.
        """
        cfg = self.cfg
        # a constant for seq-mean-token-sum-norm (actor.loss_scale_factor, the critic has none) reaches agg_loss through
        # the global counts: the fixed-count form would divide each micro-batch by its own width
        scale = cfg.loss_scale_factor if isinstance(cfg, ActorConfig) else None
        # token-sum has no fixed-count form (verl's len(micro) / len(mini) scaling would divide the sum).
        if cfg.micro_batch_tokens is None and cfg.loss_agg_mode != "token-sum" and scale is None:
            return [MicroBatch(idx, len(local), None) for idx in self._plan(batch, local)]  # as many on every rank
        norm = agg_norm([batch["response_mask"][i] for i in mini], self.dp_size, scale)
        ranks = [self._live(batch, self._plan(batch, self._rank_slice(mini, r))) for r in range(self.dp_size)]
        most = max(len(p) for p in ranks)
        plans = split_to_count(ranks[self.dp_rank], most)
        fillers = [MicroBatch(local[:1], len(mini), norm, filler=True)] * (most - len(plans))
        return [MicroBatch(idx, len(mini), norm) for idx in plans] + fillers

    def _plan(self, batch: dict[str, list], local: list[int]) -> list[list[int]]:
        cfg = self.cfg
        return plan_micro_batches(
            local,
            batch["prompt_ids"],
            batch["response_ids"],
            count=cfg.micro_batch_size,
            budget=cfg.micro_batch_tokens,
            packed=cfg.packing,
            setting=f"{self.metric_prefix}.micro_batch_tokens",
            shared=self._shared,
        )

    @staticmethod
    def _live(batch: dict[str, list], plans: list[list[int]]) -> list[list[int]]:
        # A micro-batch without policy tokens has weight 0 in every mode but row-mean: skipped (its width-0
        # loss is 0/0); in row-mean (geo_mean) an empty row's loss is 0 anyway.
        return [idx for idx in plans if any(any(batch["response_mask"][i]) for i in idx)]

    # ---- the loop
    def _epoch_order(self, batch: dict[str, list], gen: torch.Generator) -> list[int]:
        """The samples in this epoch's order: as stored, shuffled, or with whole prompt groups shuffled."""
        n = len(batch["prompt_ids"])
        if not self.cfg.shuffle:
            return list(range(n))
        if not self._whole_groups:
            return torch.randperm(n, generator=gen).tolist()
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, p in enumerate(batch["prompt_ids"]):
            groups.setdefault(tuple(p), []).append(i)
        runs = list(groups.values())
        return [i for g in torch.randperm(len(runs), generator=gen).tolist() for i in runs[g]]

    def _rank_slice(self, mini: list[int], rank: int | None = None) -> list[int]:
        if len(mini) % self.dp_size:
            raise ValueError(f"a mini-batch of {len(mini)} samples does not split over {self.dp_size} data-parallel ranks")
        per = len(mini) // self.dp_size
        rank = self.dp_rank if rank is None else rank
        return mini[rank * per : (rank + 1) * per]

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _optimizer_step(self) -> float:
        """Clip, step unless the norm is not finite; the pre-clip gradient norm."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        return float(grad_norm)

    def _train_epochs(
        self, batch: dict[str, list], seed: int, micro_step: Callable[[MicroBatch], dict[str, float]]
    ) -> dict[str, float]:
        """Epochs over shuffled mini-batches, one optimizer step per mini-batch; metric means.

        Fixed-count mode records every micro-batch's metrics; token-budget mode records one value per
        mini-batch, the sum of the micro-batches' weighted metrics (so it does not depend on the split).
        """
        cfg = self.cfg
        n = len(batch["prompt_ids"])
        mini_size = cfg.ppo_mini_batch_size  # global: every rank walks the same mini-batches
        gen = torch.Generator().manual_seed(seed)
        sums: dict[str, list[float]] = defaultdict(list)
        self.model.train()
        for _epoch in range(cfg.ppo_epochs):
            order = self._epoch_order(batch, gen)
            for m in range(0, n, mini_size):
                mini = order[m : m + mini_size]
                self._zero_grad()
                acc: dict[str, float] = defaultdict(float)
                micros = self._micro_batches(batch, mini, self._rank_slice(mini))
                for micro in micros:
                    for k, v in micro_step(micro).items():
                        if micro.norm is None:
                            sums[k].append(v)
                        else:
                            acc[k] += v
                for k, v in acc.items():
                    sums[k].append(v)
                # No sample of the global mini-batch has policy tokens: no gradient, no step on any rank (AdamW
                # skips parameters without one; ZeRO-3 cannot step without a backward). The schedule goes on.
                norm = self._optimizer_step() if micros else 0.0
                sums[f"{self.metric_prefix}/grad_norm"].append(norm)
                sums[f"{self.metric_prefix}/lr"].append(self.scheduler.get_last_lr()[0])
                self.scheduler.step()
        self.model.eval()
        return {k: float(sum(v) / len(v)) for k, v in sums.items()}

    def state_dict(self, live: bool = False) -> dict:
        """Optimizer and scheduler state (torch's optimizer state dict holds its live tensors either way)."""
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if "zero_stage" in state:  # DeepSpeedActor.state_dict(): ZeRO's optimizer layout, not torch's
            raise ValueError(
                f"this optimizer state was saved by the deepspeed engine (ZeRO-{state['zero_stage']}); "
                "the torch engine cannot resume it"
            )
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
