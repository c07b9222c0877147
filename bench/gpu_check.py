"""The prepared GPU check (issue #39): the engines' correctness, speed and memory on one device, one JSON file.

    python bench/gpu_check.py --device cuda --out gpu_check.json     # an H100 / H200: ~3-5 minutes
    python bench/gpu_check.py --device cpu --tiny --out /tmp/g.json  # CI's smoke run (tests/integration/test_gpu_check.py)

Sections, each written to the JSON as soon as it ends (a run cut short keeps what it measured):
- ``peak``: a bf16 matrix product's TFLOP/s and a device-to-device copy's bytes/s, the ceilings below use.
- ``correctness``: the tiny kit's update and greedy rollout on the device in fp32 against the same on the CPU
  (log-probs, loss, gradient norm, weights after one optimizer step), and the bf16 path's log-prob gap to fp32.
- ``speed``: a random-init Qwen2-0.5B shape in bf16: the HF rollout engine's generate at batch 64 and 256
  (512 new tokens) and the torch actor's update, each against the raw loop on the same batch (HF ``generate``
  without the engine's bookkeeping; ``bench/update_throughput.raw_update``), tokens/s, MFU, peak memory against
  ``bench/memory_model.py``'s prediction.
- ``update_paths``: the update on the whole vocabulary's logits against the chunked path, at the 0.5B and 1.5B
  shapes, each at the largest micro-batch that fits: peak, tokens/s, MFU.
- ``weight_push``: the 0.5B shape's weights pushed in memory to a second process (whole, then a delta), timed.
- ``largest``: the most layers at Qwen2-0.5B's widths that one update fits on the card (from two measured
  depths, then tried).
What the device lacks (bf16, memory statistics, room for a shape) is skipped with its reason in ``skipped``.

The GPU machine has torch and transformers but not pydantic: ``bench/gpu_wheels.sh`` fetches the carried wheels.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_model import SHAPES, Shape, generate_peak_bytes, update_flops_per_token, update_peak_bytes  # noqa: E402
from source_tree import import_rlstage  # noqa: E402

import_rlstage()

from update_throughput import ragged_batch, raw_update  # noqa: E402

from rlstage.engines.models.tinykit import (  # noqa: E402
    SPECIAL_TOKENS,
    build_char_tokenizer,
    build_tiny_llama,
    word_level_tokenizer,
)
from rlstage.engines.rollout.hf import HFRolloutEngine, SamplingParams  # noqa: E402
from rlstage.engines.training.actor import TorchActor  # noqa: E402
from rlstage.schemas.config import ActorConfig, KitConfig  # noqa: E402

# Stated tolerances of the fp32 device run against the CPU (the same weights and batch).
TOLERANCE = {
    "log_prob_max_abs": 1e-4,
    "loss_rel": 1e-4,
    "grad_norm_rel": 1e-3,
    "weights_max_abs_over_lr": 0.05,
}
TINY_SHAPE = Shape("tiny-qwen2", 64, 2, 4, 2, 128, 512, True)


class Check:
    """The JSON report: sections as they end, and what was skipped and why."""

    def __init__(self, out: Path, budget_s: float, meta: dict) -> None:
        self.out, self.budget_s, self.t0 = out, budget_s, time.perf_counter()
        self.report = {"meta": meta, "sections": {}, "skipped": []}
        self.save()

    def skip(self, what: str, why: str) -> None:
        self.report["skipped"].append({"what": what, "why": why})
        print(f"gpu_check: skipped {what}: {why}", flush=True)
        self.save()

    def section(self, name: str, fn, *args) -> None:
        left = self.budget_s - (time.perf_counter() - self.t0)
        if left <= 0:
            return self.skip(name, f"the time budget of {self.budget_s:.0f} s was spent")
        t = time.perf_counter()
        try:
            result = fn(self, *args)
        except torch.OutOfMemoryError as e:
            return self.skip(name, f"out of device memory: {str(e).splitlines()[0]}")
        except Exception as e:  # one section's failure is a result too; the others still run
            return self.skip(name, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        finally:
            free_memory()
        result["seconds"] = round(time.perf_counter() - t, 2)
        self.report["sections"][name] = result
        print(f"gpu_check: {name} {json.dumps(result)}", flush=True)
        self.save()

    def save(self) -> None:
        self.report["meta"]["elapsed_s"] = round(time.perf_counter() - self.t0, 2)
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.report, indent=1))
        tmp.replace(self.out)


def free_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def timed(device: torch.device, fn, repeats: int, warm_up: bool = True) -> float:
    """The median seconds of ``repeats`` calls after one warm-up call."""
    if warm_up:
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# -- peak ---------------------------------------------------------------------------------------------------------


def peak(check: Check, device: torch.device, dtype: torch.dtype, tiny: bool) -> dict:
    n = 256 if tiny else 8192
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    sec = timed(device, lambda: a @ b, 3 if tiny else 10)
    big = torch.empty((1 << 22) if tiny else (1 << 30), dtype=torch.uint8, device=device)
    dst = torch.empty_like(big)
    copy = timed(device, lambda: dst.copy_(big), 3 if tiny else 10)
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "matmul_n": n,
        "matmul_tflops": round(2 * n**3 / sec / 1e12, 2),
        "copy_bytes_per_s": round(2 * big.numel() / copy, 0),  # read + written
    }


# -- correctness --------------------------------------------------------------------------------------------------


def tiny_update(
    device: torch.device, dtype: torch.dtype, batch: dict, cfg: ActorConfig, tok, actor_cls=TorchActor
) -> dict:
    torch.manual_seed(0)
    model = build_tiny_llama(KitConfig(), tok).to(device=device, dtype=dtype)
    before = {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}
    actor = actor_cls(model, cfg, tok.pad_token_id, 10)
    logp = actor.compute_log_probs(batch["prompt_ids"], batch["response_ids"], 1.0)
    metrics = actor.update({**batch, "old_log_probs": logp}, 1.0, seed=0)
    after = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    return {"log_probs": logp, "metrics": metrics, "before": before, "after": after}


def greedy_rollout(device: torch.device, tok, prompts: list[str]):
    torch.manual_seed(0)
    model = build_tiny_llama(KitConfig(), tok).to(device)
    return HFRolloutEngine(model, tok, batch_size=len(prompts)).generate(
        prompts, SamplingParams(temperature=0.0, max_new_tokens=16)
    )


def correctness(check: Check, device: torch.device, bf16: bool) -> dict:
    tok = build_char_tokenizer()
    batch = ragged_batch(tok, 32, seed=0)
    cfg = ActorConfig(ppo_mini_batch_size=32, micro_batch_size=8)
    cpu = tiny_update(torch.device("cpu"), torch.float32, batch, cfg, tok)
    dev = tiny_update(device, torch.float32, batch, cfg, tok)
    lp = max(
        abs(a - b)
        for r, s in zip(cpu["log_probs"], dev["log_probs"], strict=True)
        for a, b in zip(r, s, strict=True)
    )
    loss_c, loss_d = cpu["metrics"]["actor/pg_loss"], dev["metrics"]["actor/pg_loss"]
    gn_c, gn_d = cpu["metrics"]["actor/grad_norm"], dev["metrics"]["actor/grad_norm"]
    w = max(float((cpu["after"][k] - dev["after"][k]).abs().max()) for k in cpu["after"])
    moved = max(float((cpu["after"][k] - cpu["before"][k]).abs().max()) for k in cpu["after"])
    got = {
        "log_prob_max_abs": lp,
        "loss_rel": abs(loss_c - loss_d) / max(abs(loss_c), 1e-12),
        "grad_norm_rel": abs(gn_c - gn_d) / max(abs(gn_c), 1e-12),
        "weights_max_abs_over_lr": w / cfg.optim.lr,
    }
    prompts = [f"U:What is {i}+{3 * i + 7}?\nA:" for i in range(10, 26)]
    roll_c, roll_d = greedy_rollout(torch.device("cpu"), tok, prompts), greedy_rollout(device, tok, prompts)
    same = [a.response_ids == b.response_ids for a, b in zip(roll_c, roll_d, strict=True)]
    roll_gap = max(
        (
            abs(x - y)
            for a, b, s in zip(roll_c, roll_d, same, strict=True)
            if s
            for x, y in zip(a.log_probs, b.log_probs, strict=True)
        ),
        default=None,
    )
    out = {
        "fp32": {k: float(f"{v:.3g}") for k, v in got.items()},
        "tolerance": TOLERANCE,
        "passed": all(got[k] <= TOLERANCE[k] for k in TOLERANCE),
        "weights_moved_max_abs": moved,
        "rollout_greedy_same_share": sum(same) / len(same),
        "rollout_log_prob_max_abs": roll_gap,
    }
    if bf16:
        low = tiny_update(device, torch.bfloat16, batch, cfg, tok)
        gaps = [
            abs(a - b)
            for r, s in zip(dev["log_probs"], low["log_probs"], strict=True)
            for a, b in zip(r, s, strict=True)
        ]
        out["bf16"] = {
            "log_prob_gap_max": max(gaps),
            "log_prob_gap_mean": statistics.fmean(gaps),
            "update_loss_finite": math.isfinite(low["metrics"]["actor/pg_loss"]),
            "grad_norm": low["metrics"]["actor/grad_norm"],
        }
    else:
        check.skip("correctness.bf16", f"{device} has no bf16")
    return out


# -- speed --------------------------------------------------------------------------------------------------------


def id_tokenizer(vocab: int):
    """A word-level tokenizer over ``vocab`` ids (no model hub here, and a random-init model needs none of its
    text): ids 0-3 are pad, bos, eos, unk."""
    from tokenizers import pre_tokenizers

    return word_level_tokenizer([f"w{i}" for i in range(len(SPECIAL_TOKENS), vocab)], pre_tokenizers.WhitespaceSplit())


def qwen2(shape: Shape, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        tie_word_embeddings=shape.tied, max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: a 7B-sized init on the CPU would take minutes
        return Qwen2ForCausalLM(config).to(dtype)


def rollout_speed(
    device: torch.device, model, tok, shape: Shape, batch: int, prompt_len: int, new: int, dtype_bytes: int
) -> dict:
    from transformers import GenerationConfig

    g = torch.Generator().manual_seed(batch)
    encoded = torch.randint(4, shape.vocab, (batch, prompt_len), generator=g).tolist()
    params = SamplingParams(temperature=1.0, max_new_tokens=new, seed=0)
    engine = HFRolloutEngine(model, tok, batch_size=batch)
    counts = {}

    def run_engine() -> None:
        counts["engine"] = sum(len(c.response_ids) for c in engine.generate_ids(encoded, params))

    ids = torch.tensor(encoded, device=device)
    raw_cfg = GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_p=None,
        top_k=None,
        max_new_tokens=new,
        eos_token_id=2,
        pad_token_id=0,
    )

    def run_raw() -> None:
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=raw_cfg
            )
        counts["raw"] = counts["raw_first"] = int((out[:, prompt_len:] != 0).sum())

    result = {"batch": batch, "prompt_len": prompt_len, "new_tokens": new}
    model.eval()  # as the engine runs it (a model built here starts in training mode)
    # raw before and after the engine: the first generation at a new batch shape also pays for the allocator
    for name, fn in (("raw_first", run_raw), ("engine", run_engine), ("raw", run_raw)):
        free_memory()
        peak_reset(device)
        sec = timed(
            device, fn, 1, warm_up=False
        )  # one 512-token generation is ~1,000 launches per layer already
        result[f"{name}_tokens_per_s"] = round(counts[name] / sec, 1)
        result[f"{name}_peak_gib"] = (
            None if peak_bytes(device) is None else round(peak_bytes(device) / 2**30, 2)
        )
    result["engine_over_raw"] = round(result["engine_tokens_per_s"] / result["raw_tokens_per_s"], 3)
    result["predicted_peak_gib"] = round(
        generate_peak_bytes(shape, dtype_bytes, batch, prompt_len, new) / 2**30, 2
    )
    return result


def update_batch(shape: Shape, n: int, prompt_len: int, response_len: int) -> dict:
    g = torch.Generator().manual_seed(n)
    batch = {k: [] for k in ("prompt_ids", "response_ids", "response_mask", "old_log_probs", "advantages")}
    for _ in range(n):
        batch["prompt_ids"].append(torch.randint(4, shape.vocab, (prompt_len,), generator=g).tolist())
        batch["response_ids"].append(torch.randint(4, shape.vocab, (response_len,), generator=g).tolist())
        batch["response_mask"].append([1] * response_len)
        batch["old_log_probs"].append([-12.0] * response_len)  # ~ log(1 / vocab): a random-init model's
        batch["advantages"].append([float(torch.randn(1, generator=g))] * response_len)
    return batch


def update_speed(
    device: torch.device,
    model,
    shape: Shape,
    batch: dict,
    cfg: ActorConfig,
    tflops: float,
    dtype_bytes: int,
    repeats: int,
) -> dict:
    prompt_len, response_len = len(batch["prompt_ids"][0]), len(batch["response_ids"][0])
    tokens = len(batch["prompt_ids"]) * (prompt_len + response_len) * cfg.ppo_epochs
    result: dict = {
        "samples": len(batch["prompt_ids"]),
        "micro_batch": cfg.micro_batch_size,
        "seq_len": prompt_len + response_len,
    }
    # one optimizer at a time on the device (the raw loop's AdamW state would count in the engine's peak)
    for name, make in (
        ("raw", lambda: raw_update(model, cfg, 0)),
        ("engine", lambda: TorchActor(model, cfg, 0, 1000).update),
    ):
        for key, value in measure_update(device, shape, make, batch, tokens, tflops, repeats).items():
            result[f"{name}_{key}"] = value
    result["engine_over_raw"] = round(result["engine_tokens_per_s"] / result["raw_tokens_per_s"], 3)
    predicted = update_peak_bytes(
        shape, dtype_bytes, cfg.micro_batch_size, prompt_len + response_len, response_len
    )
    result["predicted_peak_gib"] = round(predicted / 2**30, 2)
    return result


def measure_update(device: torch.device, shape: Shape, make, batch: dict, tokens: int, tflops: float | None, repeats: int) -> dict:
    """Tokens/s, peak and MFU of the update ``make()`` returns, on ``batch`` (``tokens`` per call)."""
    free_memory()
    peak_reset(device)
    fn = make()
    sec = timed(device, lambda f=fn: f(batch, 1.0, 0), repeats)
    del fn
    seq = len(batch["prompt_ids"][0]) + len(batch["response_ids"][0])
    flops = tokens * update_flops_per_token(shape, seq) / sec
    return {
        "tokens_per_s": round(tokens / sec, 1),
        "peak_gib": None if peak_bytes(device) is None else round(peak_bytes(device) / 2**30, 2),
        "mfu": round(flops / (tflops * 1e12), 4) if tflops else None,
    }


def update_paths(check: Check, device: torch.device, dtype: torch.dtype, tiny: bool) -> dict:
    """The torch actor's update on the whole vocabulary's logits (``actor.logits_chunk_tokens: null``) against the
    chunked path (512, the default), at the 0.5B and 1.5B shapes, each path at the largest micro-batch that fits
    (doubling from 8 until the device is out of memory; --tiny: the tiny shape at micro-batch 2 only): peak, tokens/s
    and MFU there, 64 + 512 tokens a sample, one optimizer step a call."""
    tflops = check.report["sections"].get("peak", {}).get("matmul_tflops")
    shapes = [TINY_SHAPE] if tiny else [SHAPES["qwen2-0.5b"], SHAPES["qwen2-1.5b"]]
    prompt_len, new = (8, 16) if tiny else (64, 512)
    out: dict = {}
    for shape in shapes:
        model = qwen2(shape, device, dtype)
        rows: dict = {}
        for path, chunk in (("plain", None), ("chunked", 8 if tiny else 512)):  # tiny: 32 response tokens, 4 chunks
            micro, best = 2 if tiny else 8, None
            while micro <= 512:
                cfg = ActorConfig(ppo_mini_batch_size=micro, micro_batch_size=micro, logits_chunk_tokens=chunk)
                batch = update_batch(shape, micro, prompt_len, new)
                try:
                    got = measure_update(device, shape, lambda cfg=cfg, m=model: TorchActor(m, cfg, 0, 1000).update, batch,
                                         micro * (prompt_len + new), tflops, 1)  # fmt: skip
                except torch.OutOfMemoryError:
                    break
                finally:
                    free_memory()
                best = {"micro_batch": micro, **got}
                if tiny:
                    break
                micro *= 2
            rows[path] = best
        if rows["plain"] and rows["chunked"]:
            rows["largest_micro_batch_ratio"] = rows["chunked"]["micro_batch"] / rows["plain"]["micro_batch"]
        out[shape.name] = rows
        model = None  # freed before the next shape's
        free_memory()
    return out


def speed(check: Check, device: torch.device, dtype: torch.dtype, tiny: bool) -> dict:
    shape = TINY_SHAPE if tiny else SHAPES["qwen2-0.5b"]
    dtype_bytes = torch.finfo(dtype).bits // 8
    tflops = check.report["sections"].get("peak", {}).get("matmul_tflops")
    model = qwen2(shape, device, dtype)
    tok = id_tokenizer(shape.vocab)
    out: dict = {"shape": shape.name, "params": shape.params(), "dtype": str(dtype).removeprefix("torch.")}
    assert sum(p.numel() for p in model.parameters()) == shape.params(), (
        "the paper model counts other parameters"
    )
    prompt_len, new = (8, 16) if tiny else (64, 512)
    out["rollout"] = []
    warm = SamplingParams(
        temperature=1.0, max_new_tokens=8
    )  # the kernels' first launches, outside the timings
    HFRolloutEngine(model, tok, batch_size=8).generate_ids([[5] * prompt_len] * 8, warm)
    for b in (4, 8) if tiny else (64, 256):
        try:
            out["rollout"].append(rollout_speed(device, model, tok, shape, b, prompt_len, new, dtype_bytes))
        except torch.OutOfMemoryError as e:
            check.skip(f"speed.rollout batch {b}", f"out of device memory: {str(e).splitlines()[0]}")
        free_memory()
    samples, micro = (8, 2) if tiny else (64, 8)
    cfg = ActorConfig(ppo_mini_batch_size=samples, micro_batch_size=micro)
    batch = update_batch(shape, samples, prompt_len, new)
    out["update"] = update_speed(device, model, shape, batch, cfg, tflops, dtype_bytes, 2 if tiny else 3)
    return out


# -- deepspeed ----------------------------------------------------------------------------------------------------


def deepspeed(check: Check, device: torch.device, dtype: torch.dtype, tiny: bool) -> dict:
    """ZeRO-2 against the torch engine on the same device: one tiny-kit fp32 update (the same weights to
    rounding), then the speed and peak memory of both on the speed section's shape and batch (bf16 on a GPU)."""
    from rlstage.engines.training.actor_deepspeed import DeepSpeedActor

    # one process, one rank: a launcher's (or a test's) RANK / WORLD_SIZE / MASTER_PORT would make DeepSpeed wait
    # for ranks that never come
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    tok = build_char_tokenizer()
    batch = ragged_batch(tok, 32, seed=0)
    cfg = ActorConfig(ppo_mini_batch_size=32, micro_batch_size=8)
    zero2 = {"engine": "deepspeed", "zero_stage": 2}
    ref = tiny_update(device, torch.float32, batch, cfg, tok)
    ds = tiny_update(device, torch.float32, batch, cfg.model_copy(update=zero2), tok, DeepSpeedActor)
    rm, dm = ref["metrics"], ds["metrics"]
    w = max(float((ref["after"][k] - ds["after"][k]).abs().max()) for k in ref["after"])
    out: dict = {
        "tiny_fp32_vs_torch_engine": {
            "loss_rel": abs(rm["actor/pg_loss"] - dm["actor/pg_loss"]) / abs(rm["actor/pg_loss"]),
            "grad_norm_rel": abs(rm["actor/grad_norm"] - dm["actor/grad_norm"]) / rm["actor/grad_norm"],
            "weights_max_abs_over_lr": w / cfg.optim.lr,
        }
    }
    shape = TINY_SHAPE if tiny else SHAPES["qwen2-0.5b"]
    dtype_bytes = torch.finfo(dtype).bits // 8
    samples, micro = (8, 2) if tiny else (64, 8)
    prompt_len, new = (8, 16) if tiny else (64, 512)
    big = update_batch(shape, samples, prompt_len, new)
    tokens = samples * (prompt_len + new)
    for name, actor_cls, over in (("torch", TorchActor, {}), ("deepspeed_zero2", DeepSpeedActor, zero2)):
        free_memory()
        peak_reset(device)
        c = ActorConfig(ppo_mini_batch_size=samples, micro_batch_size=micro, **over)
        actor = actor_cls(qwen2(shape, device, dtype), c, 0, 1000)
        sec = timed(device, lambda actor=actor: actor.update(big, 1.0, 0), 2 if tiny else 3)
        used = peak_bytes(device)
        engine, stage = ("deepspeed", 2) if over else ("torch", 0)
        predicted = update_peak_bytes(shape, dtype_bytes, micro, prompt_len + new, new, engine, stage)
        out[name] = {
            "tokens_per_s": round(tokens / sec, 1),
            "peak_gib": None if used is None else round(used / 2**30, 2),
            "predicted_peak_gib": round(predicted / 2**30, 2),
        }
        del actor
    out["zero2_over_torch"] = round(out["deepspeed_zero2"]["tokens_per_s"] / out["torch"]["tokens_per_s"], 3)
    return out


