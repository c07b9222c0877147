"""The compute engines on the tiny kit: tokenizer, rollout log-probs, PPO update, SFT, cursor."""

import pytest
import torch

from rlstage.engines.data import datasets
from rlstage.engines.data.cursor import prompt_batch
from rlstage.engines.models.tinykit import build_char_tokenizer, build_tiny_llama, save_model_dir
from rlstage.engines.rollout.hf import HFRolloutEngine, SamplingParams
from rlstage.engines.training.actor import TorchActor
from rlstage.engines.training.sft import sft_train
from rlstage.schemas.config import ActorConfig, KitConfig, OptimConfig
from tests_support import REPO


@pytest.fixture(scope="module")
def kit():
    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    model = build_tiny_llama(KitConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), tok)
    return tok, model


def test_tokenizer_round_trip_and_save(tmp_path, kit):
    tok, model = kit
    text = 'What is 23+58? 81 <tool_call>{"a": 1}</tool_call>'
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per character
    assert tok.decode(ids) == text
    save_model_dir(model, tok, tmp_path / "m")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok2 = AutoTokenizer.from_pretrained(tmp_path / "m")
    assert tok2(text, add_special_tokens=False)["input_ids"] == ids
    m2 = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert torch.equal(m2.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_rollout_log_probs_match_trainer_recompute(kit):
    tok, model = kit
    eng = HFRolloutEngine(model, tok, batch_size=5)
    comps = eng.generate(["What is 1+2? ", "What is 10+20? ", "Hi "], SamplingParams(n=3, temperature=0.7, seed=3))
    assert len(comps) == 9
    assert {(c.prompt_index, c.sample_index) for c in comps} == {(i, k) for i in range(3) for k in range(3)}
    actor = TorchActor(model, ActorConfig(micro_batch_size=4, ppo_mini_batch_size=4), tok.pad_token_id, 10)
    recomputed = actor.compute_log_probs([c.prompt_ids for c in comps], [c.response_ids for c in comps], 0.7)
    for c, lp in zip(comps, recomputed, strict=True):
        assert len(lp) == len(c.response_ids) == len(c.log_probs)
        assert max(abs(a - b) for a, b in zip(c.log_probs, lp, strict=True)) < 1e-4
        if c.finish_reason == "stop":
            assert c.response_ids[-1] == tok.eos_token_id
        else:
            assert len(c.response_ids) == 8


def test_rollout_is_seeded(kit):
    tok, model = kit
    eng = HFRolloutEngine(model, tok)
    a = eng.generate(["What is 1+2? "], SamplingParams(n=4, seed=5))
    b = eng.generate(["What is 1+2? "], SamplingParams(n=4, seed=5))
    c = eng.generate(["What is 1+2? "], SamplingParams(n=4, seed=6))
    assert [x.response_ids for x in a] == [x.response_ids for x in b]
    assert [x.response_ids for x in a] != [x.response_ids for x in c]


def wide_forwards(model, run) -> list[tuple[int, int]]:
    """(rows, width) of every forward of ``run()`` over more than one position: the prefills (a decoding step
    runs one position per row)."""
    seen: list[tuple[int, int]] = []

    def record(_module, args, kwargs):
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        if ids.shape[1] > 1:
            seen.append(tuple(ids.shape))

    hook = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        run()
    finally:
        hook.remove()
    return seen


@pytest.mark.parametrize("temperature", [0.0, 0.7], ids=["greedy", "sampled"])
def test_shared_prefill_samples_as_the_plain_engine(kit, temperature):
    """``rollout.share_prompts``: each distinct prompt of a generate batch is prefilled once, and the samples,
    their log-probs and their seeds are the plain engine's (left-padded prompts of unequal lengths; a batch of 6
    that cuts after two prompts' 3 samples)."""
    tok, model = kit
    prompts = ["What is 1+2? ", "What is 10+20? ", "Hi "]
    params = SamplingParams(n=3, temperature=temperature, seed=4)
    got: dict[bool, list] = {}
    wide = {
        share: wide_forwards(model, lambda share=share: got.setdefault(share, HFRolloutEngine(model, tok, 6, share).generate(prompts, params)))
        for share in (False, True)
    }  # fmt: skip
    P = [len(p) for p in prompts]
    assert wide[False] == [(6, max(P[:2])), (3, P[2])]
    assert wide[True] == [(2, max(P[:2]) - 1), (1, P[2] - 1)]  # all but the last prompt token, once per prompt
    assert [c.response_ids for c in got[True]] == [c.response_ids for c in got[False]]
    for a, b in zip(got[True], got[False], strict=True):
        assert max(abs(x - y) for x, y in zip(a.log_probs, b.log_probs, strict=True)) < 1e-5
    # one sample per prompt (the greedy eval): nothing to share, the plain path
    single = SamplingParams(n=1, temperature=0)
    assert wide_forwards(model, lambda: HFRolloutEngine(model, tok, 6, True).generate(prompts, single)) == [(3, max(P))]


def test_ppo_update_raises_probability_of_positive_advantage(kit):
    tok, model = kit
    model = build_tiny_llama(KitConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), tok)
    cfg = ActorConfig(ppo_mini_batch_size=2, micro_batch_size=1, ppo_epochs=4, optim=OptimConfig(lr=1e-2))
    actor = TorchActor(model, cfg, tok.pad_token_id, 100)
    p = tok("What is 1+1? ", add_special_tokens=False)["input_ids"]
    good, bad = tok("2", add_special_tokens=False)["input_ids"], tok("7", add_special_tokens=False)["input_ids"]
    old = actor.compute_log_probs([p, p], [good, bad], 1.0)
    batch = {
        "prompt_ids": [p, p],
        "response_ids": [good, bad],
        "response_mask": [[1], [1]],
        "old_log_probs": old,
        "advantages": [[1.0], [-1.0]],
    }
    metrics = actor.update(batch, 1.0, seed=0)
    new = actor.compute_log_probs([p, p], [good, bad], 1.0)
    assert new[0][0] > old[0][0] and new[1][0] < old[1][0]
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm", "actor/lr"):
        assert key in metrics
    assert metrics["actor/pg_clipfrac"] > 0  # 4 epochs at lr 1e-2 leave the trust region


