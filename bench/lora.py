"""Trainer memory and update time of a LoRA policy against full fine-tuning, on SmolLM2-135M-Instruct.

One subprocess per variant (peak RSS only grows within a process). Each runs TorchActor updates on the same
ragged GRPO-like batch (``update_throughput.ragged_batch``: prompts of 8-24 tokens, responses of 1-32) and
prints one JSON line: trained parameters, the bytes the trainer keeps beside the weights (gradients +
AdamW moments, counted from the tensors after an update), the process's peak RSS, and the median wall time
of ``--repeats`` timed updates after one warm-up.

    .venv/bin/python bench/lora.py                  # SmolLM2 from `python -m rlstage.infra.models smollm2`
    .venv/bin/python bench/lora.py --model DIR --samples 32 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.update_throughput import ragged_batch  # noqa: E402
from rlstage.engines.models.lora import with_adapters  # noqa: E402
from rlstage.engines.training.actor import TorchActor  # noqa: E402
from rlstage.schemas.config import ActorConfig, ModelConfig, OptimConfig  # noqa: E402

VARIANTS = {"full": None, "lora_r8": ModelConfig(lora_rank=8, lora_alpha=16), "lora_r32": ModelConfig(lora_rank=32, lora_alpha=64)}


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def run_variant(name: str, model_dir: str, samples: int, repeats: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    weights = _bytes(model.parameters())
    if VARIANTS[name] is not None:
        model = with_adapters(model, VARIANTS[name])
    cfg = ActorConfig(ppo_mini_batch_size=samples, micro_batch_size=8, optim=OptimConfig(lr=1e-5))
    actor = TorchActor(model, cfg, tok.pad_token_id, total_steps=100)
    batch = ragged_batch(tok, samples)
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        actor.update(batch, 1.0, seed=i)
        times.append(time.perf_counter() - t0)
    trained = [p for p in model.parameters() if p.requires_grad]
    grads = _bytes(p.grad for p in trained if p.grad is not None)
    moments = _bytes(v for s in actor.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim())
    return {
        "variant": name,
        "trained_params": sum(p.numel() for p in trained),
        "weights_mib": round(weights / 2**20, 1),
        "grads_plus_adam_mib": round((grads + moments) / 2**20, 1),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 0),
        "update_s": round(statistics.median(times[1:]), 2),
        "samples": samples,
        "threads": threads,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a Hugging Face folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the subprocess of one variant
    args = ap.parse_args()
    if args.model is None:
        from rlstage.infra.models import fetch_model

        args.model = str(fetch_model("smollm2"))
    if args.one is not None:
        print(json.dumps(run_variant(args.one, args.model, args.samples, args.repeats, args.threads)), flush=True)
        return
    for name in args.variants.split(","):
        cmd = [sys.executable, __file__, "--one", name, "--model", args.model, "--samples", str(args.samples),
               "--repeats", str(args.repeats), "--threads", str(args.threads)]  # fmt: skip
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        print(out.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
