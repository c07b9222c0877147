"""Peak memory and tokens/s of one update micro-batch (forward and backward of the policy's log-probs and entropy):
the whole vocabulary's logits at once against chunked log-probs (``actor.logits_chunk_tokens``), side by side.

Each case runs in a process of its own and reports its peak resident memory (``ru_maxrss``); ``head=none`` is the
same forward and backward with the loss taken from the last hidden states (no output layer), so
``peak - peak(none)`` is the vocabulary's share. Models: SmolLM2-135M-Instruct (fetched, ``python -m
rlstage.infra.models smollm2``; its shape at random init when it is not there) and the Qwen2-0.5B shape at random
init, fp32. Tokens/s counts the micro-batch's tokens over the median of ``--repeats`` timed passes after one warm-up;
the achieved FLOP/s (6 x matmul parameters + attention per token) is set against an fp32 matrix product measured in
the same run: the CPU's MFU. The largest micro-batch that fits in ``--budget-gib`` is read from an affine fit of the
peaks at the measured micro-batch sizes (memory grows linearly in the micro-batch).

    .venv/bin/python bench/update_memory.py                       # both models, both paths (~10 min on 2 cores)
    .venv/bin/python bench/update_memory.py --models smollm2 --micro 8 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from memory_model import GiB, Shape, activation_bytes, update_flops_per_token  # noqa: E402

SMOLLM2 = Shape("smollm2-135m", 576, 30, 9, 3, 1536, 49152, True)
QWEN = Shape("qwen2-0.5b", 896, 24, 14, 2, 4864, 151936, True)
MODELS = {"smollm2": SMOLLM2, "qwen2-0.5b": QWEN}


def _model(name: str):
    import torch
    from transformers import (
        AutoModelForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    s = MODELS[name]
    if name == "smollm2":
        try:
            from rlstage.infra.models import fetch_model

            return AutoModelForCausalLM.from_pretrained(fetch_model("smollm2"), dtype=torch.float32), "fetched"
        except Exception:  # no cached copy and no index to fetch from: its shape at random init
            pass
        cfg = LlamaConfig(hidden_size=s.hidden, num_hidden_layers=s.layers, num_attention_heads=s.heads,
                          num_key_value_heads=s.kv_heads, intermediate_size=s.intermediate, vocab_size=s.vocab,
                          tie_word_embeddings=True)  # fmt: skip
        return LlamaForCausalLM(cfg).float(), "random init"
    cfg = Qwen2Config(hidden_size=s.hidden, num_hidden_layers=s.layers, num_attention_heads=s.heads,
                      num_key_value_heads=s.kv_heads, intermediate_size=s.intermediate, vocab_size=s.vocab,
                      tie_word_embeddings=True)  # fmt: skip
    return Qwen2ForCausalLM(cfg).float(), "random init"


def case(model_name: str, head: str, micro: int, prompt: int, response: int, repeats: int, chunk: int) -> dict:
    """One process's measurement: ``head`` is plain, chunked or none."""
    import torch

    from rlstage.engines.training.forward import build_inputs, response_log_probs, response_logits
    from rlstage.engines.training.lm_head import hidden_states_as_logits, plain_output_layer

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    torch.manual_seed(0)
    model, source = _model(model_name)
    model.train()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(10, vocab, (micro, prompt), generator=g).tolist()
    responses = torch.randint(10, vocab, (micro, response), generator=g).tolist()
    inputs = build_inputs(prompts, responses, 0)
    head_layer = plain_output_layer(model)[0]

    def one_pass() -> None:
        model.zero_grad(set_to_none=True)
        if head == "none":
            with hidden_states_as_logits(head_layer):
                loss = response_logits(model, inputs).float().pow(2).mean()
        else:
            chunk_tokens = chunk if head == "chunked" else None
            logp, entropy = response_log_probs(model, inputs, 1.0, with_entropy=True, chunk_tokens=chunk_tokens)
            loss = -logp.mean() - 0.01 * entropy.mean()
        loss.backward()

    one_pass()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        one_pass()
        times.append(time.perf_counter() - t0)
    s = MODELS[model_name]
    tokens = micro * (prompt + response)
    wall = statistics.median(times)
    return {
        "model": model_name, "source": source, "head": head, "micro": micro, "tokens": tokens,
        "peak_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20), 3),
        "pass_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 1),
        "flop_per_s": update_flops_per_token(s, prompt + response) * tokens / wall,
    }  # fmt: skip


def matmul_peak(n: int = 2048, repeats: int = 5) -> float:
    """fp32 FLOP/s of an n x n matrix product on this process's threads (the best of ``repeats``)."""
    import torch

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * n**3 / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _run(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="smollm2,qwen2-0.5b")
    p.add_argument("--micro", default="8", help="micro-batch sizes (samples), comma-separated, for smollm2")
    p.add_argument("--qwen-micro", default="1,2", help="micro-batch sizes for the 0.5B shape (8 x 576 needs > 24 GiB plain)")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--response", type=int, default=512)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--budget-gib", type=float, default=16.0)
    p.add_argument("--case", nargs=4, metavar=("MODEL", "HEAD", "MICRO", "REPEATS"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.case:
        m, head, micro, repeats = a.case
        print(json.dumps(case(m, head, int(micro), a.prompt, a.response, int(repeats), a.chunk)))
        return
    peak = matmul_peak()
    print(json.dumps({"fp32_matmul_flop_per_s": peak, "threads": int(os.environ.get("BENCH_THREADS", "2"))}), flush=True)
    common = ["--prompt", str(a.prompt), "--response", str(a.response), "--chunk", str(a.chunk)]
    for model in a.models.split(","):
        sizes = [int(x) for x in (a.qwen_micro if model == "qwen2-0.5b" else a.micro).split(",")]
        rows: dict[str, list[dict]] = {}
        for micro in sizes:
            for head in ("none", "plain", "chunked"):
                row = _run([*common, "--case", model, head, str(micro), str(a.repeats)])
                if "flop_per_s" in row:
                    row["mfu"] = round(row.pop("flop_per_s") / peak, 3)
                    s = MODELS[model]
                    predicted = activation_bytes(s, micro * (a.prompt + a.response), micro * a.response, 4,
                                                 chunk_tokens=a.chunk if head == "chunked" else None)  # fmt: skip
                    row["model_activations_gib"] = round(predicted / GiB, 2)
                rows.setdefault(head, []).append(row)
                print(json.dumps(row), flush=True)
        none = {r["micro"]: r["peak_gib"] for r in rows["none"] if "peak_gib" in r}
        summary = {"model": model}
        for head in ("plain", "chunked"):
            ok = [r for r in rows[head] if "peak_gib" in r]
            summary[head] = {
                "vocab_share_gib": {r["micro"]: round(r["peak_gib"] - none.get(r["micro"], 0.0), 2) for r in ok},
                "largest_micro_in_budget": _largest(ok, a.budget_gib),
            }
        print(json.dumps({"summary": summary}), flush=True)


def _largest(rows: list[dict], budget_gib: float) -> int | None:
    """From an affine fit of peak against micro-batch size (one point: its peak per sample)."""
    if not rows:
        return None
    if len(rows) == 1:
        slope, icept = rows[0]["peak_gib"] / rows[0]["micro"], 0.0
    else:
        (m0, p0), (m1, p1) = (rows[0]["micro"], rows[0]["peak_gib"]), (rows[-1]["micro"], rows[-1]["peak_gib"])
        slope = (p1 - p0) / (m1 - m0)
        icept = p0 - slope * m0
    return max(0, int((budget_gib - icept) // slope)) if slope > 0 else None


if __name__ == "__main__":
    main()
