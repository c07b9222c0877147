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
    sequences = []
    for p, a in examples:
        p_ids = tokenizer(p, add_special_tokens=False)["input_ids"]
        a_ids = tokenizer(a, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        sequences.append((p_ids + a_ids, [0] * len(p_ids) + [1] * len(a_ids)))
    return sft_train_ids(
        model, tokenizer, sequences, steps=steps, batch_size=batch_size, lr=lr, seed=seed, should_stop=should_stop
    )


def sft_train_ids(
    model: torch.nn.Module,
    tokenizer,
    sequences: Sequence[tuple[list[int], list[int]]],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int = 0,
    should_stop: Callable[[int, float], bool] | None = None,
) -> list[float]:
    """AdamW on token sequences ``(ids, loss_mask)``: the loss is on positions whose mask is 1.

    Multi-turn demonstrations use the agent loop's mask, so tool output and template tokens are
    context, never targets — exactly the tokens RL later trains on.
    """
    rng = random.Random(seed)
    torch.manual_seed(seed)
    enc = list(sequences)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses: list[float] = []
    for step in range(steps):
        batch = rng.sample(enc, min(batch_size, len(enc)))
        width = max(len(s) for s, _m in batch)
        ids = torch.full((len(batch), width), tokenizer.pad_token_id, dtype=torch.long)
        labels = torch.full_like(ids, -100)
        attn = torch.zeros_like(ids)
        for i, (s, m) in enumerate(batch):
            row = torch.tensor(s)
            ids[i, : len(s)] = row
            attn[i, : len(s)] = 1
            labels[i, : len(s)] = torch.where(torch.tensor(m, dtype=torch.bool), row, torch.tensor(-100))
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if should_stop is not None and should_stop(step + 1, losses[-1]):
            break
    model.eval()
    return losses
