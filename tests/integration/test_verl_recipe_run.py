"""verl's GSM8K GRPO recipe trains one iteration on verl parquet with a verl scorer (rlstage train --verl)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tests_support import AR, GSM8K, VERL_QWEN2_7B_GRPO

# A reward file written as verl's custom_reward_function is: verl's signature, a dict with verl's extra keys.
VERL_SCORER = '''
import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    assert data_source == "openai/gsm8k", data_source
    found = re.findall(r"#### (-?[0-9.,]+)", solution_str)
    pred = found[-1].replace(",", "") if found else ""
    return {"score": float(pred == ground_truth), "acc": pred == ground_truth, "pred": pred}
'''


def _gsm8k_parquet(path: Path, rows: list[dict], split: str) -> Path:
    """Rows as verl's examples/data_preprocess/gsm8k.py writes them."""
    instruction = 'Let\'s think step by step and output the final answer after "####".'
    pq.write_table(
        pa.table({
            "data_source": ["openai/gsm8k"] * len(rows),
            "prompt": [[{"role": "user", "content": f"{r['question']} {instruction}"}] for r in rows],
            "ability": ["math"] * len(rows),
            "reward_model": [{"style": "rule", "ground_truth": r["answer"].split("#### ")[-1]} for r in rows],
            "extra_info": [{"split": split, "index": i} for i in range(len(rows))],
        }),
        path,
    )  # fmt: skip
    return path


def test_verls_grpo_recipe_trains_one_iteration_on_verl_parquet_with_a_verl_scorer(prefect_api, smollm2_path, tmp_path, capsys) -> None:
    from safetensors.torch import load_file

    from rlstage.flows.cli import main
    from rlstage.schemas.config import load_config
    from rlstage.tasks.runtime import store_for
    from tests_support import update_weights, weights_moved

    rows = [json.loads(line) for line in (GSM8K / "train.jsonl").read_text().splitlines()[:4]]
    train = _gsm8k_parquet(tmp_path / "train.parquet", rows[:2], "train")
    test = _gsm8k_parquet(tmp_path / "test.parquet", rows[2:], "test")
    scorer = tmp_path / "gsm8k_reward.py"
    scorer.write_text(VERL_SCORER)
    recipe = [k.format(train=train, test=test, model=smollm2_path) for k in VERL_QWEN2_7B_GRPO]
    scaled = [  # the recipe scaled to this machine by verl's own keys, then rlstage's own settings
        "data.train_batch_size=2", "data.max_prompt_length=256", "data.max_response_length=16", f"{AR}.rollout.n=2",
        f"{AR}.actor.ppo_mini_batch_size=2", f"{AR}.actor.ppo_micro_batch_size_per_gpu=2", f"{AR}.rollout.name=hf",
        f"{AR}.actor.optim.lr=1e-4", "trainer.total_training_steps=1", "trainer.save_freq=1", f"custom_reward_function.path={scorer}",
        "run_name=verl-gsm8k", f"store.root={tmp_path / 'store'}", "data.eval_size=2", "tracking.rollout_sample_rows=2",
    ]  # fmt: skip
    assert main(["train", "--verl", *recipe, *scaled]) == 0
    out = capsys.readouterr().out
    assert re.search(r"rlstage: verl recipe: \d+ settings mapped, 14 keys dropped, 4 rlstage settings as given", out)
    assert f"rlstage: verl dropped {AR}.rollout.tensor_model_parallel_size=2: model parallelism" in out
    assert "actor.ppo_mini_batch_size=4 (verl counts prompts, rlstage samples: x rollout.n=2)" in out
    cfg = load_config(None, ["run_name=verl-gsm8k", f"store.root={tmp_path / 'store'}"])
    store = store_for(cfg)
    reward = store.manifest("verl-gsm8k", 1, "reward")
    rewards = store.read_table(reward, "rewards.parquet").to_pylist()
    assert len(rewards) == 2 * 2 and all(r["error"] is None and r["reward_fn"] for r in rewards)  # the scorer ran on each
    extra = store.read_table(reward, "reward_extra.parquet")
    assert {"acc", "pred"} <= set(extra.column_names)  # its dict's keys, kept per sample as verl's reward_extra_info
    start = load_file(smollm2_path / "model.safetensors")
    trained = update_weights(store, "verl-gsm8k", 1)
    assert weights_moved({k: trained[k] for k in start if k in trained}, {k: start[k] for k in start if k in trained})