# -- largest ------------------------------------------------------------------------------------------------------


def weight_push(check: Check, device: torch.device, dtype: torch.dtype, tiny: bool) -> dict:
    """The policy's weights (the 0.5B shape; --tiny: the tiny one) pushed in memory to a second process that holds a
    model of the same shape on the same device, in the buckets a rollout role placed apart takes
    (engines/rollout/weight_sync.py, 128 MiB each; here over a pipe: the GPU machine has no Ray): whole, then a delta
    after an Adam-like step that moves every element by 1e-6 (in bf16 most of it is below the dtype's resolution).
    Timed from the push's start to the receiver's model holding the weights."""
    import multiprocessing as mp

    from rlstage.engines.rollout.weight_sync import WeightSender

    shape = TINY_SHAPE if tiny else SHAPES["qwen2-0.5b"]
    model = qwen2(shape, device, dtype)
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_receiver, args=(child_conn, model.config, str(dtype).removeprefix("torch."), str(device)))
    child.start()
    try:
        assert conn.recv() == "ready"
        sender = WeightSender(delta=True, bucket_bytes=128 << 20)
        out: dict = {"shape": shape.name, "dtype": str(dtype).removeprefix("torch."), "bucket_mib": 128}
        for name, have in (("whole", None), ("delta", "v0")):
            if have is not None:
                g = torch.Generator(device=device).manual_seed(1)
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.sign(torch.randn(p.shape, generator=g, device=device)).to(p.dtype) * 1e-6)
            sync(device)
            t0 = time.perf_counter()
            conn.send(("begin", sender.start(model, "v1" if have else "v0", have)))
            last = False
            while not last:
                bucket = sender.next_bucket()
                conn.send(("bucket", bucket))
                last = bucket.last
            conn.send(("commit", None))
            conn.recv()
            seconds = time.perf_counter() - t0
            out[name] = {"seconds": seconds, "bytes": sender.bytes, "gb_per_s": sender.bytes / seconds / 1e9}
        conn.send(("checksum", None))
        out["receiver_equal"] = conn.recv() == _checksum(model)
        return out
    finally:
        conn.send(("stop", None))
        child.join(60)


