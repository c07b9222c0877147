"""The long-lived model worker: keeps the policy (with its optimizer), the frozen reference
policy and the critic loaded across stages and iterations.

It runs as a Ray actor (see ``tasks.runtime``). Stages tell it which version of each role they
need; it reloads from the store only when its loaded version differs (after a restart, a
resume or a replay), so a killed actor costs a reload, never a wrong model.
"""

from __future__ import annotations

import copy
import io
import os
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

from engines.actor import TorchActor
from engines.critic import TorchCritic
from engines.rollout import HFRolloutEngine, SamplingParams
from schemas.config import RunConfig

ACTOR_STATE = "actor_state.pt"
ROLES = ("policy", "ref", "critic")
CRITIC_INIT = "critic-init:"  # a critic version made from a policy checkpoint plus a fresh value head


class PolicyWorker:
    def __init__(self, cfg_json: dict, total_steps: int) -> None:
        self.cfg = RunConfig.model_validate(cfg_json)
        torch.set_num_threads(self.cfg.model.torch_threads)
        self.total_steps = total_steps
        self.versions: dict[str, str | None] = dict.fromkeys(ROLES)
        self.tokenizer = None
        self.model = None
        self.actor: TorchActor | None = None
        self.rollout = None  # HFRolloutEngine or VLLMRolloutEngine (rollout.engine)
        self.ref_model = None
        self.critic: TorchCritic | None = None

    def pid(self) -> int:
        return os.getpid()

    def version(self, role: str = "policy") -> str | None:
        return self.versions[role]

    def load(self, version: str, files: dict[str, bytes] | None = None, path: str | None = None, role: str = "policy") -> None:
        """Load a role from a local HF directory or from checkpoint files (relpath -> bytes)."""
        state = None
        if files is not None:
            tmp = Path(tempfile.mkdtemp(prefix="rlstage-model-"))
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
        if self.tokenizer is None or role == "policy":
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            self.tokenizer.padding_side = "left"
        pad_id = self.tokenizer.pad_token_id
        if role == "policy":
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
            self.actor = self._new_actor(pad_id)
            if state is not None:
                self.actor.load_state_dict(state)
            self.rollout = self._rollout_engine(path)
        elif role == "ref":
            self.ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval().requires_grad_(False)
        elif role == "critic":
            torch.manual_seed(self.cfg.trainer.seed)  # the fresh value head is the same on every load
            # classifier_dropout=0: a deterministic value head, as verl's (HF's default is 0.1)
            config = AutoConfig.from_pretrained(path, num_labels=1)
            config.classifier_dropout = 0.0  # not every config class declares it, so set after loading
            model = AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=dtype).eval()
            self.critic = TorchCritic(model, self.cfg.critic, pad_id, self.total_steps)
            if state is not None and not version.startswith(CRITIC_INIT):
                self.critic.load_state_dict(state)
        else:
            raise ValueError(f"unknown role {role!r}; valid: {', '.join(ROLES)}")
        self.versions[role] = version

    def _new_actor(self, pad_id: int) -> TorchActor:
        """The train engine ``actor.engine`` names, training ``self.model`` (ZeRO-3: a copy of it)."""
        if self.cfg.actor.engine == "torch":
            return TorchActor(self.model, self.cfg.actor, pad_id, self.total_steps)
        import deepspeed  # lazy: only runs with actor.engine=deepspeed pay for the import

        from engines.actor_deepspeed import DeepSpeedActor

        deepspeed.utils.logger.setLevel("WARNING")  # its INFO lines would flood the Ray worker's log
        if isinstance(self.actor, DeepSpeedActor):
            self.actor.close()  # a reload (resume, replay): release the old engine; the process group stays
        if not torch.distributed.is_initialized():
            # This worker is a world of one. Values inherited from the driver's environment describe another
            # process (a reused MASTER_PORT is EADDRINUSE); DeepSpeedActor picks a free port when none is set.
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
            os.environ.pop("MASTER_PORT", None)
        # DeepSpeedActor skips the shm_comm op build. ZeRO-3 partitions the module it trains, while rollout
        # and checkpoints need whole weights: it trains a copy (_sync_policy_weights).
        train_model = copy.deepcopy(self.model) if self.cfg.actor.zero_stage == 3 else self.model
        return DeepSpeedActor(train_model, self.cfg.actor, pad_id, self.total_steps)

    def _sync_policy_weights(self) -> None:
        """After an update: ZeRO-3's gathered weights into the whole model (a no-op for other engines)."""
        engine = getattr(self.actor, "engine", None)
        if engine is not None and engine.module is not self.model:
            self.model.load_state_dict(self.actor.export_model())

    def _rollout_engine(self, path: str):
        """The ``rollout.engine`` for policy weights just loaded from ``path``.

        HF shares ``self.model``. A running vLLM engine takes the new weights in place (a resume or
        replay reloads the policy): starting one costs 15-60 s on CPU.
        """
        r = self.cfg.rollout
        if r.engine == "hf":
            return HFRolloutEngine(self.model, self.tokenizer, r.batch_size)
        from engines.rollout_vllm import VLLMRolloutEngine  # lazy: vllm is an optional extra

        if isinstance(self.rollout, VLLMRolloutEngine):
            self.rollout.load_weights(path)
            return self.rollout
        return VLLMRolloutEngine(
            path,
            self.tokenizer,
            dtype=self.cfg.model.dtype,
            seed=r.seed,
            kv_cache_bytes=r.vllm_kv_cache_bytes,
            enforce_eager=r.vllm_enforce_eager,
            max_num_seqs=r.vllm_max_num_seqs,
            cpu_threads_bind=r.vllm_cpu_threads_bind,
        )

    def _push_rollout_weights(self) -> None:
        """After an update: the trained weights into a separate rollout engine (HF shares the model)."""
        if hasattr(self.rollout, "load_weights"):
            self.rollout.load_weights(self.model)

    def close(self) -> None:
        """Call before ``ray.kill``: a vLLM engine killed with the actor leaves ~400 MB of /dev/shm/psm_* behind."""
        if hasattr(self.rollout, "close"):
            self.rollout.close()

    def _require(self, version: str, role: str = "policy") -> None:
        if self.versions[role] != version:
            raise RuntimeError(f"worker holds {role} version {self.versions[role]}, stage needs {version}")

    def generate(self, version: str, prompts: list[str], params: dict) -> list[dict]:
        self._require(version)
        return [asdict(c) for c in self.rollout.generate(prompts, SamplingParams(**params))]

    def generate_ids(self, version: str, prompt_ids: list[list[int]], params: dict) -> list[dict]:
        """Completions of prompts already rendered in this policy's tokens (engines.chat.render_prompt_ids)."""
        self._require(version)
        return [asdict(c) for c in self.rollout.generate_ids(prompt_ids, SamplingParams(**params))]

    def agent_generate(self, version: str, rows: list[dict], params: dict) -> tuple[list[dict], dict]:
        """Multi-turn tool-calling rollouts of prompts-table rows (``agent`` config); completions and timings."""
        self._require(version)
        from engines.agent_loop import run_agent_config

        return run_agent_config(self.rollout, self.cfg.agent, rows, SamplingParams(**params))

    def log_probs(self, version: str, prompt_ids: list, response_ids: list, temperature: float) -> list:
        self._require(version)
        return self.actor.compute_log_probs(prompt_ids, response_ids, temperature)

    def ref_log_probs(self, version: str, prompt_ids: list, response_ids: list, temperature: float) -> list:
        self._require(version, "ref")
        # The same batching and temperature as the actor's recompute, on the frozen weights.
        frozen = TorchActor.__new__(TorchActor)
        frozen.model, frozen.cfg, frozen.pad_id = self.ref_model, self.cfg.actor, self.tokenizer.pad_token_id
        return frozen.compute_log_probs(prompt_ids, response_ids, temperature)

    def values(self, version: str, prompt_ids: list, response_ids: list) -> list:
        self._require(version, "critic")
        return self.critic.compute_values(prompt_ids, response_ids)

    def update(
        self, version: str, batch: dict, temperature: float, seed: int, skip: bool = False, checkpoint: bool = True
    ) -> tuple[dict, dict[str, bytes]]:
        """One iteration's policy update (``skip`` during critic warm-up); returns metrics and, when
        ``checkpoint``, the checkpoint files (between checkpoints nothing is serialised)."""
        self._require(version)
        torch.manual_seed(seed)
        metrics = {"actor/skipped": 1.0} if skip else self.actor.update(batch, temperature, seed)
        self._sync_policy_weights()
        if not skip:
            self._push_rollout_weights()
        # The worker now holds an uncommitted policy until the task commits it and calls set_version.
        self.versions["policy"] = None
        return metrics, self._checkpoint(self.model, self.actor.state_dict()) if checkpoint else {}

    def critic_update(self, version: str, batch: dict, seed: int) -> tuple[dict, dict[str, bytes]]:
        self._require(version, "critic")
        torch.manual_seed(seed)
        metrics = self.critic.update(batch, seed)
        self.versions["critic"] = None
        return metrics, self._checkpoint(self.critic.model, self.critic.state_dict())

    def _checkpoint(self, model, state: dict) -> dict[str, bytes]:
        files: dict[str, bytes] = {}
        with tempfile.TemporaryDirectory(prefix="rlstage-ckpt-") as tmp:
            model.save_pretrained(tmp)
            self.tokenizer.save_pretrained(tmp)
            for p in sorted(Path(tmp).rglob("*")):
                if p.is_file():
                    files[f"model/{p.relative_to(tmp)}"] = p.read_bytes()
        buf = io.BytesIO()
        torch.save(state, buf)
        files[ACTOR_STATE] = buf.getvalue()
        return files

    def set_version(self, version: str, role: str = "policy") -> None:
        self.versions[role] = version
