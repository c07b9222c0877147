"""Turning ragged token lists into model inputs, planning micro-batches, and the shared mini-batch loop.

Two input layouts, chosen by ``packing`` in the actor / critic config:

- padded (default): prompts left-padded to P, responses right-padded to R, one row per sequence;
- packed: the micro-batch's sequences concatenated into ONE row with no padding, position ids restarting
  at 0 for each sequence and ``attention_mask=None``. Hugging Face models (transformers >= 4.53) read the
  position-id restarts as sequence boundaries and build a block-diagonal causal mask (sdpa, eager, flex),
  or run varlen flash-attention, so no token attends across sequences. Checked here for sdpa and eager
  on CPU: the log-probs equal the padded ones within 1e-6 (``tests/test_batching.py``). ``use_cache=False``
  is required: with a cache object the model skips the packed-sequence detection.

- shared prompts (``actor.share_prompts``, padded): the samples of one prompt in a micro-batch share one forward
  of that prompt; its key/value cache is indexed out to every sample and the responses run on it (GRPO's n
  samples per prompt otherwise repeat the prompt's forward and backward n times). The backward reaches the
  prompt through the cache, so the gradient is the padded layout's up to float rounding (``tests/test_batching.py``).

Micro-batches hold either a fixed number of samples (``micro_batch_size``, the default) or as many as fit
a token budget (``micro_batch_tokens``): the tokens the forward actually processes, i.e. the packed row
length with packing and rows x padded width without. With a token budget (and with data parallelism or
``token-sum``) the loss of each micro-batch is weighted by its share of the mini-batch's ``agg_loss``
denominator (``AggNorm``, global over data-parallel ranks), so the accumulated gradient equals that of
the whole mini-batch as one batch for every ``loss_agg_mode``; the fixed-count mode keeps verl's
``len(micro) / len(mini)`` scaling, bit for bit as before.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from rlstage.schemas.config import ActorConfig, CriticConfig, OptimConfig

# Attention implementations that honour packed position ids (the mask builders of transformers'
# masking_utils, or flash-attention's varlen path). Only sdpa and eager are exercised on CPU here.
PACKING_ATTENTION = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")
# No-grad passes keep no activations: padded chunks may be this many times larger than a training micro-batch.
# Packed rows are not enlarged: on sdpa/eager a packed row's attention costs row_length squared.
NO_GRAD_SCALE = 4


def model_device(model: torch.nn.Module) -> torch.device:
    """Where a model's weights are (its inputs are built on the CPU and moved there)."""
    first = next(model.parameters(), None)
    return torch.device("cpu") if first is None else first.device


