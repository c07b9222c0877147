"""Response log-probs, entropy and sum of pi^2 from the last hidden states, a chunk of tokens at a time.

The plain path (``forward.response_log_probs`` over ``response_logits``) holds the output layer's logits for every
response token in fp32, their ``log_softmax`` and, for the entropy, ``p * log p``: several ``[tokens, vocabulary]``
tensors (SmolLM2's vocabulary is 49,152, Qwen2's 151,936), kept for the backward. Here the output layer runs on
``chunk`` tokens at a time; a chunk keeps only each token's target log-prob and entropy, and the backward computes
each chunk's logits again (as TRL's chunked LM head, prime-rl's and verl's fused paths do).
The forward gives the plain path's numbers up to float rounding, the backward the same gradients
(``tests/engines/training/test_lm_head.py``: 1e-6 on log-probs and entropy, 1e-5 relative on every gradient).

It applies where the output layer is a plain linear map (with or without bias, tied to the embeddings or not)
whose weight this process holds whole: not a final logit soft-cap, not an adapter on the output layer, not
ZeRO-3's partitioned weight (``plain_output_layer`` says why not, and the caller keeps the plain path).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F


def inner_model(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside DeepSpeed's engine (``.module``) and peft's wrapper (``get_base_model``)."""
    while hasattr(model, "module"):
        model = model.module
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model


def plain_output_layer(model: torch.nn.Module) -> tuple[torch.nn.Linear | None, str]:
    """The model's output layer when the chunked path can compute its logits, else None and why not."""
    inner = inner_model(model)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear:
        return None, f"its output layer is a {type(head).__name__}, not a plain linear map"
    config = getattr(inner, "config", None)
    if getattr(config, "final_logit_softcapping", None):
        return None, "it soft-caps its final logits"
    if hasattr(head.weight, "ds_id"):  # DeepSpeed ZeRO-3: this rank holds a partition of the weight
        return None, "ZeRO-3 partitions its output layer's weight"
    return head, ""


@contextmanager
def hidden_states_as_logits(head: torch.nn.Linear):
    """Within the block the model's output layer returns its input: the model's ``logits`` are the last hidden
    states of the positions it keeps (``logits_to_keep``), so every input layout's indexing stays as it is."""
    head.forward = lambda hidden: hidden  # an instance attribute over the class's forward
    try:
        yield
    finally:
        del head.forward


class _ChunkedTokenStats(torch.autograd.Function):
    """Per token: log-prob of its target, entropy (optional) and sum of pi^2 (optional, without a gradient) of
    ``softmax(linear(hidden) / temperature)``, ``chunk`` tokens at a time, the logits recomputed in the backward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk, with_entropy, with_sum_pi_squared):
        n = hidden.shape[0]
        logp = hidden.new_empty(n, dtype=torch.float32)
        entropy = torch.empty_like(logp) if with_entropy else None
        spi2 = torch.empty_like(logp) if with_sum_pi_squared else None
        for lo in range(0, n, chunk):
            hi = min(lo + chunk, n)
            z = _logits(hidden[lo:hi], weight, bias, temperature)
            log_p = torch.log_softmax(z, dim=-1)  # the plain path's formulas, row for row
            logp[lo:hi] = log_p.gather(-1, targets[lo:hi, None]).squeeze(-1)
            if entropy is not None:
                entropy[lo:hi] = -(log_p.exp() * log_p).sum(-1)
            if spi2 is not None:  # verl's calculate_sum_pi_squared_from_logits, in log space
                spi2[lo:hi] = torch.exp(torch.logsumexp(2 * z, dim=-1) - 2 * torch.logsumexp(z, dim=-1))
            del z, log_p
        ctx.save_for_backward(hidden, weight, bias, targets, entropy)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*[t for t in (spi2,) if t is not None])
        return logp, entropy, spi2

    @staticmethod
    def backward(ctx, g_logp, g_entropy, _g_spi2):
        hidden, weight, bias, targets, entropy = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        want_h, want_w, want_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]
        grad_h = torch.zeros_like(hidden) if want_h else None
        grad_w = torch.zeros_like(weight) if want_w else None
        grad_b = torch.zeros_like(bias) if want_b else None
        for lo in range(0, hidden.shape[0], chunk):
            hi = min(lo + chunk, hidden.shape[0])
            log_p = torch.log_softmax(_logits(hidden[lo:hi], weight, bias, t), dim=-1)
            p = torch.exp(log_p)
            gz = torch.zeros_like(log_p)
            if g_logp is not None:  # d logp_target / dz = onehot(target) - p
                g = g_logp[lo:hi, None]
                gz -= p * g
                gz.scatter_add_(-1, targets[lo:hi, None], g)
            if g_entropy is not None:  # d H / dz = -p (log p + H)
                gz -= p * (log_p + entropy[lo:hi, None]) * g_entropy[lo:hi, None]
            if t > 0:
                gz /= t
            gz = gz.to(hidden.dtype)  # the output layer's matmul runs in the model's dtype, as its autograd would
            if grad_h is not None:
                grad_h[lo:hi] = gz @ weight
            if grad_w is not None:
                grad_w += gz.T @ hidden[lo:hi]
            if grad_b is not None:
                grad_b += gz.sum(0)
        return grad_h, grad_w, grad_b, None, None, None, None, None


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float) -> torch.Tensor:
    z = F.linear(hidden, weight, bias).float()
    return z / temperature if temperature > 0 else z


def chunked_token_stats(
    hidden: torch.Tensor,
    head: torch.nn.Linear,
    targets: torch.Tensor,
    temperature: float,
    chunk: int,
    with_entropy: bool = False,
    with_sum_pi_squared: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``hidden`` ``[..., H]`` and ``targets`` ``[...]``: the log-prob of each target, and per token the entropy
    and the sum of pi^2, each shaped like ``targets``."""
    shape = targets.shape
    flat_h, flat_t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    logp, entropy, spi2 = _ChunkedTokenStats.apply(
        flat_h, head.weight, head.bias, flat_t, temperature, chunk, with_entropy, with_sum_pi_squared
    )
    return logp.view(shape), None if entropy is None else entropy.view(shape), None if spi2 is None else spi2.view(shape)
