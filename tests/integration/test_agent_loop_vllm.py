"""The agent loop on vLLM's async engine: multi-turn trajectories continue in the engine."""

from __future__ import annotations

import asyncio
import gc

import pytest
import torch

from agents_support import EOS, FMT, TOK, call
from rlstage.engines.agents.loop import (
    AgentLimits,
    AgentRequest,
    run_requests,
)
from rlstage.engines.agents.policies import AgentPolicy, Generation
from rlstage.engines.agents.tools import (
    CALCULATOR_PARAMETERS,
    ToolSpec,
    calculator,
    sample_tools,
)
from rlstage.engines.models.tinykit import build_tiny_llama
from rlstage.engines.rollout.hf import SamplingParams
from rlstage.schemas.config import KitConfig

CALC = ToolSpec("calculator", "arithmetic", CALCULATOR_PARAMETERS, calculator, 1.0)




# ---------------------------------------------------------------- vLLM's async interface behind the loop


class FirstTurnScripted(AgentPolicy):
    """Turn 1 is a scripted tool call; later turns come from ``inner`` (a real engine)."""

    def __init__(self, inner) -> None:
        self.inner, self.turns = inner, {}

    async def generate(self, prompt_ids, params, key=0):
        self.turns[key] = self.turns.get(key, 0) + 1
        if self.turns[key] == 1:
            ids = FMT.encode(call("calculator", expression=f"{key}*7")) + [EOS]
            return Generation(ids, [0.0] * len(ids), "stop")
        return await self.inner.generate(prompt_ids, params, key)


@pytest.mark.skipif(not __import__("rlstage.engines.rollout.vllm_engine", fromlist=["x"]).vllm_available(), reason="vllm is not installed")
def test_async_vllm_policy_continues_multi_turn_trajectories(tmp_path):
    from rlstage.engines.agents.policies import AsyncVLLMPolicy, start_async_vllm
    from rlstage.engines.models.tinykit import save_model_dir
    from rlstage.engines.training.forward import build_inputs, response_log_probs

    torch.manual_seed(0)
    model = build_tiny_llama(KitConfig(), TOK).eval()  # vLLM's CPU kernels want head_dim >= 32
    engines = [start_async_vllm(str(save_model_dir(model, TOK, tmp_path / "model")), seed=0)]
    try:

        async def main():
            policy = FirstTurnScripted(AsyncVLLMPolicy(engines[0], EOS))
            reqs = [
                AgentRequest(i, 0, [{"role": "user", "content": f"What is {i}*7?"}], sample_tools({"calculator": CALC}, None), FMT, policy, SamplingParams(temperature=1.0, max_new_tokens=96, seed=5), AgentLimits(max_turns=2), key=i)
                for i in range(4)
            ]  # fmt: skip
            return await run_requests(reqs)

        trajs = asyncio.run(main())
    finally:
        engines.pop().shutdown()
        gc.collect()  # AsyncLLM.__del__ shuts down again: now, not during interpreter teardown
    for i, t in enumerate(trajs):
        assert t.states[:4] == ["pending", "generating", "tool_calling", "generating"]
        assert t.messages[2]["content"] == str(i * 7)
        last = t.turn_bounds[-1]
        assert last["role"] == "assistant" and last["end"] == len(t.response_ids)
        # vLLM's sampling log-probs of its turn match the trainer's teacher-forced recompute.
        inputs = build_inputs([t.prompt_ids], [t.response_ids], TOK.pad_token_id)
        with torch.no_grad():
            logp, _ = response_log_probs(model, inputs, 1.0)
        recomputed = logp[0, last["start"] : last["end"]].tolist()
        assert t.log_probs[last["start"] : last["end"]] == pytest.approx(recomputed, abs=1e-3)