def to_device(inputs: dict, device: torch.device) -> dict:
    """The tensors of ``inputs`` on ``device`` (on the CPU, the same tensors: no copy)."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def pad_right(rows: Sequence[Sequence[float]], value: float, dtype: torch.dtype, width: int | None = None) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0) if width is None else width
    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, r in enumerate(rows):
        if len(r):
            out[i, : len(r)] = torch.as_tensor(list(r), dtype=dtype)
    return out


def build_inputs(
    prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]], pad_id: int
) -> dict[str, torch.Tensor]:
    """Concatenate each prompt (left-padded to P) with its response (right-padded to R).

    Logits at columns ``P-1 .. P+R-2`` predict the response tokens, for every row at once.
    Position ids count real tokens only, matching what generation used.
    """
    P = max(len(p) for p in prompt_ids)
    R = max((len(r) for r in response_ids), default=0)
    B = len(prompt_ids)
    input_ids = torch.full((B, P + R), pad_id, dtype=torch.long)
    attn = torch.zeros((B, P + R), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids, strict=True)):
        input_ids[i, P - len(p) : P] = torch.as_tensor(list(p), dtype=torch.long)
        attn[i, P - len(p) : P] = 1
        if len(r):
            input_ids[i, P : P + len(r)] = torch.as_tensor(list(r), dtype=torch.long)
            attn[i, P : P + len(r)] = 1
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": input_ids, "attention_mask": attn, "position_ids": position_ids, "prompt_width": P, "response_width": R}


def build_packed_inputs(
    prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]]
) -> dict[str, torch.Tensor]:
    """All sequences (prompt + response, no padding) in one row; position ids restart at 0 per sequence.

    ``logit_index[i, t]`` is the column whose logits predict response token ``t`` of sequence ``i`` and
    ``targets[i, t]`` that token; both are ``[B, R]`` with R the longest response (entries past a response's
    end point at column 0 and are masked out by the callers, as padded columns are).
    """
    R = max((len(r) for r in response_ids), default=0)
    B = len(prompt_ids)
    ids: list[int] = []
    pos: list[int] = []
    index = torch.zeros((B, R), dtype=torch.long)
    targets = torch.zeros((B, R), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids, strict=True)):
        if not len(p):
            raise ValueError(f"sequence {i} has an empty prompt: nothing predicts its first response token")
        start = len(ids) + len(p) - 1
        ids += list(p) + list(r)
        pos += range(len(p) + len(r))
        if len(r):
            index[i, : len(r)] = torch.arange(start, start + len(r))
            targets[i, : len(r)] = torch.as_tensor(list(r), dtype=torch.long)
    return {
        "input_ids": torch.as_tensor([ids], dtype=torch.long),
        "position_ids": torch.as_tensor([pos], dtype=torch.long),
        "logit_index": index,
        "targets": targets,
        "response_width": R,
        "packed": True,
    }


def build_shared_inputs(
    prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]], pad_id: int
) -> dict[str, torch.Tensor]:
    """Each distinct prompt once (left-padded to P, ``prompt_*``) and every response (right-padded to R) with the
    index of its prompt (``group``); the responses' attention mask spans the prompt's columns, then their own."""
    first: dict[tuple[int, ...], int] = {}
    group = torch.as_tensor([first.setdefault(tuple(p), len(first)) for p in prompt_ids], dtype=torch.long)
    prompts = build_inputs(list(first), [[] for _ in first], pad_id)
    responses = pad_right(response_ids, pad_id, torch.long)
    R = responses.shape[1]
    taken = torch.zeros_like(responses)
    for i, r in enumerate(response_ids):
        taken[i, : len(r)] = 1
    prompt_mask = prompts["attention_mask"]
    return {
        "prompt_ids": prompts["input_ids"],
        "prompt_mask": prompt_mask,
        "prompt_positions": prompts["position_ids"],
        "group": group,
        "input_ids": responses,
        "attention_mask": torch.cat([prompt_mask[group], taken], dim=1),
        "position_ids": prompt_mask.sum(-1)[group, None] + torch.arange(R)[None, :],
        "targets": responses,
        "response_width": R,
        "shared": True,
    }


def model_inputs(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    pad_id: int,
    packed: bool,
    shared: bool = False,
) -> dict[str, torch.Tensor]:
    if packed:
        return build_packed_inputs(prompt_ids, response_ids)
    if shared:
        return build_shared_inputs(prompt_ids, response_ids, pad_id)
    return build_inputs(prompt_ids, response_ids, pad_id)


def check_packing_supported(model: torch.nn.Module) -> None:
    """Refuse packing where the model would silently attend across packed sequences."""
    config = getattr(getattr(model, "module", model), "config", None)  # a DeepSpeed engine wraps the module
    impl = getattr(config, "_attn_implementation", None)
    try:
        from transformers.masking_utils import find_packed_sequence_indices  # noqa: F401
    except ImportError as err:  # transformers < 4.53 ignores packed position ids with sdpa/eager
        raise RuntimeError("packing needs transformers >= 4.53 (packed-sequence masks)") from err
    if impl not in PACKING_ATTENTION:
        raise ValueError(
            f"packing needs one of the attention implementations {', '.join(PACKING_ATTENTION)}; "
            f"the model uses {impl!r}"
        )


def takes_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether the wrapped Hugging Face model's forward takes ``logits_to_keep`` (causal LMs do; a critic's token
    classifier does not). DeepSpeed and peft wrappers pass keyword arguments through to it."""
    inner = model
    while hasattr(inner, "module"):  # DeepSpeed's engine
        inner = inner.module
    if hasattr(inner, "get_base_model"):  # peft
        inner = inner.get_base_model()
    return _forward_takes(type(inner), "logits_to_keep")


