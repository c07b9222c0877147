"""The examples of docs/extending.md: each plugin registers its entry and computes what its docstring says on a
tiny input, and the page includes every example file (its config trains: tests/integration/test_extending_run.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from rlstage.engines import algorithms as algos
from rlstage.engines.data import datasets
from rlstage.engines.preflight import check_registered_names
from rlstage.engines.registry import REGISTRIES
from rlstage.engines.rewards import rules
from rlstage.schemas.config import ConfigError, load_config
from tests_support import EXAMPLES, PLUGINS, REPO

CONFIG = EXAMPLES / "extended.yaml"


def _config(*overrides: str):
    """The page's config as the CLI loads it: the model, then its plugins and names against the registries."""
    cfg = load_config(str(CONFIG), list(overrides))
    check_registered_names(cfg)
    return cfg


def test_the_page_includes_every_example_file():
    page = (REPO / "docs" / "extending.md").read_text()
    included = set(re.findall(r'^--8<-- "examples/extending/([\w.]+)"$', page, re.M))
    shown = {p.name for p in EXAMPLES.iterdir() if p.suffix in (".py", ".yaml")}
    assert included == shown and set(PLUGINS) <= {Path(n).stem for n in shown}


def test_each_example_registers_its_entry(examples):
    cfg = _config()  # loads the plugins the config lists
    assert cfg.plugins == list(PLUGINS)
    for module, (kind, name) in PLUGINS.items():
        assert REGISTRIES[kind].entry(name).module == module
    assert rules.registered_fn("my_org/arith") == "digit_match"  # data_sources= of its decorator
    with pytest.raises(ConfigError, match=r"^config error: algorithm\.adv_estimator\.max_abs: Input should be greater than 0$"):
        _config("algorithm.adv_estimator={name: clipped_grpo, max_abs: 0}")
    with pytest.raises(ConfigError, match=r"^config error: actor\.policy_loss\.clip: ppo_l2 takes no clip \(its settings: clip_ratio, l2_coef\)$"):
        _config("actor.policy_loss={name: ppo_l2, clip: 0.2}")
    with pytest.raises(ConfigError, match=r"^config error: rollout\.n: .*needs groups"):
        _config("rollout.n=1", "actor.ppo_mini_batch_size=32", "actor.micro_batch_size=32")


def test_the_estimator_normalises_and_clips_within_each_group(examples):
    cfg = _config("algorithm.adv_estimator={name: clipped_grpo, max_abs: 0.5}")
    rewards = torch.tensor([[0.0, 2.0], [0.0, 0.0], [0.0, 1.0], [0.0, 3.0], [0.0, 5.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 0], [1, 1], [1, 1]])
    adv, returns = algos.compute_advantage(
        "clipped_grpo",
        token_level_rewards=rewards,
        response_mask=mask,
        index=["a", "a", "b", "b", "c"],
        settings=algos.adv_estimator_settings(cfg.algorithm.adv_estimator),
    )
    # group a: scores 2, 0 (mean 1, std 1.414): +-0.707, clipped to +-0.5; b: 1, 3 likewise; c alone: 0
    expected = torch.tensor([[0.5, 0.5], [-0.5, -0.5], [-0.5, 0.0], [0.5, 0.5], [0.0, 0.0]])
    assert torch.allclose(adv, expected) and torch.equal(adv, returns)


def test_the_loss_is_the_surrogate_plus_its_penalty(examples):
    cfg = _config()
    loss_fn = algos.get_policy_loss("ppo_l2")
    settings = algos.policy_loss_settings(cfg.actor.policy_loss).model_dump()
    log_prob = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    adv, mask = torch.tensor([[1.0, 1.0, 1.0]]), torch.tensor([[1, 1, 0]])
    loss, metrics = loss_fn(log_prob.detach(), log_prob, adv, mask, "token-mean", **settings)
    assert loss.item() == pytest.approx(-1.0) and metrics["ppo_l2/penalty"].item() == 0  # ratio 1: -A
    old = log_prob.detach() - torch.tensor([[0.1, 0.5, 0.0]])  # ratios e^0.1 (inside the clip) and e^0.5 (clipped)
    loss, metrics = loss_fn(old, log_prob, adv, mask, "token-mean", **settings)
    surrogate = (-torch.tensor(0.1).exp() - 1.2) / 2
    assert loss.item() == pytest.approx((surrogate + 0.1 * (0.01 + 0.25) / 2).item(), rel=1e-5)
    assert metrics["pg_clipfrac"].item() == pytest.approx(0.5)
    loss.backward()
    assert log_prob.grad[0, 2] == 0 and log_prob.grad[0, 0] != 0  # off the mask: no gradient; clipped: the penalty's


