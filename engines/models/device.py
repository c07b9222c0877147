"""Where a model's weights are: what the trainers and the rollout engines both ask of a model they hold."""

from __future__ import annotations

import torch


def model_device(model: torch.nn.Module) -> torch.device:
    """Where a model's weights are (its inputs are built on the CPU and moved there)."""
    first = next(model.parameters(), None)
    return torch.device("cpu") if first is None else first.device