@functools.cache
def _forward_takes(cls: type, name: str) -> bool:
    return name in inspect.signature(cls.forward).parameters


def response_logits(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[B, R, V]`` logits, row ``i`` column ``t`` predicting response token ``t`` of sequence ``i``.

    Where the model takes ``logits_to_keep``, its output layer runs on the positions that predict response tokens
    only (as TRL does): prompt positions would cost a ``[tokens, vocabulary]`` matmul, forward and backward, that
    no loss reads (large beside a small model's layers: SmolLM2's vocabulary is 49,152)."""
    keep = takes_logits_to_keep(model)
    if inputs.get("shared"):
        return _shared_prompt_logits(model, inputs, keep)
    if inputs.get("packed"):
        index = inputs["logit_index"]
        kwargs = {}
        if keep:
            kept = torch.unique(index)  # sorted; padded entries point at column 0, which stays harmless
            kwargs["logits_to_keep"] = kept
            index = torch.searchsorted(kept, index)
        out = model(
            input_ids=inputs["input_ids"], attention_mask=None, position_ids=inputs["position_ids"], use_cache=False,
            **kwargs,
        )  # fmt: skip
        return out.logits[0, index]
    P, R = inputs["prompt_width"], inputs["response_width"]
    kwargs = {"logits_to_keep": R + 1} if keep else {}  # columns P-1 .. P+R-1 (0 would mean "all")
    out = model(
        input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], position_ids=inputs["position_ids"],
        **kwargs,
    )  # fmt: skip
    return out.logits[:, :R, :] if keep else out.logits[:, P - 1 : P + R - 1, :]


def _shared_prompt_logits(model: torch.nn.Module, inputs: dict[str, torch.Tensor], keep: bool) -> torch.Tensor:
    """The prompts' forward (its last column predicts each response's first token), then every response but its
    last token on the prompt's cache, indexed out per sample: ``[B, R, V]`` as ``response_logits``."""
    R, group = inputs["response_width"], inputs["group"]
    # The prompts through DeepSpeed's bare module: its engine counts one forward per backward (a second one left
    # every gradient unreduced); the backward of the engine's forward below reaches this one through the cache.
    out = getattr(model, "module", model)(
        input_ids=inputs["prompt_ids"], attention_mask=inputs["prompt_mask"], position_ids=inputs["prompt_positions"],
        use_cache=True, **({"logits_to_keep": 1} if keep else {}),
    )  # fmt: skip
    first = out.logits[group, -1:, :]
    if R <= 1:
        return first[:, :R]
    cache = out.past_key_values
    cache.batch_select_indices(group)  # indexing, not a copy-in: the backward sums each sample's share into the prompt
    width = inputs["prompt_ids"].shape[1] + R - 1
    rest = model(
        input_ids=inputs["input_ids"][:, : R - 1], attention_mask=inputs["attention_mask"][:, :width],
        position_ids=inputs["position_ids"][:, : R - 1], past_key_values=cache, use_cache=True,
    ).logits  # fmt: skip
    return torch.cat([first, rest], dim=1)


def sum_pi_squared_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """``sum_v pi_v^2`` per position, as verl's ``calculate_sum_pi_squared_from_logits``: computed in log space,
    ``exp(logsumexp(2 z) - 2 logsumexp(z))``, from the temperature-scaled logits the log-probs come from."""
    return torch.exp(torch.logsumexp(2 * logits, dim=-1) - 2 * torch.logsumexp(logits, dim=-1))


