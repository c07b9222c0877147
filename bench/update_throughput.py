"""Policy-update throughput on a ragged batch: raw torch loop vs TorchActor vs DeepSpeedActor ZeRO-2 / ZeRO-3.

Prints one JSON line per (model, variant). ``tokens_per_s`` counts the real (unpadded) prompt + response
tokens that go through forward and backward in one ``update`` call (times ``ppo_epochs``), divided by the
median wall time of ``--repeats`` timed updates after one warm-up update. DeepSpeed's engine set-up is
reported separately as ``init_s``. Models: the tiny kit Llama, a ~20M-parameter random-init Llama and
``smollm2``, the real SmolLM2-135M-Instruct (``python -m rlstage.infra.models smollm2`` fetches it) on a batch shaped
like its GSM8K rollouts (prompts of 100-200 tokens, responses of 32-256).

Batching section (``--batching``, on by default): TorchActor on a second ragged batch whose sequence lengths
spread uniformly over 10-100 % of ``--max-len`` (a quarter prompt, the rest response), comparing padded vs
packed micro-batches, each by fixed count (8 samples) and by token budget (8 x max-len tokens, the padded
worst case). ``processed_tokens`` counts what the forward passes really process (padding included) per
update; ``tokens_per_s`` still counts real tokens only.

    .venv/bin/python bench/update_throughput.py            # both models, < 3 min on 2 cores
    .venv/bin/python bench/update_throughput.py --models tiny --repeats 10
    .venv/bin/python bench/update_throughput.py --variants none   # the batching section only
    .venv/bin/python bench/update_throughput.py --models smollm2 --variants raw_torch,torch_actor,deepspeed_zero2 --batching none
    .venv/bin/python bench/update_throughput.py --models smollm2 --variants torch_actor,torch_actor_shared --per-prompt 4 --batching none

``torch_actor_shared`` is the torch engine with ``actor.share_prompts`` (a prompt's forward shared by its samples
in a micro-batch): with ``--per-prompt`` > 1 its ``tokens_per_s`` still counts every sample's prompt tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from rlstage.engines import algorithms as algos
from rlstage.engines.models.device import model_device
from rlstage.engines.models.tinykit import build_char_tokenizer, build_tiny_llama
from rlstage.engines.training.actor import TorchActor
from rlstage.engines.training.batching import micro_batch_cost
from rlstage.engines.training.forward import build_inputs, pad_right, response_log_probs, to_device
from rlstage.schemas.config import ActorConfig, KitConfig, OptimConfig

# name -> (model kwargs, samples in the batch, torch threads, timed updates per variant)
MODELS: dict[str, tuple[dict, int, int, int]] = {
    # One thread: two threads on two cores were 5-10x slower and noisy for tiny models (shared notes).
    "tiny": (dict(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), 64, 1, 5),
    # ~20M parameters (hidden 512 x 6 layers); large enough for two threads to pay off. Three timed updates
    # keep the whole run under 3 minutes on 2 cores.
    "20m": (dict(hidden_size=512, num_layers=6, num_heads=8, intermediate_size=1376), 32, 2, 3),
    # The real model: 16 samples (the GSM8K config's iteration is two such mini-batches), two threads.
    "smollm2": ({}, 16, 2, 2),
}
REAL_MODELS = {"smollm2"}  # fetched by infra.models, with their own tokenizer
# name -> (prompt length range, response length range) of the timed batch; the default is the tiny task's.
BATCH_SHAPES = {"smollm2": ((100, 200), (32, 256))}
DEFAULT_SHAPE = ((8, 24), (1, 32))


def real_path(name: str) -> str:
    from rlstage.infra.models import fetch_model

    return str(fetch_model(name))


def build_model(name: str, tok) -> torch.nn.Module:
    kw = MODELS[name][0]
    if name in REAL_MODELS:
        return AutoModelForCausalLM.from_pretrained(real_path(name), torch_dtype=torch.float32)
    if name == "tiny":
        return build_tiny_llama(KitConfig(**kw), tok)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=kw["hidden_size"],
        intermediate_size=kw["intermediate_size"],
        num_hidden_layers=kw["num_layers"],
        num_attention_heads=kw["num_heads"],
        num_key_value_heads=kw["num_heads"],
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
    )
    return LlamaForCausalLM(config)


def _add_sample(batch: dict[str, list], rng: random.Random, p: list[int], r: list[int]) -> None:
    adv = rng.gauss(0.0, 1.0)
    batch["prompt_ids"].append(p)
    batch["response_ids"].append(r)
    batch["response_mask"].append([1] * len(r))
    batch["old_log_probs"].append([-4.6 + rng.uniform(-0.2, 0.2) for _ in r])
    batch["advantages"].append([adv] * len(r))


def _empty_batch() -> dict[str, list]:
    return {k: [] for k in ("prompt_ids", "response_ids", "response_mask", "old_log_probs", "advantages")}


def ragged_batch(tok, n: int, shape=DEFAULT_SHAPE, seed: int = 0, per_prompt: int = 1) -> dict[str, list]:
    """Prompt and response lengths uniform over ``shape``'s ranges (8-24 and 1-32 tokens: the tiny task's
    GRPO rollouts), random token ids; ``per_prompt`` consecutive samples share a prompt (a GRPO group)."""
    rng = random.Random(seed)
    vocab = len(tok)
    batch = _empty_batch()
    (p_lo, p_hi), (r_lo, r_hi) = shape
    for i in range(n):
        if i % per_prompt == 0:
            p = [rng.randrange(4, vocab) for _ in range(rng.randint(p_lo, p_hi))]
        r = [rng.randrange(4, vocab) for _ in range(rng.randint(r_lo, r_hi))]
        _add_sample(batch, rng, p, r)
    return batch


def ragged_by_length(tok, n: int, max_len: int, seed: int = 1) -> dict[str, list]:
    """Sequence lengths uniform over 10-100 % of ``max_len``: a quarter prompt, the rest response."""
    rng = random.Random(seed)
    vocab = len(tok)
    batch = _empty_batch()
    for _ in range(n):
        total = rng.randint(max(2, max_len // 10), max_len)
        p = [rng.randrange(4, vocab) for _ in range(max(1, total // 4))]
        r = [rng.randrange(4, vocab) for _ in range(total - len(p))]
        _add_sample(batch, rng, p, r)
    return batch


# variant -> ActorConfig overrides; budget 8 x max_len: the same worst-case forward size as 8 padded rows.
BATCHING = {
    "padded_count": lambda max_len: {},
    "padded_tokens": lambda max_len: {"micro_batch_tokens": 8 * max_len},
    "packed_count": lambda max_len: {"packing": True},
    "packed_tokens": lambda max_len: {"packing": True, "micro_batch_tokens": 8 * max_len},
}


def processed_tokens(actor: TorchActor, batch: dict) -> tuple[int, int]:
    """Tokens the training forwards process in one epoch (padding included) and the number of micro-batches."""
    total = micro = 0
    n = len(batch["prompt_ids"])
    for m in range(0, n, actor.cfg.ppo_mini_batch_size):
        for mb in actor._micro_batches(batch, list(range(m, min(n, m + actor.cfg.ppo_mini_batch_size)))):
            total += micro_batch_cost(
                [len(batch["prompt_ids"][i]) for i in mb.idx], [len(batch["response_ids"][i]) for i in mb.idx],
                actor.cfg.packing,
            )
            micro += 1
    return total, micro


def run_batching_variant(
    name: str, variant: str, tok, weights: dict, batch: dict, cfg: ActorConfig, max_len: int, repeats: int
) -> dict:
    model = build_model(name, tok)
    model.load_state_dict(weights)
    cfg = cfg.model_copy(update=BATCHING[variant](max_len))
    actor = TorchActor(model, cfg, tok.pad_token_id, 1000)
    actor.update(batch, 1.0, 0)  # warm-up
    times = []
    for r in range(repeats):
        t = time.perf_counter()
        actor.update(batch, 1.0, r + 1)
        times.append(time.perf_counter() - t)
    sec = statistics.median(times)
    tokens = real_tokens(batch, cfg.ppo_epochs)
    processed, micro = processed_tokens(actor, batch)
    return {
        "model": name,
        "section": "batching",
        "variant": variant,
        "threads": torch.get_num_threads(),
        "samples": len(batch["prompt_ids"]),
        "max_len": max_len,
        "tokens": tokens,
        "processed_tokens": processed * cfg.ppo_epochs,
        "micro_batches": micro * cfg.ppo_epochs,
        "update_s": round(sec, 4),
        "tokens_per_s": round(tokens / sec, 1),
    }


def raw_update(model: torch.nn.Module, cfg: ActorConfig, pad_id: int) -> Callable[[dict, float, int], dict]:
    """The floor: one fixed-order pass, vanilla clipped PPO loss, no metrics, no schedule."""
    o = cfg.optim
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
    loss_fn = algos.get_policy_loss("vanilla")

    def update(batch: dict, temperature: float, seed: int) -> dict:
        n = len(batch["prompt_ids"])
        device = model_device(model)
        model.train()
        for _epoch in range(cfg.ppo_epochs):
            for m in range(0, n, cfg.ppo_mini_batch_size):
                mini = list(range(m, min(n, m + cfg.ppo_mini_batch_size)))
                opt.zero_grad(set_to_none=True)
                for u in range(0, len(mini), cfg.micro_batch_size):
                    idx = mini[u : u + cfg.micro_batch_size]
                    inputs = build_inputs(
                        [batch["prompt_ids"][i] for i in idx], [batch["response_ids"][i] for i in idx], pad_id
                    )
                    inputs = to_device(inputs, device)
                    R = inputs["response_width"]
                    mask, old, adv = (
                        pad_right([batch[k][i] for i in idx], 0.0, torch.float32, R).to(device)
                        for k in ("response_mask", "old_log_probs", "advantages")
                    )
                    logp, _ = response_log_probs(model, inputs, temperature)
                    loss, _ = loss_fn(old, logp, adv, mask, cfg.loss_agg_mode)
                    (loss * len(idx) / len(mini)).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
                opt.step()
        model.eval()
        return {}

    return update


def real_tokens(batch: dict, epochs: int) -> int:
    return epochs * sum(
        len(p) + len(r) for p, r in zip(batch["prompt_ids"], batch["response_ids"], strict=True)
    )


def run_variant(
    name: str, variant: str, tok, weights: dict, batch: dict, cfg: ActorConfig, repeats: int
) -> dict:
    model = build_model(name, tok)
    model.load_state_dict(weights)
    t0 = time.perf_counter()
    actor = None
    if variant == "raw_torch":
        update = raw_update(model, cfg, tok.pad_token_id)
    elif variant in ("torch_actor", "torch_actor_shared"):
        actor = TorchActor(model, cfg.model_copy(update={"share_prompts": variant.endswith("shared")}), tok.pad_token_id, 1000)
        update = actor.update
    else:
        from rlstage.engines.training.actor_deepspeed import DeepSpeedActor

        stage = int(variant[-1])
        actor = DeepSpeedActor(
            model, cfg.model_copy(update={"engine": "deepspeed", "zero_stage": stage}), tok.pad_token_id, 1000
        )
        update = actor.update
    init_s = time.perf_counter() - t0
    update(batch, 1.0, 0)  # warm-up: allocator, first-call paths, ZeRO buckets
    times = []
    for r in range(repeats):
        t = time.perf_counter()
        update(batch, 1.0, r + 1)
        times.append(time.perf_counter() - t)
    if hasattr(actor, "close"):
        actor.close()
    sec = statistics.median(times)
    tokens = real_tokens(batch, cfg.ppo_epochs)
    return {
        "model": name,
        "variant": variant,
        "threads": torch.get_num_threads(),
        "samples": len(batch["prompt_ids"]),
        "tokens": tokens,
        "update_s": round(sec, 4),
        "tokens_per_s": round(tokens / sec, 1),
        "init_s": round(init_s, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,20m", help="comma-separated: " + ",".join(MODELS))
    ap.add_argument("--variants", default="raw_torch,torch_actor,deepspeed_zero2,deepspeed_zero3")
    ap.add_argument(
        "--repeats", type=int, default=None, help="timed updates per variant (default: per model)"
    )
    ap.add_argument("--batching", default=",".join(BATCHING), help="batching-section variants, or 'none'")
    ap.add_argument("--max-len", type=int, default=128, help="longest sequence of the batching section's batch")
    ap.add_argument("--per-prompt", type=int, default=1, help="samples per prompt in the timed batch (GRPO's group)")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Adam's second moments of tiny gradients decay into denormal floats: without flushing them, the 20m
    # model's updates slowed 4-20x from the second update on (x86), which measured the FPU, not the engines.
    torch.set_flush_denormal(True)
    import deepspeed

    deepspeed.utils.logger.setLevel("WARNING")  # keep stdout to the JSON lines (and DeepSpeed's warnings)
    char_tok = build_char_tokenizer()
    for name in args.models.split(","):
        _, n, threads, repeats = MODELS[name]
        torch.set_num_threads(threads)
        tok = AutoTokenizer.from_pretrained(real_path(name)) if name in REAL_MODELS else char_tok
        model = build_model(name, tok)
        n_params = sum(p.numel() for p in model.parameters())
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        del model
        batch = ragged_batch(tok, n, BATCH_SHAPES.get(name, DEFAULT_SHAPE), per_prompt=args.per_prompt)
        cfg = ActorConfig(
            ppo_mini_batch_size=16,
            micro_batch_size=8,
            ppo_epochs=1,
            shuffle=False,
            optim=OptimConfig(lr=1e-5),
        )
        for variant in [] if args.variants == "none" else args.variants.split(","):
            row = run_variant(name, variant, tok, weights, batch, cfg, args.repeats or repeats)
            print(json.dumps({"params": n_params, **row}), flush=True)
        ragged = ragged_by_length(tok, n, args.max_len)
        for variant in [] if args.batching == "none" else args.batching.split(","):
            row = run_batching_variant(
                name, variant, tok, weights, ragged, cfg, args.max_len, args.repeats or repeats
            )
            print(json.dumps({"params": n_params, **row}), flush=True)
    if torch.distributed.is_initialized():
        deepspeed.comm.destroy_process_group()


if __name__ == "__main__":
    main()
