"""The agent endpoint on the vLLM engine: the tokens vLLM sampled are the trajectory's, and it trains to what the built-in loop trains to."""

from __future__ import annotations

import pytest
import torch

from agents_support import FMT, ROWS, TOK, TOOLS, ScriptedEngine, run_fn
from rlstage.engines.agents.examples import calculator_agent
from rlstage.engines.agents.loop import AgentLimits, run_agent_batch
from rlstage.engines.models.tinykit import build_tiny_llama
from rlstage.engines.rollout.hf import Completion, SamplingParams
from rlstage.schemas.config import KitConfig


class FirstTurnScripted:
    """A real engine whose first turns are a scripted calculator call: the later turns are the engine's own."""

    def __init__(self, inner) -> None:
        self.inner, self.batch_size, self.tokenizer = inner, inner.batch_size, TOK
        self.later: list[Completion] = []  # what the engine produced

    def generate_ids(self, encoded: list[list[int]], params: SamplingParams) -> list[Completion]:
        scripted = ScriptedEngine()
        first = [j for j, p in enumerate(encoded) if "\nR:" not in TOK.decode(p)]
        later = [j for j in range(len(encoded)) if j not in first]
        out: dict[int, Completion] = {}
        for j, c in zip(first, scripted.generate_ids([encoded[j] for j in first], params), strict=True):
            out[j] = c
        if later:
            got = self.inner.generate_ids([encoded[j] for j in later], params)
            self.later += got
            out.update(zip(later, got, strict=True))
        return [out[j] for j in range(len(encoded))]


@pytest.mark.skipif(not __import__("rlstage.engines.rollout.vllm_engine", fromlist=["x"]).vllm_available(), reason="vllm is not installed")
def test_on_the_vllm_engine_the_endpoint_records_vllms_tokens_and_matches_the_built_in_loop(tmp_path):
    from rlstage.engines.models.tinykit import save_model_dir
    from rlstage.engines.rollout.vllm_engine import VLLMRolloutEngine
    from rlstage.engines.training.forward import build_inputs, response_log_probs

    torch.manual_seed(0)
    model = build_tiny_llama(KitConfig(), TOK).eval()  # vLLM's CPU kernels want head_dim >= 32
    vllm = VLLMRolloutEngine(str(save_model_dir(model, TOK, tmp_path / "model")), TOK, seed=0, kv_cache_bytes=256 << 20, max_num_seqs=64)
    try:
        params = SamplingParams(n=2, temperature=1.0, max_new_tokens=40, seed=5)
        engine = FirstTurnScripted(vllm)
        fn_rows, _ = run_fn(calculator_agent, engine, params=params, window_s=5.0)
        loop_rows, _ = run_agent_batch(FirstTurnScripted(vllm), FMT, TOOLS, ROWS, params, AgentLimits(), window_s=5.0)
    finally:
        vllm.close()
    assert [(r.response_ids, r.log_probs) for r in fn_rows] == [(r.response_ids, r.log_probs) for r in loop_rows]
    for r in fn_rows:
        last = r.turn_bounds[-1]
        assert r.num_turns == 2 and last["role"] == "assistant"
        # The second turn is one of the completions vLLM produced for this context (a prompt's two samples share it).
        context = r.prompt_ids + r.response_ids[: last["start"]]
        produced = [(list(c.response_ids), list(c.log_probs)) for c in engine.later if list(c.prompt_ids) == context]
        assert (r.response_ids[last["start"] :], r.log_probs[last["start"] :]) in produced
        # The trainer's recompute on the stored tokens matches vLLM's sampling log-probs.
        with torch.no_grad():
            logp, _ = response_log_probs(model, build_inputs([r.prompt_ids], [r.response_ids], TOK.pad_token_id), 1.0)
        assert r.log_probs[last["start"] :] == pytest.approx(logp[0, last["start"] : last["end"]].tolist(), abs=1e-3)