def _checksum(model: torch.nn.Module) -> float:
    return float(sum(p.double().sum().item() for p in model.state_dict().values()))


def _receiver(conn, config, dtype: str, device: str) -> None:
    """The second process of ``weight_push``: a model of the same shape, taking pushes until told to stop."""
    from transformers import AutoModelForCausalLM

    from rlstage.engines.rollout.weight_sync import WeightReceiver

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    receiver = WeightReceiver()
    conn.send("ready")
    while True:
        what, arg = conn.recv()
        if what == "begin":
            receiver.begin(arg)
        elif what == "bucket":
            receiver.stage(arg)
        elif what == "commit":
            applied = receiver.apply(model)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            conn.send(applied)
        elif what == "checksum":
            conn.send(_checksum(model))
        else:
            return


def update_peak(device: torch.device, shape: Shape, dtype: torch.dtype, batch: dict, cfg: ActorConfig) -> int:
    model = qwen2(shape, device, dtype)
    actor = TorchActor(model, cfg, 0, 10)
    free_memory()
    peak_reset(device)
    actor.update(batch, 1.0, 0)
    sync(device)
    used = peak_bytes(device)
    del actor, model
    free_memory()
    return used


def largest(check: Check, device: torch.device, dtype: torch.dtype) -> dict:
    base = SHAPES["qwen2-0.5b"]
    samples, micro = 8, 8
    cfg = ActorConfig(ppo_mini_batch_size=samples, micro_batch_size=micro)
    batch = update_batch(base, samples, 64, 512)
    total = torch.cuda.get_device_properties(device).total_memory
    a, b = 12, 24
    pa, pb = (
        update_peak(device, base.with_layers(a), dtype, batch, cfg),
        update_peak(device, base.with_layers(b), dtype, batch, cfg),
    )
    per_layer = (pb - pa) / (b - a)
    predicted = int((0.95 * total - (pa - per_layer * a)) / per_layer)
    tried = int(predicted * 0.9)
    out = {
        "card_gib": round(total / 2**30, 1),
        "micro_batch": micro,
        "seq_len": 576,
        "peak_gib": {a: round(pa / 2**30, 2), b: round(pb / 2**30, 2)},
    }
    out |= {
        "per_layer_gib": round(per_layer / 2**30, 3),
        "predicted_max_layers": predicted,
        "tried_layers": tried,
    }
    try:
        used = update_peak(device, base.with_layers(tried), dtype, batch, cfg)
        out |= {
            "tried_fits": True,
            "tried_peak_gib": round(used / 2**30, 2),
            "tried_params": base.with_layers(tried).params(),
        }
    except torch.OutOfMemoryError:
        out["tried_fits"] = False
    return out