def test_sft_lowers_loss_and_stops_early(kit):
    tok, _ = kit
    model = build_tiny_llama(KitConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), tok)
    train, _ = datasets.make_addition_splits(1, 60, 10, 0)
    ex = list(zip(train.column("prompt").to_pylist(), train.column("ground_truth").to_pylist(), strict=True))
    losses = sft_train(model, tok, ex, steps=60, batch_size=16, lr=3e-3)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5
    stopped = sft_train(model, tok, ex, steps=60, batch_size=16, lr=3e-3, should_stop=lambda s, _l: s == 7)
    assert len(stopped) == 7


def test_prompt_batch_is_a_deterministic_epoch_permutation():
    seen = []
    for it in range(1, 6):
        b = prompt_batch(10, it, 4, seed=1)
        assert b == prompt_batch(10, it, 4, seed=1)
        seen += b
    assert sorted(seen[:10]) == list(range(10))  # the first epoch covers every prompt once
    assert sorted(seen[10:20]) == list(range(10))
    assert prompt_batch(10, 1, 4, seed=1) != prompt_batch(10, 1, 4, seed=2)
    with pytest.raises(ValueError):
        prompt_batch(0, 1, 4, seed=0)


ROLLOUT_PEAK = """
import resource, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
sys.path.insert(0, "bench")
from gpu_check import id_tokenizer
from rlstage.engines.rollout.hf import HFRolloutEngine, SamplingParams

V = 16384
tok = id_tokenizer(V)
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
engine = HFRolloutEngine(LlamaForCausalLM(cfg), tok, batch_size=16)
prompts = [[5 + i, 6 + i, 7 + i] for i in range(16)]
engine.generate_ids(prompts, SamplingParams(max_new_tokens=2))  # libraries' first allocations
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = engine.generate_ids(prompts, SamplingParams(max_new_tokens=128))
assert all(len(c.log_probs) == len(c.response_ids) for c in out)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def test_hf_rollout_memory_does_not_grow_with_response_length_times_vocabulary():
    """Found by the GPU check's memory model: ``generate(output_logits=True)`` kept every step's fp32 logits,
    B x T x V x 4 bytes (here 16 x 128 x 16,384: 128 MiB, and three times that once stacked and normalised; 40 GB
    at Qwen2-0.5B's 64 x 512 tokens); the engine keeps one step's log-softmax (1 MiB here). Large blocks are
    mapped and unmapped one by one (a fixed malloc threshold), so the peak RSS follows what is alive."""
    import os
    import subprocess
    import sys

    root = REPO
    env = {
        **os.environ,
        "MALLOC_MMAP_THRESHOLD_": "131072",
    }  # glibc would otherwise keep freed blocks at random
    out = subprocess.run(
        [sys.executable, "-c", ROLLOUT_PEAK], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    grew_mib = int(out.stdout.split()[-1])
    assert grew_mib < 64, (
        f"peak RSS grew {grew_mib} MiB while generating 16 x 128 tokens over a 16k vocabulary"
    )
