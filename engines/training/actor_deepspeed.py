"""The DeepSpeed train engine: TorchActor's math (same loss code, same schedule) on ``deepspeed.initialize``.

``DeepSpeedActor`` subclasses ``TorchActor`` and reuses its ``_micro_step`` (the policy loss, entropy and KL
terms) and ``compute_log_probs``; the forward (ZeRO-3 parameter gathering), gradient reduction, clipping and
optimizer step go through the DeepSpeed engine, and ZeRO 0-3 give the same parameters as the torch loop.
Optimizer: torch's AdamW handed to DeepSpeed (FusedAdam and CPUAdam would JIT-build C++ ops for minutes).
Precision: fp32 on CPU (a bf16 model is cast to fp32 in place); bf16 only on CUDA with a bf16 model.

Gradient accumulation: DeepSpeed runs with ``managed_gradient_accumulation: false`` and
``gradient_accumulation_steps: 1``, so it neither divides the loss nor picks the step boundary itself: each
micro-batch loss is scaled by ``len(micro) / len(mini)`` exactly as in ``TorchActor`` (ragged last
micro-batches included) and every ``engine.step()`` is one optimizer step with DeepSpeed's gradient clipping
(``cfg.optim.grad_clip``) applied to the accumulated, data-parallel-averaged gradient. With
``micro_batch_tokens`` the token-budget micro-batches and their exact loss weights are
``TorchActor``'s too (``engines.training.batching``); so are ``packing`` and the mini-batch loop.

Data parallelism (``WORLD_SIZE > 1``): every rank receives the WHOLE batch and draws the same shuffle;
``cfg.ppo_mini_batch_size`` stays the GLOBAL number of samples per optimizer step and rank ``r`` trains the
``r``-th contiguous slice of each global mini-batch (``MiniBatchTrainer._rank_slice``). DeepSpeed AVERAGES the
gradients over ranks, so each rank's loss weights are multiplied by the world size: fixed-count micro-batches
are scaled by ``len(micro) / len(local mini)`` (times N, divided by N by the average: ``len(micro) / len(global
mini)``), token-budget micro-batches by their share of the GLOBAL mini-batch's tokens or sequences times N
(``engines.training.batching.AggNorm.dp_size``, verl's global-batch normalisation). N ranks then take the step one
process takes on the whole batch. Every rank runs as many micro-batches as its busiest peer (ZeRO 2-3
backwards are collectives: ``MiniBatchTrainer._micro_batches``). Returned metrics are averaged over ranks;
``actor/grad_norm`` is the global norm. Every rank must receive the same batch (its size is checked;
otherwise collectives would hang).
"""

from __future__ import annotations

import copy
import os
from contextlib import nullcontext

import torch

from rlstage.engines.training.actor import TorchActor, check_equal_shards, rank_mean
from rlstage.engines.training.batching import adamw, lr_lambda, trainable_parameters
from rlstage.engines.training.checkpoint import register_type
from rlstage.engines.training.forward import check_packing_supported
from rlstage.infra.env import free_port
from rlstage.schemas.config import ActorConfig


