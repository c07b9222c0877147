"""Supervised warm start: teach the tiny model the answer format (loss on answer tokens only)."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch


def sft_train(
    model: torch.nn.Module,
    tokenizer,
    examples: Sequence[tuple[str, str]],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int = 0,
    should_stop: Callable[[int, float], bool] | None = None,
) -> list[float]:
    """AdamW on ``prompt + answer + eos`` with the prompt masked out of the loss.

    ``should_stop(step, loss)`` ends training early (e.g. once held-out accuracy reaches a target).
    """
    rng = random.Random(seed)
    torch.manual_seed(seed)
    enc = [
        (tokenizer(p, add_special_tokens=False)["input_ids"], tokenizer(a, add_special_tokens=False)["input_ids"])
        for p, a in examples
    ]
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses: list[float] = []
    for step in range(steps):
        batch = rng.sample(enc, min(batch_size, len(enc)))
        seqs = [p + a + [tokenizer.eos_token_id] for p, a in batch]
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
        labels = torch.full_like(ids, -100)
        attn = torch.zeros_like(ids)
        for i, ((p, _a), s) in enumerate(zip(batch, seqs, strict=True)):
            ids[i, : len(s)] = torch.tensor(s)
            attn[i, : len(s)] = 1
            labels[i, len(p) : len(s)] = torch.tensor(s[len(p) :])
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if should_stop is not None and should_stop(step + 1, losses[-1]):
            break
    model.eval()
    return losses
