"""Two pipeline iterations of a ~0.5B random-init model in Qwen2-0.5B's shape, on this CPU machine.

    .venv/bin/python bench/scale.py [--store /tmp/rlstage-bench-scale] [--dtype float32] [--layers 24] [overrides...]

Builds the model once (hidden 896, 24 layers, 14 heads / 2 KV heads, MLP 4864, tied embeddings, a
151,936-token vocabulary: the kit's characters plus filler tokens), then runs it through the real
pipeline (Prefect, Ray worker groups, store, MLflow) on the kit's addition prompts with short responses.
Prints one JSON line per iteration (seconds per stage) and one with the peak resident memory of each
role's processes (sampled every 0.2 s; one number per process, largest first: the trainer's ranks with
``ray.trainer_world_size``) and the checkpoint bytes per iteration. ``--layers`` builds a shallower model of the
same width (e.g. 12: ~0.3B), for placements that would not fit 24 GiB at full depth.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("rollout", "reward", "advantage", "update", "eval")
QWEN2_05B = dict(
    hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
    intermediate_size=4864, tie_word_embeddings=True, vocab_size=151_936, max_position_embeddings=512,
)  # fmt: skip


def build_model(folder: Path, dtype: str, layers: int) -> int:
    """A random-init Qwen2 of about 0.5B parameters (at 24 layers) with a tokenizer covering its vocabulary."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlstage.engines.models.tinykit import build_char_tokenizer

    tok = build_char_tokenizer()
    tok.add_tokens([f"<x{i}>" for i in range(QWEN2_05B["vocab_size"] - len(tok))])
    config = Qwen2Config(**{**QWEN2_05B, "num_hidden_layers": layers}, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


class PeakMemory(threading.Thread):
    """Peak RSS per role, from the process titles Ray gives its workers (``ray::PolicyWorker...``)."""

    ROLES = {"PolicyWorker": "trainer+colocated rollout", "RolloutWorker": "rollout", "ray::": "stage tasks"}

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak: dict[tuple[str, int], float] = {}  # (role, pid) -> GiB
        self.stop = threading.Event()

    def run(self) -> None:
        me = psutil.Process()
        while not self.stop.is_set():
            for p in psutil.process_iter(["cmdline", "memory_info"]):
                title = " ".join(p.info["cmdline"] or [])
                role = next((r for key, r in self.ROLES.items() if key in title), None)
                if p.pid == me.pid:
                    role = "driver (flow)"
                if role and p.info["memory_info"]:
                    self.peak[role, p.pid] = max(self.peak.get((role, p.pid), 0.0), p.info["memory_info"].rss / 2**30)
            time.sleep(0.2)

    def by_role(self) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for (role, _), gib in self.peak.items():
            out.setdefault(role, []).append(round(gib, 2))
        return {role: sorted(v, reverse=True)[:4] for role, v in sorted(out.items())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("overrides", nargs="*", help="dotted overrides")
    parser.add_argument("--store", default="/tmp/rlstage-bench-scale")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--layers", type=int, default=QWEN2_05B["num_hidden_layers"])
    args = parser.parse_args()
    import sys

    sys.path.insert(0, str(ROOT))
    from rlstage.flows.cli import prefect_api
    from rlstage.infra.env import apply_defaults

    apply_defaults()
    folder = Path(args.store) / ("qwen2-0.5b-random" if args.layers == 24 else f"qwen2-0.5b-{args.layers}-layers-random")
    params = None
    if not (folder / "config.json").is_file():
        params = build_model(folder, args.dtype, args.layers)
    monitor = PeakMemory()
    monitor.start()
    with prefect_api():
        from rlstage.flows.training import train
        from rlstage.schemas.config import load_config
        from rlstage.tasks.runtime import store_for

        cfg = load_config(
            None,
            [
                f"store.root={args.store}", "run_name=scale", f"model.path={folder}", f"model.dtype={args.dtype}",
                "model.torch_threads=2", "trainer.iterations=2", "data.prompts_per_iteration=4", "rollout.n=2",
                "rollout.max_new_tokens=8", "data.max_prompt_length=16", "kit.test_size=8",
                "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=4", "actor.entropy_coeff=0.01",
                "tracking.rollout_sample_rows=0", *args.overrides,
            ],
        )  # fmt: skip
        history = train(config=cfg)["history"]
        store = store_for(cfg)
        ckpt = [sum(e.bytes for e in store.manifest(cfg.run_name, k, "update").files.values()) for k in (1, 2)]
    monitor.stop.set()
    monitor.join()
    for h in history:
        if h["iteration"] > 0:
            print(json.dumps({"iteration": h["iteration"]} | {f"{s}_s": round(h[f"timing_s/{s}"], 1) for s in STAGES if f"timing_s/{s}" in h}))
    print(json.dumps({
        "parameters": params, "dtype": args.dtype, "checkpoint_bytes": ckpt,
        "peak_rss_gib": monitor.by_role(),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
