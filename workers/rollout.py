"""The rollout role placed apart from the trainer (``ray.rollout_placement: separate``).

Its own copy of the policy weights and its own rollout engine, so generation can run while the trainer
trains. New weights come from the trainer in memory, on its node or another (``receive``: buckets through
Ray's object store, whole or as deltas, engines/rollout/weight_sync.py), written into this worker's model only
once the last bucket arrived; a version the trainer does not hold comes from the store (a pipelined run's, which
stores every update's weights) or its local path.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rlstage.engines.models.lora import save_hf
from rlstage.engines.plugins import load_plugins
from rlstage.engines.rollout.base import Completion, RolloutEngine, SamplingParams
from rlstage.engines.rollout.engines import build_rollout_engine, engine_traits
from rlstage.engines.rollout.weight_sync import Bucket, PushPlan, WeightReceiver
from rlstage.infra.drill import WorkerDrill
from rlstage.infra.store import ArtifactStore
from rlstage.schemas.config import RunConfig
from rlstage.schemas.manifest import PolicyRef
from rlstage.workers.policy import (
    MODEL_DIR,
    check_loadable,
    compute_device,
    load_policy_model,
    placed_where,
    preload_model_libraries,
    scratch_dir,
    torch_dtype,
    warm_binding,
)
from rlstage.workers.pool import Parkable

if TYPE_CHECKING:
    from rlstage.engines.agents.loop import AgentCompletion


class RolloutWorker(Parkable):
    def __init__(self, cfg_json: dict) -> None:
        # a warm worker restarted by Ray comes back with its creation's arguments: it serves the run bound last
        self.bind(*(warm_binding() or (cfg_json,)))

    def bind(self, cfg_json: dict) -> None:
        """Serve this run: a fresh worker's state, in a process that may have served another (workers/pool.py)."""
        self.cfg = RunConfig.model_validate(cfg_json)
        load_plugins(self.cfg.plugins)  # the entries the run's plugins register, in this process too
        torch.set_num_threads(self.cfg.model.torch_threads)
        self.store = ArtifactStore(self.cfg.store.root, self.cfg.store.storage_options, retries=self.cfg.store.retries)
        self.held: str | None = None
        # how the held weights arrived: "trainer" (in memory), "trainer-delta" (only what changed), "store" or "path"
        self.source: str | None = None
        self.receiver = WeightReceiver()
        self.received_bytes = 0
        self.tokenizer = None
        self.model = None
        self.rollout: RolloutEngine | None = None
        self.scratch = scratch_dir("rollout", self.cfg.run_name)
        self.busy: list[tuple[float, float]] = []  # (start, end) of each generate call, for overlap checks
        self.drill = WorkerDrill(self.cfg)
        preload_model_libraries(self.cfg)

    def reset(self) -> None:
        """Drop everything the run gave this worker (weights, engine, scratch): it waits for another."""
        self.close()
        self.tokenizer = self.model = self.rollout = self.held = self.source = None
        self.busy, self.receiver, self.received_bytes = [], WeightReceiver(), 0

    def pid(self) -> int:
        return os.getpid()

    def version(self, role: str = "policy") -> str | None:
        return self.held

    def arm(self, stage: str, iteration: int) -> None:
        self.drill.arm(stage, iteration)

    def acquire(self, ref_json: dict) -> str:
        """Hold ``ref``'s weights from its local path or the store (the trainer's come by ``receive``)."""
        ref = PolicyRef.model_validate(ref_json)
        if self.held == ref.version:
            return ref.version
        self.received_bytes = 0
        if ref.path is not None:
            path, self.source = Path(ref.path), "path"
        else:
            manifest = self.store.manifest(ref.run, ref.iteration, ref.stage)
            if manifest is None or manifest.artifact_id != ref.version:
                raise FileNotFoundError(f"checkpoint {ref.run}/iter-{ref.iteration}/{ref.stage} ({ref.version}) is not committed")
            check_loadable(manifest, self.store.artifact_dir(ref.run, ref.iteration, ref.stage))
            if not any(f.startswith(MODEL_DIR + "/") for f in manifest.files):
                raise FileNotFoundError(
                    f"policy {ref.version} of iteration {ref.iteration} has no stored weights and the trainer is on "
                    "another node (it lies between checkpoints of a run made with the rollout colocated)"
                )
            folder = self.scratch / "load"
            shutil.rmtree(folder, ignore_errors=True)
            path, self.source = Path(self.store.fetch_dir(manifest, MODEL_DIR, str(folder))), "store"
        # imported with the weights: a process that only creates this actor skips transformers
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokenizer.padding_side = "left"
        model, base = load_policy_model(self.cfg, self.store, ref, path, self.scratch, trainable=False)
        in_memory = engine_traits(self.cfg.rollout.engine).in_memory
        if base is not None:  # a LoRA checkpoint from the store: its adapter merged into its base
            model = model.merge_and_unload()
            if not in_memory:  # vLLM (any engine not in memory) starts from a folder of plain weights
                path = self.scratch / "merged"
                shutil.rmtree(path, ignore_errors=True)
                save_hf(model, self.tokenizer, path)
        # the HF engine generates on the actor's GPU; vLLM loads its own copy from the folder
        self.model = model.requires_grad_(False).to(compute_device() if in_memory else "cpu")
        self.rollout = build_rollout_engine(self.cfg, self.model, self.tokenizer, str(path), self.rollout)
        self.held = ref.version
        return ref.version

    def receive(self, plan: PushPlan | None, bucket: Bucket) -> bool:
        """One bucket of a push from the trainer (``plan`` with the first); whether it was the last."""
        if plan is not None:
            self.receiver.begin(plan)
        self.drill.point("weights")
        return self.receiver.stage(bucket)

    def receive_commit(self, ref_json: dict) -> str:
        """Hold the version whose push just arrived whole: written into this worker's model (one built from the
        push's config when it holds none), then into its engine."""
        ref, plan = PolicyRef.model_validate(ref_json), self.receiver.plan
        if plan is None or plan.version != ref.version:
            raise RuntimeError(f"no push of policy {ref.version} arrived")
        in_memory = engine_traits(self.cfg.rollout.engine).in_memory
        fresh = self.model is None
        if fresh:
            from transformers import AutoModelForCausalLM

            self.tokenizer = plan.tokenizer
            self.tokenizer.padding_side = "left"
            model = AutoModelForCausalLM.from_config(plan.config, dtype=torch_dtype(self.cfg))
            self.model = model.eval().requires_grad_(False).to(compute_device() if in_memory else "cpu")
        self.held = None  # weights being written are never served
        self.received_bytes = self.receiver.apply(self.model)
        if not fresh:
            self.rollout.load_weights(self.model)  # vLLM: shared-memory buckets to its core; HF shares the model
        else:
            path = ""
            if not in_memory:  # an engine that starts from a folder (vLLM): this worker's first weights, once
                path = str(self.scratch / "start")
                shutil.rmtree(path, ignore_errors=True)
                save_hf(self.model, self.tokenizer, path)
            self.rollout = build_rollout_engine(self.cfg, self.model, self.tokenizer, path, None)
        self.held, self.source = ref.version, "trainer-delta" if plan.delta else "trainer"
        return ref.version

    def _require(self, version: str) -> None:
        if self.held != version:
            raise RuntimeError(f"rollout worker holds policy version {self.held}, stage needs {version}")

    def generate_ids(self, version: str, prompt_ids: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Completions of rendered prompts (the stage renders chat messages with the policy's template)."""
        self._require(version)
        self.drill.point("rollout")
        t0 = time.time()
        out = self.rollout.generate_ids(prompt_ids, params)
        self.busy.append((t0, time.time()))
        return out

    def agent_generate(self, version: str, rows: list[dict], params: SamplingParams) -> tuple[list[AgentCompletion], dict]:
        self._require(version)
        self.drill.point("rollout")
        from rlstage.engines.agents.endpoint import run_agents

        return run_agents(self.rollout, self.cfg.agent, rows, params, self.cfg.data.source_settings, self.cfg.data.max_prompt_length)

    def busy_intervals(self) -> list[tuple[float, float]]:
        return list(self.busy)

    def info(self) -> dict:
        """Where this worker runs and how its weights arrived (recorded in the rollout manifest)."""
        return {**placed_where(), "weights": self.source, "weight_bytes": self.received_bytes}

    def close(self) -> None:
        if self.rollout is not None:
            self.rollout.close()
        shutil.rmtree(self.scratch, ignore_errors=True)