def _register_state_types() -> None:
    """The non-tensor objects in a ZeRO optimizer state, stored by value (engines.training.checkpoint)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    register_type("deepspeed.ZeroStageEnum", ZeroStageEnum, int, ZeroStageEnum)
    register_type("deepspeed.fragment_address", fragment_address, lambda f: [f.numel, f.start], lambda v: fragment_address(*v))
    register_type("deepspeed.LossScaler", LossScaler, lambda s: float(s.cur_scale), LossScaler)


_register_state_types()

# The port this module picked for a single-process group; a later group after a teardown gets a fresh one.
_OWN_MASTER_PORT: str | None = None


def ensure_dist_env() -> None:
    """Fill in the torch.distributed env for a single process, so DeepSpeed never falls back to MPI discovery.

    Variables already set (by a launcher, or by the caller for a multi-process group) are kept.
    """
    global _OWN_MASTER_PORT
    if torch.distributed.is_initialized():
        return
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    port = os.environ.get("MASTER_PORT")
    if port is None or port == _OWN_MASTER_PORT:
        if os.environ["WORLD_SIZE"] != "1":
            raise RuntimeError(
                "MASTER_PORT must be set when WORLD_SIZE > 1 (every rank must use the same port)"
            )
        # A fresh port per group: the previous group's store may still hold the old one in TIME_WAIT.
        _OWN_MASTER_PORT = os.environ["MASTER_PORT"] = str(free_port())


def disable_shm_comm_build() -> None:
    """Keep DeepSpeed from JIT-compiling its ``deepspeed_shm_comm`` op (~110 s cold on 2 cores).

    In 0.19.8 ``deepspeed.comm.torch.build_shm_op`` builds the op whenever
    ``deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"]`` is true; there is no env var or config key for
    it. The op only accelerates inference all-reduce, so marking it incompatible (the dict is probed once and
    cached in the module, edits persist) makes training use plain gloo/NCCL collectives.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def _detached_copy(obj: object) -> object:
    """Deep copy with detached tensors: ZeRO state dicts hold live buffers and non-leaf views."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return type(obj)((k, _detached_copy(v)) for k, v in obj.items())
    if isinstance(obj, list | tuple):
        return type(obj)(_detached_copy(v) for v in obj)
    return copy.deepcopy(obj)


def check_zero_stage(stage: object) -> int:
    # ActorConfig validates the range, but model_construct() or a hand-made config can bypass it.
    if not isinstance(stage, int) or isinstance(stage, bool) or not 0 <= stage <= 3:
        raise ValueError(f"actor.zero_stage must be 0, 1, 2 or 3, got {stage!r}")
    return stage


def build_ds_config(cfg: ActorConfig, bf16: bool) -> dict:
    """The DeepSpeed config equivalent to ``cfg``'s TorchActor update (see the module docstring)."""
    stage = check_zero_stage(cfg.zero_stage)
    zero: dict = {"stage": stage}
    if stage > 0:
        # No CUDA streams on CPU to overlap with; plain ordered reductions are simpler and deterministic.
        zero["overlap_comm"] = False
    if stage == 3:
        # Without this, ZeRO-3 keeps every parameter smaller than 1e5 elements whole: nothing gets sharded.
        zero["stage3_param_persistence_threshold"] = 0
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": 1,
        # The actor owns the step boundary (ragged mini-batches have a varying number of micro-batches).
        "managed_gradient_accumulation": False,
        "gradient_clipping": cfg.optim.grad_clip,
        "zero_optimization": zero,
        # torch.optim.AdamW is not on DeepSpeed's list of ZeRO-tested optimizers; it is elementwise, so fine.
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": bf16},
        "fp16": {"enabled": False},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