def test_the_reward_scores_in_the_sandboxed_scorer_by_name_and_by_data_source(examples):
    _config()
    rows = [
        {"response_text": "80</s>", "ground_truth": "80", "data_source": "my_org/arith", "extra_info": "{}"},
        {"response_text": "81 and more", "ground_truth": "80", "data_source": "my_org/arith", "extra_info": "{}"},
        {"response_text": "", "ground_truth": "153", "data_source": "my_org/arith", "extra_info": "{}"},
    ]
    for function in ("digit_match", None):  # named by reward.function, or picked by the rows' data_source
        scored = rules.score_batch(rows, timeout_s=30, function=function)
        assert [r.error for r in scored] == [None] * 3
        assert [r.score for r in scored] == pytest.approx([1.0, 0.45, 0.0])
        assert [r.metrics for r in scored] == [{"acc": 1.0}, {"acc": 0.0}, {"acc": 0.0}]
        assert {r.reward_fn for r in scored} == {"digit_match"}
    assert rules.correct_at("digit_match") == 1.0


def test_the_data_source_reads_the_csv_files(examples, tmp_path):
    cfg = _config()
    train, test = datasets.prepare_splits(
        cfg.data.source, str(REPO / cfg.data.train_path), str(REPO / cfg.data.test_path), cfg.data.source_settings
    )
    assert (train.num_rows, test.num_rows) == (200, 40)
    first = train.slice(0, 1).to_pylist()[0]
    assert first == {
        "prompt_id": "csv-train-0",
        "prompt": "What is 51+29? ",
        "messages": None,
        "data_source": "my_org/arith",
        "ground_truth": "80",
        "extra_info": json.dumps({"split": "train", "index": 0}),
    }
    bad = tmp_path / "bad.csv"
    bad.write_text("question,answer\nWhat is 1+1? ,\n")
    with pytest.raises(datasets.DatasetError, match=r"bad\.csv: row 1 has no 'question' or no 'answer'$"):
        datasets.load_prompts("csv_qa", str(bad))
    chat = datasets.load_prompts("csv_qa", str(REPO / cfg.data.test_path), chat=True)
    assert chat.column("messages")[0].as_py() == [{"role": "user", "content": "What is 66+51? "}]


def test_the_rollout_engine_samples_n_seeded_completions_a_prompt_with_their_log_probs(examples):
    from rlstage.engines.models.tinykit import build_char_tokenizer, build_tiny_llama
    from rlstage.engines.rollout.base import SamplingParams
    from rlstage.engines.rollout.engines import build_rollout_engine, engine_traits
    from rlstage.schemas.config import KitConfig

    cfg = _config()
    assert engine_traits("plain_sampler").in_memory
    tok = build_char_tokenizer()
    model = build_tiny_llama(KitConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), tok)
    engine = build_rollout_engine(cfg, model, tok, "unused")
    prompts = [tok(q, add_special_tokens=False)["input_ids"] for q in ("What is 1+2? ", "What is 3+4? ")]
    params = SamplingParams(n=3, max_new_tokens=5, seed=7, first_prompt=4)
    got = engine.generate_ids(prompts, params)
    assert [(c.prompt_index, c.sample_index) for c in got] == [(p, k) for p in (4, 5) for k in range(3)]
    for c in got:
        assert len(c.response_ids) == len(c.log_probs) <= 5 and all(lp <= 0 for lp in c.log_probs)
        assert (c.finish_reason == "stop") == (c.response_ids[-1] in engine.stops)
    assert [c.response_ids for c in engine.generate_ids(prompts, params)] == [c.response_ids for c in got]  # seeded
    # the second prompt alone, at its place in the batch, samples as it did beside the first
    alone = engine.generate_ids(prompts[1:], SamplingParams(n=3, max_new_tokens=5, seed=7, first_prompt=5))
    assert [c.response_ids for c in alone] == [c.response_ids for c in got[3:]]
