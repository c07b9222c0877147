"""The SFT warm-start stage: build the tiny kit (tokenizer + model) and teach it the task format.

Its output is a Hugging Face model directory committed under ``<root>/kit-<hash>/data/sft/``;
runs with the same kit and SFT settings share it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from engines import datasets, rewards
from engines.rollout import HFRolloutEngine, SamplingParams
from engines.sft import sft_train
from engines.tinykit import build_char_tokenizer, build_tiny_llama, save_model_dir
from schemas.config import RunConfig
from schemas.manifest import PolicyRef
from tasks.runtime import STAGE_CONFIG, policy_ref_from
from tasks.stages import StageOutput, StageResult, run_stage


def kit_run_name(cfg: RunConfig) -> str:
    return f"kit-{cfg.stage_hash(*STAGE_CONFIG['sft'])}"


def greedy_accuracy(model, tokenizer, prompts: list[str], answers: list[str], data_source: str) -> float:
    comps = HFRolloutEngine(model, tokenizer, batch_size=512).generate(prompts, SamplingParams(n=1, temperature=0))
    rows = [
        {"response_text": c.text, "ground_truth": answers[c.prompt_index], "data_source": data_source, "extra_info": "{}"}
        for c in comps
    ]
    return sum(r.score for r in rewards.score_batch(rows, timeout_s=5.0)) / max(1, len(rows))


@task(name="sft", cache_policy=NO_CACHE, persist_result=False)
def sft_warm_start(cfg: RunConfig) -> StageResult:
    """Train (or reuse) the SFT checkpoint of the tiny kit, committed under the kit's own run."""

    def produce() -> StageOutput:
        torch.set_num_threads(cfg.model.torch_threads)
        k, s = cfg.kit, cfg.sft
        train, test = datasets.make_addition_splits(k.digits, k.train_size, k.test_size, k.seed)
        tok = build_char_tokenizer()
        model = build_tiny_llama(k, tok)
        examples = list(zip(train.column("prompt").to_pylist(), train.column("ground_truth").to_pylist(), strict=True))
        ds = test.column("data_source")[0].as_py()
        prompts, answers = test.column("prompt").to_pylist(), test.column("ground_truth").to_pylist()
        # Early stopping looks at a slice of the test split; the reported accuracy is on all of it.
        probe = (prompts[: s.eval_size], answers[: s.eval_size])

        def should_stop(step: int, _loss: float) -> bool:
            if s.target_accuracy is None or step % s.eval_every:
                return False
            return greedy_accuracy(model, tok, *probe, ds) >= s.target_accuracy

        losses = sft_train(
            model, tok, examples, steps=s.steps, batch_size=s.batch_size, lr=s.lr, seed=s.seed, should_stop=should_stop
        )
        acc = greedy_accuracy(model, tok, prompts, answers, ds)
        with tempfile.TemporaryDirectory() as tmp:
            save_model_dir(model, tok, tmp)
            blobs = {f"model/{p.relative_to(tmp)}": p.read_bytes() for p in sorted(Path(tmp).rglob("*")) if p.is_file()}
        return StageOutput(
            blobs=blobs,
            metrics={
                "sft/final_loss": losses[-1] if losses else float("nan"),
                "sft/test_accuracy": acc,
                "sft/steps": len(losses),
            },
            meta={"parameters": sum(p.numel() for p in model.parameters())},
        )

    return run_stage(cfg, "sft", None, {}, produce, run=kit_run_name(cfg))


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