class DeepSpeedActor(TorchActor):
    """``TorchActor``'s interface and math on a DeepSpeed engine (ZeRO stage ``cfg.zero_stage``).

    ``self.model`` is what the forward pass goes through: the engine when it supports ``loss.backward()``
    (ZeRO 1-3, bf16), else the bare module (fp32 ZeRO-0, where the engine only refuses direct backward; the
    gradients then simply accumulate on the parameters and ``engine.step()`` reduces, clips and steps them).
    With ZeRO-3 the parameters of the model passed in are partitioned: use ``export_model()`` for weights.
    """

    def __init__(self, model: torch.nn.Module, cfg: ActorConfig, pad_id: int, total_steps: int) -> None:
        check_zero_stage(cfg.zero_stage)
        ensure_dist_env()
        disable_shm_comm_build()
        import deepspeed

        world_size = int(os.environ["WORLD_SIZE"])
        if cfg.ppo_mini_batch_size % world_size:
            raise ValueError(
                f"actor.ppo_mini_batch_size={cfg.ppo_mini_batch_size} must be divisible by the data-parallel "
                f"world size {world_size}"
            )
        if cfg.packing:
            check_packing_supported(model)
        bf16 = torch.cuda.is_available() and next(model.parameters()).dtype == torch.bfloat16
        if not bf16:
            # fp16 is refused on CPU and bf16 is only used on CUDA: train in fp32 (a no-op for fp32 models).
            model.float()
        ds_config = build_ds_config(cfg, bf16)
        self.cfg = cfg
        self.pad_id = pad_id
        self.world_size = world_size
        self.dp_size = world_size
        self.dp_rank = int(os.environ["RANK"])
        o = cfg.optim
        optimizer = adamw(trainable_parameters(model), o)
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        # The schedule stays ours (as in TorchActor it advances even when a step is skipped); ZeRO keeps the
        # base optimizer's param_group dicts, so the lr it writes there is the lr the step uses.
        base = getattr(self.engine.optimizer, "optimizer", self.engine.optimizer)
        self.optimizer = self.engine.optimizer
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(base, lr_lambda(o, o.total_steps or total_steps))
        self._z0_grad_norm: float | None = None
        if not self._uses_zero_optimizer():
            # fp32 ZeRO-0: the engine clips with its own helper and drops the norm; clip as TorchActor does.
            self.engine.clip_fp32_gradients = self._clip_fp32_gradients
        direct_backward = getattr(self.engine, "_support_torch_style_backward", False)
        if self._uses_zero_optimizer() and not direct_backward:
            raise RuntimeError(
                "this DeepSpeed/torch pair does not support loss.backward() through the engine"
            )
        self.model = self.engine if direct_backward else self.engine.module

    def _uses_zero_optimizer(self) -> bool:
        from deepspeed.runtime.base_optimizer import ZeROOptimizer

        return isinstance(self.engine.optimizer, ZeROOptimizer)

    def _clip_fp32_gradients(self) -> None:
        # Called by engine.step() after the data-parallel all-reduce, i.e. on the averaged gradients.
        params = self.engine.module.parameters()
        self._z0_grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.cfg.optim.grad_clip))

    def _optimizer_step(self) -> float:
        """Reduce (data parallel), clip and step through the engine; the pre-clip global gradient norm."""
        self._z0_grad_norm = None
        self.engine.step()
        norm = self._z0_grad_norm if self._z0_grad_norm is not None else self.engine.get_global_grad_norm()
        return float("nan") if norm is None else float(norm)

    # The loop is MiniBatchTrainer's: these two hooks put the engine in it.
    def _zero_grad(self) -> None:
        pass  # engine.step() zeroes the gradients after each step

    def update(self, batch: dict[str, list], temperature: float, seed: int) -> dict[str, float]:
        """PPO epochs over shuffled global mini-batches (this rank trains its slice); one ``engine.step()`` each.

        Same batch layout and metrics as ``TorchActor.update``; with several ranks, metrics are rank means.
        TorchActor's ``_micro_step`` calls ``.backward()``, which goes through the engine's hooks (see class doc).
        """
        check_equal_shards(batch, self.world_size, self.engine.device)
        return rank_mean(super().update(batch, temperature, seed), self.world_size, self.engine.device)

    def state_dict(self, live: bool = False) -> dict:
        """Optimizer (this rank's ZeRO partition and fp32 master weights) and scheduler state, as copies.

        ``live``: ZeRO's own buffers, for a caller that writes them out before the next step (a checkpoint
        being staged): no second copy of this rank's whole optimizer partition in memory.
        """
        # A copy by default: ZeRO's dict references live buffers (ZeRO-3's fp32 flat groups) that later steps change.
        optimizer = self.engine.optimizer.state_dict()
        return {
            "optimizer": optimizer if live else _detached_copy(optimizer),
            "scheduler": self.scheduler.state_dict(),
            "zero_stage": self.cfg.zero_stage,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()`` output from an actor with the same ZeRO stage and world size."""
        saved = (state.get("zero_stage"), state.get("world_size"))
        if saved != (self.cfg.zero_stage, self.world_size):
            raise ValueError(
                f"actor state was saved with (zero_stage, world_size)={saved}, this actor runs "
                f"{(self.cfg.zero_stage, self.world_size)}"
            )
        opt = _detached_copy(state["optimizer"])  # loading aliases some saved tensors into live buffers
        if self._uses_zero_optimizer():
            # ZeRO reads entry [dp_rank] of a per-rank list; the saved fp32 master weights are restored as-is.
            self.engine.optimizer.load_state_dict(
                state_dict_list=[opt] * self.world_size,
                load_optimizer_states=True,
                load_from_fp32_weights=True,
            )
        else:
            self.engine.optimizer.load_state_dict(opt)
        self.scheduler.load_state_dict(state["scheduler"])

    def export_model(self) -> dict[str, torch.Tensor]:
        """The full model state dict (CPU copies) for ``model.save_pretrained(dir, state_dict=...)``.

        ZeRO-3 parameters are gathered first (a collective: call it on every rank). Tied weights stay one
        tensor under both names, as in the module.
        """
        import deepspeed

        module = self.engine.module
        gather = (
            deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)
            if self.cfg.zero_stage == 3
            else nullcontext()
        )
        out: dict[str, torch.Tensor] = {}
        copies: dict[int, torch.Tensor] = {}
        with gather, torch.no_grad():
            for name, t in module.state_dict(keep_vars=True).items():
                if id(t) not in copies:
                    copies[id(t)] = t.detach().to("cpu", copy=True)
                out[name] = copies[id(t)]
        return out

    @property
    def trained_module(self) -> torch.nn.Module:
        return self.engine.module

    def gather_into(self, target: torch.nn.Module | None) -> None:
        """ZeRO-3: gather the trained parameters (a collective: call it on every rank) and copy them straight into
        ``target``'s tensors of the same names (no CPU copy of the whole model in between); ``None`` (a rank that
        keeps no whole copy) only takes part in the gather. ZeRO 0-2 keep whole parameters: nothing to gather."""
        import deepspeed

        if self.cfg.zero_stage != 3:
            return
        module = self.engine.module
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None), torch.no_grad():
            if target is None:
                return
            into = target.state_dict(keep_vars=True)
            for name, t in module.state_dict(keep_vars=True).items():
                into[name].copy_(t)

    def close(self) -> None:
        """Release the engine; the process group stays (``deepspeed.comm.destroy_process_group()`` ends it)"""
        self.engine.destroy()
