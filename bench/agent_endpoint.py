"""Agents through the OpenAI-compatible endpoint against the built-in agent loop: throughput, side by side.

    .venv/bin/python bench/agent_endpoint.py [--agents 64] [--repeats 3] [--threads 2]

Both sides run the same 64 concurrent calculator agents (16 prompts x 4 samples) on one HF rollout engine
of the tiny kit's model (an untrained one-layer Llama, its first turn scripted to call the calculator so that
every sample is multi-turn: call, tool result, then the model's own answer). The built-in side is
``run_agent_batch``; the endpoint side is ``run_function_batch`` with ``calculator_agent``, the ~30-line
OpenAI-client agent of ``rlstage.engines.agents.examples``, over HTTP on 127.0.0.1. Both batch requests
into the engine through one ``BatchingPolicy`` (50 ms window). Prints one JSON line per side (medians of
``--repeats`` alternating runs): samples/s, engine utilisation (the share of wall time the engine spent in
``generate``), generate calls and mean requests per call, and then the endpoint/built-in ratio of samples/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from rlstage.engines.agents.endpoint import run_function_batch
from rlstage.engines.agents.examples import CALCULATOR_TOOL, calculator_agent
from rlstage.engines.agents.loop import AgentLimits, ChatFormat, run_agent_batch
from rlstage.engines.agents.tools import ToolSpec, calculator
from rlstage.engines.models.tinykit import build_char_tokenizer, build_tiny_llama
from rlstage.engines.rollout.hf import Completion, HFRolloutEngine, SamplingParams
from rlstage.schemas.config import KitConfig


class FirstTurnCalls:
    """The engine, except that a first turn is a calculator call (the tiny model has not learnt to make one)."""

    def __init__(self, inner: HFRolloutEngine) -> None:
        self.inner, self.batch_size, self.tokenizer = inner, inner.batch_size, inner.tokenizer
        self.calls = 0

    def generate_ids(self, encoded: list[list[int]], params: SamplingParams) -> list[Completion]:
        self.calls += 1
        tok = self.tokenizer
        later = [j for j, p in enumerate(encoded) if "\nR:" in tok.decode(p)]  # a tool result is in the context
        out = dict(zip(later, self.inner.generate_ids([encoded[j] for j in later], params), strict=True)) if later else {}
        for j, prompt in enumerate(encoded):
            if j not in out:
                a, b = tok.decode(prompt).split("What is ")[1].split("?")[0].split("*")
                call = json.dumps({"name": "calculator", "arguments": {"expression": f"{a}*{b}"}}, separators=(",", ":"))
                resp = tok.convert_tokens_to_ids(list(f"<tool_call>{call}</tool_call>")) + [tok.eos_token_id]
                out[j] = Completion(j, 0, prompt, resp, [-0.1] * len(resp), tok.decode(resp), "stop")
        return [out[j] for j in range(len(encoded))]


def side(name: str, engine: FirstTurnCalls, rows: list[dict], params: SamplingParams) -> dict:
    fmt = ChatFormat(engine.tokenizer)
    engine.calls = 0
    t0 = time.perf_counter()
    if name == "built-in":
        tools = {"calculator": ToolSpec("calculator", "", CALCULATOR_TOOL["function"]["parameters"], calculator, 1.0)}
        out, stats = run_agent_batch(engine, fmt, tools, rows, params, AgentLimits())
    else:
        out, stats = run_function_batch(engine, fmt, calculator_agent, rows, params, AgentLimits(), tool_schemas=lambda r: [CALCULATOR_TOOL])
    wall = time.perf_counter() - t0
    turns = sum(r.num_turns for r in out)
    return {
        "samples_per_s": len(out) / wall,
        "engine_utilisation": stats["model_s"] / stats["wall_s"],  # the share of the wall in the engine's generate
        "wall_s": wall,
        "generate_calls": engine.calls,
        "requests_per_call": turns / max(1, engine.calls),
        "multi_turn_share": sum(r.num_turns > 1 for r in out) / len(out),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--agents", type=int, default=64, help="concurrent agents (prompts x 4 samples)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the engine (the same on both sides)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    model = build_tiny_llama(KitConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), tok).eval()
    engine = FirstTurnCalls(HFRolloutEngine(model, tok, batch_size=args.agents))
    rows = [
        {"prompt": f"What is {a}*{a + 3}?", "messages": None, "extra_info": "{}", "ground_truth": str(a * (a + 3))}
        for a in range(10, 10 + args.agents // 4)
    ]
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=24, seed=0)
    side("built-in", engine, rows, params)  # warm-up: the first generate pays torch's one-time costs
    runs: dict[str, list[dict]] = {"built-in": [], "endpoint": []}
    for _ in range(args.repeats):
        for name in runs:
            runs[name].append(side(name, engine, rows, params))
    medians = {}
    for name, results in runs.items():
        medians[name] = {k: statistics.median(r[k] for r in results) for k in results[0] if results[0][k] is not None}
        print(json.dumps({"side": name, "agents": args.agents, "threads": args.threads, **medians[name]}), flush=True)
    ratio = medians["endpoint"]["samples_per_s"] / medians["built-in"]["samples_per_s"]
    print(json.dumps({"endpoint_over_built_in_samples_per_s": round(ratio, 3)}), flush=True)


if __name__ == "__main__":
    main()
