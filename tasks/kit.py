"""The SFT warm-start stage: build the tiny kit (tokenizer + model) and teach it the task format.

Its output is a Hugging Face model directory committed under ``<root>/kit-<hash>/data/sft/``;
runs with the same kit and SFT settings share it.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from rlstage.engines.agents.loop import (
    AgentLimits,
    ChatFormat,
    agent_metrics,
    demonstrations,
    run_agent_config,
)
from rlstage.engines.agents.tools import CALCULATOR_PATHS, load_tools, resolve_template
from rlstage.engines.data import datasets
from rlstage.engines.models.tinykit import build_char_tokenizer, build_tiny_llama, save_model_dir
from rlstage.engines.rewards import rules as rewards
from rlstage.engines.rollout.hf import HFRolloutEngine, SamplingParams
from rlstage.engines.training.sft import sft_train, sft_train_ids
from rlstage.infra.progress import Poster
from rlstage.schemas.config import RunConfig
from rlstage.schemas.manifest import PolicyRef
from rlstage.schemas.stages import ConfigView, kit_run_name
from rlstage.tasks.runtime import policy_ref_from
from rlstage.tasks.stages import StageOutput, StageResult, stage_task


def greedy_accuracy(model, tokenizer, prompts: list[str], answers: list[str], data_source: str) -> float:
    comps = HFRolloutEngine(model, tokenizer, batch_size=512).generate(prompts, SamplingParams(n=1, temperature=0))
    rows = [
        {"response_text": c.text, "ground_truth": answers[c.prompt_index], "data_source": data_source, "extra_info": "{}"}
        for c in comps
    ]
    return sum(r.score for r in rewards.score_batch(rows, timeout_s=5.0)) / max(1, len(rows))


def agent_accuracy(cfg: ConfigView, model, tokenizer, rows: list[dict]) -> tuple[float, dict[str, float]]:
    """Greedy multi-turn answers (with the configured tools) to prompts-table rows: accuracy and tool metrics."""
    engine = HFRolloutEngine(model, tokenizer, batch_size=512)
    params = SamplingParams(n=1, temperature=0, max_new_tokens=cfg.rollout.max_new_tokens)
    comps, stats = run_agent_config(engine, cfg.agent, rows, params)
    scored = rewards.completion_rows(rows, comps)
    acc = sum(r.score for r in rewards.score_batch(scored, timeout_s=5.0)) / max(1, len(scored))
    return acc, agent_metrics(comps, stats)


def multiply_demo_turns(cfg: ConfigView, row: dict) -> list[str]:
    """The demonstration of one multiply row: call the calculator with the operands, then answer."""
    tool = next((t.name for t in cfg.agent.tools if t.callable in CALCULATOR_PATHS), None)
    if tool is None:
        raise ValueError("kit.task=multiply with agent.enable needs a tool whose callable is rlstage.engines.agents.tools:calculator")
    info = json.loads(row["extra_info"])
    call = {"name": tool, "arguments": {"expression": f"{info['a']}*{info['b']}"}}
    return [f"<tool_call>{json.dumps(call, separators=(',', ':'))}</tool_call>", row["ground_truth"]]


def tool_demonstrations(cfg: ConfigView, tokenizer, rows: list[dict]) -> list[tuple[list[int], list[int]]]:
    """SFT sequences ``(ids, loss_mask)`` of multiply demonstrations, masked as agent rollouts are."""
    a = cfg.agent
    fmt = ChatFormat(tokenizer, resolve_template(a.chat_template))
    limits = AgentLimits(a.max_turns, a.max_tool_calls, a.max_response_tokens, a.max_tool_output_chars)
    turns = [multiply_demo_turns(cfg, r) for r in rows]
    trajs = demonstrations(fmt, load_tools(a.tools, a.tool_timeout_s), rows, turns, limits, tools_in_prompt=a.tools_in_prompt)
    bad = [t for t in trajs if t.finish_reason != "stop" or t.tool_errors]
    if bad:
        raise ValueError(f"{len(bad)} tool demonstrations did not complete cleanly (first: {bad[0].messages})")
    return [(t.prompt_ids + t.response_ids, [0] * len(t.prompt_ids) + t.response_mask) for t in trajs]


@stage_task("sft")
def sft_warm_start(cfg: ConfigView) -> StageOutput:
    """Train the SFT checkpoint of the tiny kit, committed under the kit's own run (spec.run_of): the agent settings
    are in the multiply kit's view only, so addition kits keep their checkpoints."""
    torch.set_num_threads(cfg.model.torch_threads)
    k, s = cfg.kit, cfg.sft
    train, test = datasets.make_task_splits(k.task, k.digits, k.train_size, k.test_size, k.seed)
    tok = build_char_tokenizer()
    model = build_tiny_llama(k, tok)
    examples = list(zip(train.column("prompt").to_pylist(), train.column("ground_truth").to_pylist(), strict=True))
    ds = test.column("data_source")[0].as_py()
    prompts, answers = test.column("prompt").to_pylist(), test.column("ground_truth").to_pylist()
    # Early stopping looks at a slice of the test split; the reported accuracy is on all of it.
    probe = (prompts[: s.eval_size], answers[: s.eval_size])
    agent = cfg.kit.task == "multiply" and cfg.agent.enable  # tool-call demonstrations
    test_rows = test.to_pylist()
    tool_metrics: dict[str, float] = {}

    def accuracy(rows: list[dict] | None = None) -> float:
        if agent:
            acc, tool_metrics_now = agent_accuracy(cfg, model, tok, rows if rows is not None else test_rows)
            tool_metrics.clear()  # the last check's (the full test split's) are reported
            tool_metrics.update(tool_metrics_now)
            return acc
        return greedy_accuracy(model, tok, *(probe if rows is not None else (prompts, answers)), ds)

    post = Poster(kit_run_name(cfg))  # the step on the terminal's status line (infra/progress.py)
    probe_acc: list[float] = []

    def should_stop(step: int, loss: float) -> bool:
        shown = f", held-out accuracy {probe_acc[-1]:.2f}" if probe_acc else ""
        post(f"step {step}/{s.steps}, loss {loss:.3f}{shown}")
        if s.target_accuracy is None or step % s.eval_every:
            return False
        probe_acc.append(accuracy(test_rows[: s.eval_size]))
        return probe_acc[-1] >= s.target_accuracy

    train_kw = {"steps": s.steps, "batch_size": s.batch_size, "lr": s.lr, "seed": s.seed, "should_stop": should_stop}
    if agent:
        losses = sft_train_ids(model, tok, tool_demonstrations(cfg, tok, train.to_pylist()), **train_kw)
    else:
        losses = sft_train(model, tok, examples, **train_kw)
    acc = accuracy()
    with tempfile.TemporaryDirectory() as tmp:
        save_model_dir(model, tok, tmp)
        blobs = {f"model/{p.relative_to(tmp)}": p.read_bytes() for p in sorted(Path(tmp).rglob("*")) if p.is_file()}
    return StageOutput(
        blobs=blobs,
        metrics={
            "sft/final_loss": losses[-1] if losses else float("nan"),
            "sft/test_accuracy": acc,
            "sft/steps": len(losses),
            **{f"sft/{name}": v for name, v in tool_metrics.items() if name.startswith(("tool_calls/", "num_turns/"))},
        },
        meta={"parameters": sum(p.numel() for p in model.parameters())},
    )


def initial_policy(cfg: RunConfig, sft: StageResult | None) -> PolicyRef:
    """The policy iteration 1 starts from: ``model.path`` if set, else the kit's SFT checkpoint."""
    if cfg.model.path is not None:
        path = Path(cfg.model.path).expanduser().resolve()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model.path {cfg.model.path} is not a Hugging Face model directory")
        return PolicyRef(version=f"path:{path}", path=str(path))
    if sft is None:
        raise ValueError("no model.path and no SFT checkpoint: nothing to start from")
    return policy_ref_from(sft.manifest)