def response_log_probs(
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    temperature: float,
    with_entropy: bool = False,
    with_sum_pi_squared: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the response tokens under ``model`` at ``temperature`` (as the sampler saw them), and
    per token the entropy (``with_entropy``) or the sum of pi^2 over the vocabulary (``with_sum_pi_squared``).
    ``entropy_grad=False`` gives the entropy as a metric only, outside the autograd graph."""
    if with_entropy and with_sum_pi_squared:
        raise ValueError("response_log_probs gives one per-token statistic: the entropy or the sum of pi^2")
    logits = response_logits(model, inputs).float()
    if temperature > 0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    if "targets" in inputs:  # packed or shared prompts
        targets = inputs["targets"]
    else:
        P, R = inputs["prompt_width"], inputs["response_width"]
        targets = inputs["input_ids"][:, P : P + R]
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if with_sum_pi_squared:
        return logp, sum_pi_squared_from_logits(logits)
    entropy = None
    if with_entropy:
        # without a gradient the [tokens, vocabulary] terms are not kept for, nor walked by, the backward pass
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


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
@dataclass(frozen=True)
class AggNorm:
    """The denominators ``agg_loss`` uses when the whole (global) mini-batch is one batch.

    ``dp_size``: data-parallel ranks whose gradients are AVERAGED; every rank holds the whole batch, so the
    global counts are its own to compute, and each rank's weights are multiplied by ``dp_size`` so that the
    average equals the single-process sum (verl's global token count times dp size).
    """

    tokens: float  # sum of the response mask
    seqs: float  # rows with at least one mask token
    width: int  # the padded response width (longest response)
    rows: float = 0.0  # all rows, empty ones included (the "row-mean" of geo_mean)
    dp_size: int = 1  # ranks sharing the mini-batch; their gradients are averaged


def agg_norm(masks: Sequence[Sequence[float]], dp_size: int = 1) -> AggNorm:
    sums = [float(sum(m)) for m in masks]
    return AggNorm(
        tokens=sum(sums),
        seqs=float(sum(s > 0 for s in sums)),
        width=max((len(m) for m in masks), default=0),
        rows=float(len(masks)),
        dp_size=dp_size,
    )


def _safe(d: float) -> float:
    # agg_loss divides an empty mini-batch by 1 (algorithms._safe_den): the same here.
    return d if d > 0 else 1.0


def micro_weight(mode: str, mask: torch.Tensor, norm: AggNorm) -> float:
    """Factor turning ``agg_loss(L, mask, mode)`` of a micro-batch into its share of the mini-batch's.

    Summed over the micro-batches of a mini-batch, ``weight * agg_loss(micro)`` equals ``agg_loss`` of the
    mini-batch as one batch (``seq-mean-token-sum-norm``'s default divisor, the padded width, included);
    with a global ``norm`` of ``dp_size`` ranks the weight carries verl's ``* dp_size``, so the ranks'
    AVERAGED gradients equal that of the whole mini-batch. ``row-mean`` is a plain mean over all rows.
    The ``token-mean`` weights (a micro-batch's share of the policy tokens) also weight token-mean metrics.
    """
    # A micro-batch without policy tokens has loss 0 (agg_loss divides 0 by 1): its weight 0 is harmless.
    if mode == "token-mean":
        weight = float(mask.sum()) / _safe(norm.tokens)
    elif mode == "token-sum":
        weight = 1.0
    elif mode == "row-mean":
        weight = mask.shape[0] / _safe(norm.rows)
    else:
        weight = float((mask.sum(dim=-1) > 0).sum()) / _safe(norm.seqs)
        if mode == "seq-mean-token-sum-norm":
            weight *= mask.shape[-1] / max(1, norm.width)
        elif mode not in ("seq-mean-token-sum", "seq-mean-token-mean"):
            raise ValueError(f"unknown loss_agg_mode {mode!r}")
    return weight * norm.dp_size


@dataclass(frozen=True)
class MicroBatch:
    """One forward/backward: the sample ids and how its loss enters the mini-batch gradient.

    Fixed-count mode (``norm`` None): the loss is scaled by ``scale = len(idx) / mini_len``, verl's scaling.
    Exact mode (a token budget, data parallelism, or ``token-sum``): each loss term is weighted with
    ``micro_weight`` against ``norm`` (``scale`` is 1) and the metrics come back weighted, to be summed
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
        # token-sum has no fixed-count form (verl's len(micro) / len(mini) scaling would divide the sum).
        if cfg.micro_batch_tokens is None and cfg.loss_agg_mode != "token-sum":
            return [MicroBatch(idx, len(local), None) for idx in self._plan(batch, local)]  # as many on every rank
        norm = agg_norm([batch["response_mask"][i] for i in mini], self.dp_size)
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
