"""Chunked log-probs (engines/training/lm_head.py) against the whole vocabulary's logits: the same log-probs,
entropy and sum of pi^2, the same gradients, the same weights after an optimizer step, in every input layout."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from rlstage.engines.models.tinykit import build_char_tokenizer, build_tiny_llama
from rlstage.engines.training.actor import TorchActor
from rlstage.engines.training.forward import model_inputs, response_log_probs
from rlstage.schemas.config import ActorConfig, ConfigError, KitConfig, load_config

KIT = KitConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
CHUNK = 7  # divides no micro-batch here: the last chunk is a short one


@pytest.fixture(scope="module")
def tok():
    torch.set_num_threads(1)
    return build_char_tokenizer()


def model_of(tok, head: str = "tied", seed: int = 0):
    torch.manual_seed(seed)
    model = build_tiny_llama(KIT, tok)
    if head == "bias":  # an untied output layer with a bias
        model.config.tie_word_embeddings = False
        model.lm_head = torch.nn.Linear(KIT.hidden_size, model.config.vocab_size, bias=True)
    return model.float()


def ragged(tok, n: int, seed: int = 0, same_prompts: bool = False) -> tuple[list, list]:
    rng = random.Random(seed)
    vocab = len(tok)
    prompts = [[rng.randrange(4, vocab) for _ in range(rng.randint(1, 9))] for _ in range(n)]
    if same_prompts:  # two samples a prompt, as GRPO's groups (the shared-prompt layout)
        prompts = [prompts[i // 2] for i in range(n)]
    responses = [[rng.randrange(4, vocab) for _ in range(rng.randint(1, 8))] for _ in range(n)]
    return prompts, responses


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _close(a: torch.Tensor, b: torch.Tensor, rel: float) -> bool:
    return (a - b).abs().max().item() <= rel * max(b.abs().max().item(), 1e-12)


@pytest.mark.invariant("chunked log-probs == whole-vocabulary log-probs", "log-probs, entropy and sum of pi^2 within 1e-6, every gradient within 1e-5 relative")
@pytest.mark.parametrize("layout", ["padded", "packed", "shared"])
@pytest.mark.parametrize("head", ["tied", "bias"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_log_probs_entropy_and_gradients_equal_the_whole_vocabularys(tok, layout, head, temperature):
    prompts, responses = ragged(tok, 6, same_prompts=layout == "shared")
    inputs = model_inputs(prompts, responses, tok.pad_token_id, packed=layout == "packed", shared=layout == "shared")
    out = {}
    for chunk in (None, CHUNK):
        model = model_of(tok, head)
        logp, entropy = response_log_probs(model, inputs, temperature, with_entropy=True, chunk_tokens=chunk)
        weights = torch.linspace(-1, 1, logp.numel()).view_as(logp)
        ((logp * weights).sum() + (entropy * weights.flip(-1)).sum()).backward()
        out[chunk] = (logp.detach(), entropy.detach(), _grads(model))
        with torch.no_grad():
            _, s2 = response_log_probs(model, inputs, temperature, with_sum_pi_squared=True, chunk_tokens=chunk)
        out[chunk] += (s2,)
    (lp, ent, grads, s2), (clp, cent, cgrads, cs2) = out[None], out[CHUNK]
    assert (clp - lp).abs().max() < 1e-6 and (cent - ent).abs().max() < 1e-6 and (cs2 - s2).abs().max() < 1e-6
    assert set(cgrads) == set(grads)
    for name, g in grads.items():
        assert _close(cgrads[name], g, 1e-5), name
    assert grads["model.embed_tokens.weight"].abs().sum() > 0


def test_a_metric_only_entropy_has_no_gradient_and_a_short_batch_takes_the_plain_path(tok):
    prompts, responses = ragged(tok, 6)
    inputs = model_inputs(prompts, responses, tok.pad_token_id, packed=False)
    model = model_of(tok)
    logp, entropy = response_log_probs(model, inputs, 1.0, with_entropy=True, entropy_grad=False, chunk_tokens=CHUNK)
    assert logp.requires_grad and not entropy.requires_grad
    # at most one chunk of positions: the whole logits hold no more than a chunk would
    whole = response_log_probs(model, inputs, 1.0, chunk_tokens=None)[0]
    one = response_log_probs(model, inputs, 1.0, chunk_tokens=inputs["input_ids"].numel())[0]
    assert torch.equal(one, whole)


def test_a_soft_capped_output_layer_keeps_the_plain_path_and_says_why(tok, caplog):
    prompts, responses = ragged(tok, 6)
    inputs = model_inputs(prompts, responses, tok.pad_token_id, packed=False)
    model = model_of(tok)
    model.config.final_logit_softcapping = 30.0  # a Gemma-2-style cap the chunks do not apply
    with caplog.at_level(logging.WARNING, logger="rlstage"):
        got = response_log_probs(model, inputs, 1.0, chunk_tokens=CHUNK)[0]
    assert torch.equal(got, response_log_probs(model, inputs, 1.0)[0])
    assert "soft-caps its final logits" in caplog.text


class GradRecordingActor(TorchActor):
    """A TorchActor that keeps the accumulated gradient of each optimizer step."""

    def _optimizer_step(self) -> float:
        self.grads = getattr(self, "grads", [])
        self.grads.append(torch.cat([p.grad.flatten() for p in self.model.parameters() if p.grad is not None]))
        return super()._optimizer_step()


@pytest.mark.invariant("chunked log-probs == whole-vocabulary log-probs", "every step's gradient within 1e-5 relative, weights within 1e-6, the loss within 1e-6 relative")
@pytest.mark.parametrize("mode", MODES)
def test_an_update_with_chunked_log_probs_accumulates_the_same_gradients(tok, mode):
    """Two optimizer steps of two micro-batches each, with an entropy bonus: each step's accumulated gradient and
    the weights after it agree across both paths."""
    prompts, responses = ragged(tok, 8, seed=3)
    rng = random.Random(4)
    batch = {
        "prompt_ids": prompts,
        "response_ids": responses,
        "response_mask": [[1] * len(r) for r in responses],
        "old_log_probs": [[-3.5 + rng.uniform(-0.5, 0.5) for _ in r] for r in responses],
        "advantages": [[rng.uniform(-1.5, 1.5)] * len(r) for r in responses],
    }
    runs = {}
    for chunk in (None, CHUNK):
        model = model_of(tok)
        start = {k: v.clone() for k, v in model.state_dict().items()}
        cfg = ActorConfig(ppo_mini_batch_size=4, micro_batch_size=2, loss_agg_mode=mode, entropy_coeff=0.01, logits_chunk_tokens=chunk)
        actor = GradRecordingActor(model, cfg, tok.pad_token_id, 10)
        metrics = actor.update(batch, 1.0, seed=0)
        runs[chunk] = ({k: v.clone() for k, v in model.state_dict().items()}, actor.grads, metrics)
    (w, grads, m), (cw, cgrads, cm) = runs[None], runs[CHUNK]
    assert len(grads) == len(cgrads) == 2
    for g, cg in zip(grads, cgrads, strict=True):
        assert _close(cg, g, 1e-5)
    assert max((w[k] - start[k]).abs().max().item() for k in w) > 1e-5  # the weights moved
    assert max((cw[k] - w[k]).abs().max().item() for k in w) < 1e-6
    assert abs(cm["actor/pg_loss"] - m["actor/pg_loss"]) <= 1e-6 * max(abs(m["actor/pg_loss"]), 1.0)
    assert abs(cm["actor/entropy"] - m["actor/entropy"]) < 1e-6


def test_a_chunk_of_no_tokens_is_one_line():
    with pytest.raises(ConfigError, match=r"actor\.logits_chunk_tokens"):
        load_config(None, ["actor.logits_chunk_tokens=0"])
