"""The plain-torch value model engine: per-token values and the clipped value-loss update."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from engines import algorithms as algos
from engines.actor import lr_lambda
from engines.batching import build_inputs, pad_right
from schemas.config import CriticConfig


def response_values(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """V(s_t) for each response token: the value head at the position that predicts it (as verl)."""
    P, R = inputs["prompt_width"], inputs["response_width"]
    out = model(
        input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], position_ids=inputs["position_ids"]
    )
    return out.logits[:, P - 1 : P + R - 1, 0].float()


class TorchCritic:
    def __init__(self, model: torch.nn.Module, cfg: CriticConfig, pad_id: int, total_steps: int) -> None:
        self.model = model
        self.cfg = cfg
        self.pad_id = pad_id
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(o, o.total_steps or total_steps))

    @torch.no_grad()
    def compute_values(
        self, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]]
    ) -> list[list[float]]:
        self.model.eval()
        out: list[list[float]] = []
        mb = self.cfg.micro_batch_size * 4
        for s in range(0, len(prompt_ids), mb):
            inputs = build_inputs(prompt_ids[s : s + mb], response_ids[s : s + mb], self.pad_id)
            values = response_values(self.model, inputs)
            out += [values[row, : len(r)].tolist() for row, r in enumerate(response_ids[s : s + mb])]
        return out

    def update(self, batch: dict[str, list], seed: int) -> dict[str, float]:
        """Epochs over shuffled mini-batches of the clipped value loss against the returns."""
        cfg = self.cfg
        n = len(batch["prompt_ids"])
        gen = torch.Generator().manual_seed(seed)
        sums: dict[str, list[float]] = defaultdict(list)
        self.model.train()
        for _ in range(cfg.ppo_epochs):
            order = torch.randperm(n, generator=gen).tolist() if cfg.shuffle else list(range(n))
            for m in range(0, n, cfg.ppo_mini_batch_size):
                mini = order[m : m + cfg.ppo_mini_batch_size]
                self.optimizer.zero_grad(set_to_none=True)
                for u in range(0, len(mini), cfg.micro_batch_size):
                    idx = mini[u : u + cfg.micro_batch_size]
                    resp = [batch["response_ids"][i] for i in idx]
                    inputs = build_inputs([batch["prompt_ids"][i] for i in idx], resp, self.pad_id)
                    R = inputs["response_width"]
                    mask = pad_right([batch["response_mask"][i] for i in idx], 0, torch.float32, R)
                    old = pad_right([batch["values"][i] for i in idx], 0.0, torch.float32, R)
                    ret = pad_right([batch["returns"][i] for i in idx], 0.0, torch.float32, R)
                    vpreds = response_values(self.model, inputs)
                    loss, clipfrac = algos.compute_value_loss(
                        vpreds, ret, old, mask, cfg.cliprange_value, cfg.loss_agg_mode
                    )
                    (loss * len(idx) / len(mini)).backward()
                    sums["critic/vf_loss"].append(float(loss.detach()))
                    sums["critic/vf_clipfrac"].append(float(clipfrac))
                    sums["critic/vpred_mean"].append(float(algos.masked_mean(vpreds.detach(), mask)))
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optim.grad_clip)
                if torch.isfinite(grad_norm):
                    self.optimizer.step()
                sums["critic/grad_norm"].append(float(grad_norm))
                sums["critic/lr"].append(self.scheduler.get_last_lr()[0])
                self.scheduler.step()
        self.model.eval()
        return {k: float(sum(v) / len(v)) for k, v in sums.items()}

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
