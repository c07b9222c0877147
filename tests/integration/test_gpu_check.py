"""bench/gpu_check.py on the CPU with tiny shapes (CI's guard that the prepared GPU check keeps running between
device loans), its refusals, and bench/memory_model.py's parameter counts against the models they describe."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests_support import REPO

ROOT = REPO
sys.path.insert(0, str(ROOT / "bench"))

from memory_model import SHAPES  # noqa: E402


def check(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--out", str(out), *args],
        cwd=ROOT,
        # a rank's variables another test left in this worker: the check is one process whatever they say
        env={**os.environ, "WORLD_SIZE": "2", "RANK": "1", "MASTER_PORT": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc, json.loads(out.read_text())


def test_cpu_smoke_runs_every_section_it_can(tmp_path):
    proc, report = check(tmp_path, "--device", "cpu", "--tiny")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert set(report["sections"]) == {"peak", "correctness", "speed", "deepspeed", "update_paths", "weight_push"}, report["skipped"]
    assert [s["what"] for s in report["skipped"]] == ["largest"]  # needs CUDA's memory statistics
    corr = report["sections"]["correctness"]
    assert corr["passed"] and corr["weights_moved_max_abs"] > 0
    assert corr["rollout_greedy_same_share"] == 1.0
    assert 0 < corr["bf16"]["log_prob_gap_max"] < 0.1 and corr["bf16"]["update_loss_finite"]
    speed = report["sections"]["speed"]
    assert [r["batch"] for r in speed["rollout"]] == [4, 8]
    for row in [*speed["rollout"], speed["update"]]:
        assert row["engine_tokens_per_s"] > 0 and row["raw_tokens_per_s"] > 0 and row["engine_over_raw"] > 0
    ds = report["sections"]["deepspeed"]  # ZeRO-2 takes the torch engine's step
    assert ds["tiny_fp32_vs_torch_engine"]["weights_max_abs_over_lr"] < 0.05
    assert ds["torch"]["tokens_per_s"] > 0 and ds["deepspeed_zero2"]["tokens_per_s"] > 0
    paths = report["sections"]["update_paths"]["tiny-qwen2"]  # whole-vocabulary logits against chunks of them
    assert {p: paths[p]["micro_batch"] for p in ("plain", "chunked")} == {"plain": 2, "chunked": 2}
    assert all(paths[p]["tokens_per_s"] > 0 for p in ("plain", "chunked"))
    push = report["sections"]["weight_push"]  # to a second process (a Ray actor), in memory
    assert push["receiver_equal"] and push["whole"]["bytes"] > 0 and 0 < push["delta"]["bytes"] <= push["whole"]["bytes"]
    assert report["meta"]["torch"] == torch.__version__


@pytest.mark.parametrize(
    ("device", "says"),
    [("tpu", "unknown device 'tpu'"), ("meta", "not one this check knows"), ("cuda", "sees no CUDA device")],
)
def test_a_device_it_cannot_use_is_one_line_and_recorded(tmp_path, capsys, device, says):
    import gpu_check

    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--device", device, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and says in err
    report = json.loads(out.read_text())
    assert report["sections"] == {} and says in report["skipped"][0]["why"]


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_the_paper_model_counts_the_parameters_of_the_shape_it_names(name):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    s = SHAPES[name]
    config = Qwen2Config(
        vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate, num_hidden_layers=s.layers,
        num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, tie_word_embeddings=s.tied,
    )  # fmt: skip
    with torch.device("meta"):  # shapes only: a 7B model costs nothing here
        model = Qwen2ForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == s.params()