# -- main ---------------------------------------------------------------------------------------------------------


def device_refusal(name: str) -> str | None:
    """Why this check cannot run on ``name``, or None."""
    try:
        device = torch.device(name)
    except RuntimeError:
        return f"unknown device {name!r}; use cuda, cuda:N or cpu"
    if device.type not in ("cuda", "cpu"):
        return f"device {name!r} is not one this check knows; use cuda, cuda:N or cpu"
    if device.type == "cuda" and not torch.cuda.is_available():
        return f"device {name!r} asked for, but torch sees no CUDA device here"
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        return f"device {name!r} asked for, but torch sees {torch.cuda.device_count()} CUDA device(s)"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and batches: CI's smoke run on the CPU")
    ap.add_argument("--out", default="gpu_check.json", help="the JSON report")
    ap.add_argument(
        "--budget-s", type=float, default=480.0, help="sections not started within this are skipped"
    )
    ap.add_argument(
        "--commit", default=os.environ.get("RLSTAGE_COMMIT", "unknown"), help="the checkout's commit"
    )
    ap.add_argument("--only", default="", help="comma-separated sections to run (default: all)")
    args = ap.parse_args(argv)
    refusal = device_refusal(args.device)
    if refusal:
        print(f"gpu_check: {refusal}", file=sys.stderr)
        Path(args.out).write_text(
            json.dumps(
                {
                    "meta": {"commit": args.commit},
                    "sections": {},
                    "skipped": [{"what": "all", "why": refusal}],
                }
            )
        )
        return 2
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    bf16 = torch.cuda.is_bf16_supported() if cuda else True
    import transformers

    meta = {
        "commit": args.commit,
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or platform.machine(),
        "device_memory_gib": round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
        if cuda
        else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "tiny": args.tiny,
        "threads": torch.get_num_threads(),
    }
    check = Check(Path(args.out), args.budget_s, meta)
    dtype = (
        torch.bfloat16 if (cuda and bf16) else torch.float32
    )  # bf16 products on a CPU measure nothing useful
    if cuda and not bf16:
        check.skip("bf16", f"{meta['device']} lacks bf16: speed runs in fp32")
    wanted = set(filter(None, args.only.split(","))) or {"peak", "correctness", "speed", "deepspeed", "update_paths", "weight_push", "largest"}
    for name, fn, *rest in (
        ("peak", peak, device, dtype, args.tiny),
        ("correctness", correctness, device, bf16),
        ("speed", speed, device, dtype, args.tiny),
        ("deepspeed", deepspeed, device, dtype, args.tiny),
        ("update_paths", update_paths, device, dtype, args.tiny),
        ("weight_push", weight_push, device, dtype, args.tiny),
    ):
        if name in wanted:
            check.section(name, fn, *rest)
    if cuda and not args.tiny and "largest" in wanted:
        check.section("largest", largest, device, dtype)
    elif "largest" in wanted:
        check.skip("largest", "needs a CUDA device's memory statistics and a full-size run")
    check.save()
    print(
        f"gpu_check: wrote {args.out} ({len(check.report['sections'])} sections, {len(check.report['skipped'])} skipped)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
