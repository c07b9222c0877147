"""Turning ragged token lists into model inputs (prompts left-padded, responses right-padded)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


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


def response_log_probs(
    model: torch.nn.Module, inputs: dict[str, torch.Tensor], temperature: float, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the response tokens under ``model`` at ``temperature`` (as the sampler saw them)."""
    P, R = inputs["prompt_width"], inputs["response_width"]
    out = model(
        input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], position_ids=inputs["position_ids"]
    )
    logits = out.logits[:, P - 1 : P + R - 1, :].float()
    if temperature > 0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    targets = inputs["input_ids"][:, P : P + R]
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy
