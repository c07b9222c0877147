"""The long-lived policy worker: keeps the model, tokenizer and optimizer loaded across stages.

It runs as a Ray actor (see ``tasks.runtime``). Stages tell it which policy version they need;
it reloads from the store only when its loaded version differs (after a restart, a resume or a
replay), so a killed actor costs a reload, never a wrong model.
"""

from __future__ import annotations

import io
import os
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engines.actor import TorchActor
from engines.rollout import HFRolloutEngine, SamplingParams
from schemas.config import RunConfig

ACTOR_STATE = "actor_state.pt"


class PolicyWorker:
    def __init__(self, cfg_json: dict, total_steps: int) -> None:
        self.cfg = RunConfig.model_validate(cfg_json)
        torch.set_num_threads(self.cfg.model.torch_threads)
        self.total_steps = total_steps
        self.loaded_version: str | None = None
        self.model = None
        self.tokenizer = None
        self.actor: TorchActor | None = None
        self.rollout: HFRolloutEngine | None = None

    def pid(self) -> int:
        return os.getpid()

    def version(self) -> str | None:
        return self.loaded_version

    def load(self, version: str, files: dict[str, bytes] | None = None, path: str | None = None) -> None:
        """Load a policy from a local HF directory or from checkpoint files (relpath -> bytes)."""
        state = None
        if files is not None:
            tmp = Path(tempfile.mkdtemp(prefix="rlstage-policy-"))
            for rel, data in files.items():
                dest = tmp / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(data)
            path = str(tmp / "model")
            if ACTOR_STATE in files:
                state = torch.load(io.BytesIO(files[ACTOR_STATE]), weights_only=False)
        if path is None or not Path(path).is_dir():
            raise FileNotFoundError(f"model path {path} does not exist or is not a directory")
        dtype = torch.bfloat16 if self.cfg.model.dtype == "bfloat16" else torch.float32
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokenizer.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        self.model.eval()
        self.actor = TorchActor(self.model, self.cfg.actor, self.tokenizer.pad_token_id, self.total_steps)
        if state is not None:
            self.actor.load_state_dict(state)
        self.rollout = HFRolloutEngine(self.model, self.tokenizer, self.cfg.rollout.batch_size)
        self.loaded_version = version

    def _require(self, version: str) -> None:
        if self.loaded_version != version:
            raise RuntimeError(f"policy worker holds version {self.loaded_version}, stage needs {version}")

    def generate(self, version: str, prompts: list[str], params: dict) -> list[dict]:
        self._require(version)
        return [asdict(c) for c in self.rollout.generate(prompts, SamplingParams(**params))]

    def log_probs(self, version: str, prompt_ids: list, response_ids: list, temperature: float) -> list:
        self._require(version)
        return self.actor.compute_log_probs(prompt_ids, response_ids, temperature)

    def update(self, version: str, batch: dict, temperature: float, seed: int) -> tuple[dict, dict[str, bytes]]:
        """One iteration's policy update; returns metrics and the new checkpoint's files."""
        self._require(version)
        torch.manual_seed(seed)
        metrics = self.actor.update(batch, temperature, seed)
        # The worker now holds an uncommitted policy until the task commits it and calls set_version.
        self.loaded_version = None
        return metrics, self.checkpoint_files()

    def checkpoint_files(self) -> dict[str, bytes]:
        files: dict[str, bytes] = {}
        with tempfile.TemporaryDirectory(prefix="rlstage-ckpt-") as tmp:
            self.model.save_pretrained(tmp)
            self.tokenizer.save_pretrained(tmp)
            for p in sorted(Path(tmp).rglob("*")):
                if p.is_file():
                    files[f"model/{p.relative_to(tmp)}"] = p.read_bytes()
        buf = io.BytesIO()
        torch.save(self.actor.state_dict(), buf)
        files[ACTOR_STATE] = buf.getvalue()
        return files

    def set_version(self, version: str) -> None:
        self.loaded_version = version
