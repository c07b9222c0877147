"""The plain-torch value model engine: per-token values and the clipped value-loss update."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlstage.engines import algorithms as algos
from rlstage.engines.training.batching import MicroBatch, MiniBatchTrainer, metric_weight
from rlstage.engines.training.forward import response_logits


def response_values(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """V(s_t) for each response token: the value head at the position that predicts it (as verl)."""
    return response_logits(model, inputs)[..., 0].float()


class TorchCritic(MiniBatchTrainer):
    metric_prefix = "critic"

    @torch.no_grad()
    def compute_values(
        self, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]]
    ) -> list[list[float]]:
        self.model.eval()
        out: list[list[float] | None] = [None] * len(prompt_ids)
        for ids, inputs in self._no_grad_chunks(prompt_ids, response_ids):
            values = response_values(self.model, inputs)
            for row, i in enumerate(ids):
                out[i] = values[row, : len(response_ids[i])].tolist()
        return out

    def update(self, batch: dict[str, list], seed: int) -> dict[str, float]:
        """Epochs over shuffled mini-batches of the clipped value loss against the returns."""
        return self._train_epochs(batch, seed, lambda micro: self._micro_step(batch, micro))

    def _micro_step(self, batch: dict[str, list], micro: MicroBatch) -> dict[str, float]:
        cfg = self.cfg
        inputs, (mask, old, ret) = self._micro_inputs(batch, micro.idx, "response_mask", "values", "returns", filler=micro.filler)
        vpreds = response_values(self.model, inputs)
        agg = micro.norm
        loss, clipfrac = algos.compute_value_loss(vpreds, ret, old, mask, cfg.cliprange_value, cfg.loss_agg_mode, agg)
        w_tok = 1.0
        if agg is None:
            (loss * len(micro.idx) / micro.mini_len).backward()  # verl's scaling, the expression as it always was
        else:
            # Token-budget mode: the loss is agg_loss over the mini-batch's global counts; metrics its token shares.
            loss.backward()
            w_tok = metric_weight(mask, agg)
        return {
            "critic/vf_loss": float(loss.detach()),
            "critic/vf_clipfrac": float(clipfrac) * w_tok,
            "critic/vpred_mean": float(algos.masked_mean(vpreds.detach(), mask)) * w_tok,
        }
