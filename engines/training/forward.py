"""Turning ragged token lists into model inputs, and the response log-probs, logits and values of a forward.

Two input layouts, chosen by ``packing`` in the actor / critic config:

- padded (default): prompts left-padded to P, responses right-padded to R, one row per sequence;
- packed: the micro-batch's sequences concatenated into ONE row with no padding, position ids restarting
  at 0 for each sequence and ``attention_mask=None``. Hugging Face models (transformers >= 4.53) read the
  position-id restarts as sequence boundaries and build a block-diagonal causal mask (sdpa, eager, flex),
  or run varlen flash-attention, so no token attends across sequences. Checked here for sdpa and eager
  on CPU: the log-probs equal the padded ones within 1e-6 (``tests/engines/training/test_batching.py``). ``use_cache=False``
  is required: with a cache object the model skips the packed-sequence detection.

- shared prompts (``actor.share_prompts``, padded): the samples of one prompt in a micro-batch share one forward
  of that prompt; its key/value cache is indexed out to every sample and the responses run on it (GRPO's n
  samples per prompt otherwise repeat the prompt's forward and backward n times). The backward reaches the
  prompt through the cache, so the gradient is the padded layout's up to float rounding (``tests/engines/training/test_batching.py``).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Sequence

import torch

from rlstage.engines.training.lm_head import chunked_token_stats, hidden_states_as_logits, plain_output_layer

# Attention implementations that honour packed position ids (the mask builders of transformers'
# masking_utils, or flash-attention's varlen path). Only sdpa and eager are exercised on CPU here.
PACKING_ATTENTION = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")
# No-grad passes keep no activations: padded chunks may be this many times larger than a training micro-batch.
# Packed rows are not enlarged: on sdpa/eager a packed row's attention costs row_length squared.
NO_GRAD_SCALE = 4


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


def response_targets(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[B, R]`` response token ids, aligned with ``response_logits``' rows and columns."""
    if "targets" in inputs:  # packed or shared prompts
        return inputs["targets"]
    P, R = inputs["prompt_width"], inputs["response_width"]
    return inputs["input_ids"][:, P : P + R]


@functools.cache
def _plain_because(why: str) -> None:
    logging.getLogger("rlstage").warning("rlstage: log-probs from the whole vocabulary's logits at once: %s", why)


def response_log_probs(
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    temperature: float,
    with_entropy: bool = False,
    with_sum_pi_squared: bool = False,
    entropy_grad: bool = True,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the response tokens under ``model`` at ``temperature`` (as the sampler saw them), and
    per token the entropy (``with_entropy``) or the sum of pi^2 over the vocabulary (``with_sum_pi_squared``).
    ``entropy_grad=False`` gives the entropy as a metric only, outside the autograd graph. ``chunk_tokens``
    (``actor.logits_chunk_tokens``): over more response positions than that, the output layer runs that many at a
    time (``lm_head.py``; one chunk would hold what the whole micro-batch's logits hold)."""
    if with_entropy and with_sum_pi_squared:
        raise ValueError("response_log_probs gives one per-token statistic: the entropy or the sum of pi^2")
    targets = response_targets(inputs)
    if chunk_tokens is not None and targets.numel() > chunk_tokens:
        head, why = plain_output_layer(model)
        if head is not None:
            with hidden_states_as_logits(head):
                hidden = response_logits(model, inputs)
            logp, entropy, spi2 = chunked_token_stats(
                hidden, head, targets, temperature, chunk_tokens, with_entropy, with_sum_pi_squared
            )
            if with_sum_pi_squared:
                return logp, spi2
            if entropy is not None and not (entropy_grad and torch.is_grad_enabled()):
                entropy = entropy.detach()
            return logp, entropy
        _plain_because(why)
    logits = response_logits(model, inputs).float()
    if temperature > 0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if with_sum_pi_squared:
        return logp, sum_pi_squared_from_logits(logits)
    entropy = None
    if with_entropy:
        # without a gradient the [tokens, vocabulary] terms are not kept for, nor walked by, the backward pass
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy
