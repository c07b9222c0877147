"""The policy worker: one Ray actor holding the colocated roles of a run — the policy with its
optimizer and rollout engine, the frozen reference policy and the critic.

Weights never leave it as bytes. It reads checkpoints from the store itself (``acquire``), trains,
stages the new checkpoint in a local folder and writes it to the store itself (``commit``); stage
tasks pass references (``PolicyRef``, manifests) and get back metrics, log-probs and manifests.
Checkpoints are Hugging Face safetensors folders plus a pickle-free trainer state
(``engines.training.checkpoint``), so a store others can write cannot run code here.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import torch

from rlstage.engines import algorithms as algos
from rlstage.engines.models.lora import (
    base_ref,
    is_adapter_dir,
    load_adapters,
    save_adapters,
    save_hf,
    with_adapters,
)
from rlstage.engines.plugins import load_plugins
from rlstage.engines.rollout.base import Completion, RolloutEngine, SamplingParams
from rlstage.engines.rollout.engines import build_rollout_engine, engine_traits
from rlstage.engines.rollout.weight_sync import Bucket, PushPlan, WeightSender
from rlstage.engines.training.actor import DataParallelTorchActor, TorchActor
from rlstage.engines.training.checkpoint import load_trainer_state, save_trainer_state
from rlstage.engines.training.critic import TorchCritic
from rlstage.infra.drill import WorkerDrill, fault_point, hold_point
from rlstage.infra.env import pid_alive
from rlstage.infra.store import ArtifactCorrupt, ArtifactStore
from rlstage.schemas.config import ConfigError, RunConfig
from rlstage.schemas.manifest import (
    MODEL_DIR,
    STATE_DIR,
    FileEntry,
    Manifest,
    PolicyRef,
    state_shard_dir,
    state_shards,
    unsafe_checkpoint_file,
)
from rlstage.workers.pool import Parkable, binding

if TYPE_CHECKING:
    from rlstage.engines.agents.loop import AgentCompletion

ROLES = ("policy", "ref", "critic")
CRITIC_INIT = "critic-init:"  # a critic version made from a policy checkpoint plus a fresh value head


def check_loadable(manifest: Manifest, where: str) -> None:
    """Refuse a checkpoint holding a file whose loading could run code (one line naming it)."""
    if reason := unsafe_checkpoint_file(manifest, where):
        raise ConfigError(reason)


def iteration_seed(seed: int, iteration: int) -> int:
    """The seed of one iteration's update (policy and critic): the same on every rerun."""
    return seed * 1_000_003 + iteration


def update_batch(exp: pa.Table, columns: tuple[str, ...]) -> dict[str, list]:
    """The columns of an experience table the trainer reads, as lists."""
    return {c: exp.column(c).to_pylist() for c in columns}


def fetch_model(store: ArtifactStore, ref: PolicyRef, folder: Path) -> Path:
    """The Hugging Face folder of a policy on this machine: a local path as is, a checkpoint fetched into ``folder``
    (reused when already there)."""
    if ref.path is not None:
        return Path(ref.path)
    if folder.is_dir():
        return folder
    manifest = store.manifest(ref.run, ref.iteration, ref.stage)
    if manifest is None or manifest.artifact_id != ref.version.removeprefix(CRITIC_INIT):
        raise FileNotFoundError(f"checkpoint {ref.run}/iter-{ref.iteration}/{ref.stage} ({ref.version}) is not committed")
    check_loadable(manifest, store.artifact_dir(ref.run, ref.iteration, ref.stage))
    return Path(store.fetch_dir(manifest, MODEL_DIR, str(folder)))


def torch_dtype(cfg: RunConfig) -> torch.dtype:
    return torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32


def preload_model_libraries(cfg: RunConfig) -> None:
    """Import what loading a model needs when a worker starts: actors start as the flow does its data prep,
    so the first stage that loads a model does not wait the ~3 s (transformers, peft) on its own path."""
    from transformers import AutoModelForCausalLM  # noqa: F401

    if cfg.model.lora:
        import peft  # noqa: F401


def compute_device() -> torch.device:
    """The GPU Ray gave this actor (``num_gpus``: it sets CUDA_VISIBLE_DEVICES), else the CPU."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def load_policy_model(cfg: RunConfig, store: ArtifactStore, ref: PolicyRef, path: Path, scratch: Path, trainable: bool):
    """The policy in ``path`` and the base it trains on: a LoRA checkpoint's adapter on its base (fetched by
    its reference into ``scratch``), a plain folder as is, given fresh adapters when ``model.lora_rank`` > 0 and
    ``trainable``. Returns (model, the base's ref or None)."""
    from transformers import AutoModelForCausalLM

    lora = cfg.model.lora
    if is_adapter_dir(path):
        base = base_ref(path)
        if trainable and not lora:
            raise ConfigError(f"config error: model.lora_rank: {ref.version} is a LoRA adapter; resume it with model.lora_rank > 0")
        base_dir = fetch_model(store, base, scratch / f"base-{base.version}")
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch_dtype(cfg))
        return load_adapters(model, path, trainable, cfg.model if trainable else None).eval(), base
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(cfg)).eval()
    if lora and trainable:
        # The adapters' A matrices are drawn at random: from the run's seed, so that a rerun or a replay of the first
        # update draws the same ones whatever the process ran before (the global RNG is left as it was).
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.trainer.seed)
            return with_adapters(model, cfg.model).eval(), ref
    return model, None


def warm_binding() -> tuple | None:
    """The run a warm actor (workers/pool.py) was bound to last, as its constructor's arguments (None: a cold one)."""
    import ray

    if not ray.is_initialized():  # built outside Ray (a test, a bench): a plain object, never warm
        return None
    return binding(ray.get_runtime_context().get_actor_name())


SCRATCH = re.compile(r"^rlstage-(?:worker|rollout)-p(\d+)-")


def every_rank_generates(cfg: RunConfig) -> bool:
    """Whether colocated generation runs on every data-parallel rank, each a share of the prompts (verl's rollout
    is data parallel too): the HF engine over a rank's whole policy (ZeRO 0-2). Under ZeRO-3 the other ranks keep
    a partition only, and a vLLM engine is started once, on rank 0."""
    zero3 = cfg.actor.engine == "deepspeed" and cfg.actor.zero_stage == 3
    return cfg.ray.rollout_placement == "colocated" and engine_traits(cfg.rollout.engine).in_memory and not zero3


def scratch_root() -> Path:
    """Where workers keep their temporary folders: ``RLSTAGE_SCRATCH_DIR`` (a test process gives its own workers
    one of their own, so it sees only what they left), else the system's temporary folder."""
    return Path(os.environ.get("RLSTAGE_SCRATCH_DIR") or tempfile.gettempdir())


def scratch_dir(kind: str, run: str) -> Path:
    """A worker's temporary folder, named with its pid. A SIGKILLed worker never removes its own, so each
    new worker removes those of workers no longer alive on this node."""
    root = scratch_root()
    root.mkdir(parents=True, exist_ok=True)
    for old in root.glob("rlstage-*-p*-*"):
        found = SCRATCH.match(old.name)
        if found and old.is_dir() and not pid_alive(int(found.group(1))):
            shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"rlstage-{kind}-p{os.getpid()}-{run}-", dir=root))


def node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def placed_where() -> dict:
    """This actor's node and process, and the GPUs Ray gave it (its bundle's, in a placement group)."""
    import ray

    gpus = ray.get_gpu_ids()
    return {"node": node_id(), "pid": os.getpid(), **({"gpus": [str(g) for g in gpus]} if gpus else {})}


def _checkpoint_name(ref: PolicyRef) -> str:
    return f"checkpoint {ref.run}/{'data' if ref.iteration is None else f'iter-{ref.iteration}'}/{ref.stage}"


@contextmanager
def stored_bytes(what: str) -> Iterator[None]:
    """Loading files the store verified against their manifest: what fails to parse there (a safetensors header, a
    config's JSON, a file of another type under a weights name) is a corrupt artifact, one line naming it (exit 2 in
    the command, from whichever worker), not a traceback."""
    from safetensors import SafetensorError

    try:
        yield
    except ArtifactCorrupt:
        raise
    except (SafetensorError, OSError, ValueError, KeyError, EOFError) as err:
        problem = " ".join(str(err).split())[:300]
        raise ArtifactCorrupt(f"{what}: its stored files match the manifest but do not load: {type(err).__name__}: {problem}") from None


class PolicyWorker(Parkable):
    """Rank 0 holds every colocated role; ranks 1..N-1 (``ray.trainer_world_size``) only train the policy."""

    def __init__(self, cfg_json: dict, total_steps: int, rank: int = 0, world_size: int = 1) -> None:
        # a warm worker restarted by Ray comes back with its creation's arguments: it serves the run bound last
        self.bind(*(warm_binding() or (cfg_json, total_steps, rank, world_size)))

    def bind(self, cfg_json: dict, total_steps: int, rank: int = 0, world_size: int = 1) -> None:
        """Serve this run: a fresh worker's state, in a process that may have served another (workers/pool.py)."""
        self.cfg = RunConfig.model_validate(cfg_json)
        load_plugins(self.cfg.plugins)  # the entries the run's plugins register, in this process too
        self.rank, self.world_size = rank, world_size
        self.pending = False  # holds trained weights that a commit (on rank 0) has not named yet
        torch.set_num_threads(self.cfg.model.torch_threads)
        self.store = ArtifactStore(self.cfg.store.root, self.cfg.store.storage_options, retries=self.cfg.store.retries)
        self.total_steps = total_steps
        self.versions: dict[str, str | None] = dict.fromkeys(ROLES)
        self.tokenizer = None
        self.model = None
        self.actor: TorchActor | None = None
        self.rollout: RolloutEngine | None = None  # rollout.engine's, where this rank generates
        self.ref_model = None
        self.base: PolicyRef | None = None  # a LoRA policy's base (its reference policy), else None
        self.critic: TorchCritic | None = None
        self.sender: WeightSender | None = None  # the policy's pushes to a rollout role placed apart
        # Checkpoints fetched from the store and checkpoints waiting to be committed: removed on close.
        self.scratch = scratch_dir("worker", self.cfg.run_name)
        self.staged: dict[str, Path] = {}
        self.busy: list[tuple[float, float]] = []  # (start, end) of each update, for overlap checks
        self.drill = WorkerDrill(self.cfg)
        preload_model_libraries(self.cfg)

    def reset(self) -> None:
        """Drop everything the run gave this worker (weights, engines, optimizer, scratch, a data-parallel rank's
        process group): it waits for another."""
        actor = self.actor
        self.close()
        if actor is not None:
            actor.close()
        self._leave_group()
        self.tokenizer = self.model = self.actor = self.rollout = self.ref_model = self.critic = self.base = None
        self.sender = None
        self.versions = dict.fromkeys(ROLES)
        self.staged, self.busy, self.pending = {}, [], False

    def pid(self) -> int:
        return os.getpid()

    def busy_intervals(self) -> list[tuple[float, float]]:
        return list(self.busy)

    def info(self) -> dict:
        """Where this worker runs (recorded in the manifests of the stages it served)."""
        return {**placed_where(), "rank": self.rank}

    def version(self, role: str = "policy") -> str | None:
        return self.versions[role]

    def arm(self, stage: str, iteration: int) -> None:
        self.drill.arm(stage, iteration)

    # ------------------------------------------------------------------ the version protocol
    def rendezvous(self) -> tuple[str, int]:
        """A free port on this node for a new data-parallel process group (called on rank 0)."""
        import ray

        from rlstage.infra.env import free_port

        addr = ray.util.get_node_ip_address()
        return addr, free_port(host=addr)

    def join(self, addr: str, port: int) -> None:
        """Start over in a new process group (all ranks at once): the policy is loaded again after this."""
        if self.actor is not None:
            self.actor.close()
        self._leave_group()
        self.actor, self.versions["policy"], self.pending = None, None, False
        os.environ.update(
            RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK="0", MASTER_ADDR=addr, MASTER_PORT=str(port)
        )

    def _leave_group(self) -> None:
        """End this process's data-parallel process group, if it is in one (the next run or group joins a new one)."""
        if not torch.distributed.is_initialized():
            return
        if self.cfg.actor.engine == "deepspeed":
            import deepspeed  # its group holds DeepSpeed's own state too

            deepspeed.comm.destroy_process_group()
        else:
            torch.distributed.destroy_process_group()

    def adopt(self, version: str) -> bool:
        """Name the weights this rank just trained with the version rank 0 committed (False: it holds none)."""
        if self.pending:
            self.versions["policy"], self.pending = version, False
        return self.versions["policy"] == version

    def acquire(self, ref_json: dict, role: str = "policy", update_hash: str | None = None) -> str:
        """Hold version ``ref`` in ``role`` (a no-op when already held); returns the version.

        A committed checkpoint is read from the store; a local model folder (``path:``) directly. A
        policy committed between checkpoints is rebuilt by re-running its updates from the stored
        experience, which is only valid under the same update settings (``update_hash``).
        """
        ref = PolicyRef.model_validate(ref_json)
        if self.versions[role] == ref.version:
            return ref.version
        if role == "ref" and self.cfg.model.lora:
            self.versions[role] = ref.version  # the policy's base with its adapters disabled: nothing to load
            return ref.version
        if ref.path is not None:
            self._load(ref, Path(ref.path), None, role)
            return ref.version
        manifest = self.store.manifest(ref.run, ref.iteration, ref.stage)
        wanted = ref.version.removeprefix(CRITIC_INIT)
        if manifest is None or manifest.artifact_id != wanted:
            raise FileNotFoundError(f"checkpoint {ref.run}/iter-{ref.iteration}/{ref.stage} ({wanted}) is not committed")
        if role in ("policy", "critic") and manifest.meta.get("between_checkpoints"):
            self._rebuild(manifest, update_hash, role)
            return ref.version
        folder = self.scratch / f"load-{role}"
        shutil.rmtree(folder, ignore_errors=True)
        model_dir = fetch_model(self.store, ref, folder / MODEL_DIR)
        state = None
        if any(f.startswith(STATE_DIR + "/") for f in manifest.files) and not ref.version.startswith(CRITIC_INIT):
            name = self._state_to_load(manifest, role)
            if role == "policy" and self.cfg.actor.engine == "deepspeed":
                import rlstage.engines.training.actor_deepspeed  # noqa: F401  registers the types a ZeRO optimizer state holds
            fetched = self.store.fetch_dir(manifest, name, str(folder / name))
            with stored_bytes(_checkpoint_name(ref)):
                state = load_trainer_state(fetched)
        self._load(ref, model_dir, state, role)
        return ref.version

    def _sharded_state(self) -> bool:
        """ZeRO 1-3 over several ranks: each rank's optimizer state is its own partition, stored by that rank."""
        return self.world_size > 1 and self.cfg.actor.engine == "deepspeed" and self.cfg.actor.zero_stage > 0

    def _state_to_load(self, manifest: Manifest, role: str) -> str:
        """The folder of ``manifest``'s trainer state this worker loads: its rank's partition, or the whole state."""
        if role != "policy":
            return STATE_DIR
        shards, want = state_shards(manifest), self.world_size if self._sharded_state() else 0
        if shards != want:
            a = self.cfg.actor
            saved = f"the optimizer partitions of {shards} ranks (ZeRO)" if shards else "one whole optimizer state"
            raise ConfigError(
                f"config error: ray.trainer_world_size: checkpoint {manifest.run}/iter-{manifest.iteration}/"
                f"{manifest.stage} holds {saved}; this run trains {self.world_size} rank(s) with actor.engine={a.engine}, "
                f"actor.zero_stage={a.zero_stage}: resume with the ray.trainer_world_size and actor.zero_stage it was "
                "saved with"
            )
        return state_shard_dir(self.rank) if want else STATE_DIR

    def _rebuild(self, m: Manifest, update_hash: str | None, role: str = "policy") -> None:
        """Re-run the update that made ``m`` (a policy's or a critic's) on its stored experience, from the
        previous version (itself rebuilt if need be); valid only under the same settings (``update_hash``)."""
        if update_hash is not None and m.config_hash != update_hash:
            why = (
                f"was pruned (trainer.max_actor_ckpt_to_keep={self.cfg.trainer.max_actor_ckpt_to_keep})"
                if m.meta.get("pruned")
                else f"lies between checkpoints (trainer.checkpoint_every={self.cfg.trainer.checkpoint_every})"
            )
            settings = "actor" if role == "policy" else "critic"
            raise ConfigError(
                f"config error: the {role} of iteration {m.iteration} {why} and was trained with other {settings} "
                f"settings; replay from an iteration with stored weights or keep the {settings} settings"
            )
        previous = PolicyRef.model_validate(m.meta[f"{role}_ref"])
        self.acquire(previous.model_dump(mode="json"), role, update_hash)
        experience = self.store.manifest(m.run, m.iteration, "advantage")
        if experience is None or experience.artifact_id != m.inputs["experience"]:
            raise FileNotFoundError(f"experience {m.inputs['experience']} of iteration {m.iteration} is not committed")
        if role == "policy":
            self.update(previous.version, experience.model_dump(mode="json"), m.iteration, checkpoint=False)
            self.versions["policy"], self.pending = m.artifact_id, False
        else:
            self.critic_update(previous.version, experience.model_dump(mode="json"), m.iteration, checkpoint=False)
            self.versions["critic"] = m.artifact_id

    def commit_shard(self, commit_json: dict) -> dict[str, dict]:
        """Write this rank's optimizer partition (ZeRO 1-3, rank > 0) into the artifact rank 0 commits next;
        returns its files' entries for rank 0's manifest ({} when this rank's state is not a partition)."""
        if not self._sharded_state():
            return {}
        staged = self.staged.pop("shard", None)
        if staged is None:  # restarted since its update: the stage's retry trains again
            raise RuntimeError(f"trainer rank {self.rank} holds no trained optimizer partition to commit")
        try:
            at = {k: commit_json[k] for k in ("run", "iteration", "stage", "version") if k in commit_json}
            entries = self.store.put_files(**at, name=state_shard_dir(self.rank), local_dir=str(staged))
        finally:
            shutil.rmtree(staged, ignore_errors=True)
        return {rel: e.model_dump(mode="json") for rel, e in entries.items()}

    def commit(self, role: str, commit_json: dict, tables: dict[str, pa.Table], written: dict | None = None) -> dict:
        """Write ``role``'s staged checkpoint (if any) and ``tables`` as one artifact; hold it as that version.

        ``commit_json`` holds ``ArtifactStore.commit``'s keyword arguments (run, iteration, stage, key, ...);
        ``written``: the other ranks' optimizer partitions, already in the artifact (``commit_shard``).
        """
        staged = self.staged.pop(role, None)
        if (role == "policy" and not self.pending) or (role == "critic" and staged is None):
            # A call repeated on a restarted worker (Ray's ActorUnavailableError: it may have run) would
            # commit no weights under the update's name: refused, so the stage's retry trains again.
            raise RuntimeError(f"worker holds no trained {role} to commit (restarted since its update)")
        dirs = {} if staged is None else {p.name: str(p) for p in sorted(staged.iterdir())}
        try:
            at = (commit_json["stage"], commit_json["iteration"])
            drill = functools.partial(fault_point, self.cfg, *at, where="kill_in_commit")
            shards = {rel: FileEntry.model_validate(e) for rel, e in (written or {}).items()}
            manifest = self.store.commit(**commit_json, tables=tables, dirs=dirs, written=shards, before_manifest=drill)
        finally:
            if staged is not None:
                shutil.rmtree(staged, ignore_errors=True)
        self.versions[role] = manifest.artifact_id
        self.pending = False
        return manifest.model_dump(mode="json")

    # ------------------------------------------------------------------ loading
    def _load(self, ref: PolicyRef, path: Path, state: dict | None, role: str) -> None:
        # transformers is imported here, not with this module: a command or stage task that only starts
        # this actor skips its ~3 s import
        from transformers import (
            AutoConfig,
            AutoModelForCausalLM,
            AutoModelForTokenClassification,
            AutoTokenizer,
        )

        if not path.is_dir():
            raise FileNotFoundError(f"model path {path} does not exist or is not a directory")
        dtype = torch_dtype(self.cfg)
        # a committed checkpoint's files (a user's own model folder fails as transformers says)
        def loading() -> contextlib.AbstractContextManager:
            return stored_bytes(_checkpoint_name(ref)) if ref.path is None else contextlib.nullcontext()

        if self.tokenizer is None or role == "policy":
            with loading():
                self.tokenizer = AutoTokenizer.from_pretrained(path)
            self.tokenizer.padding_side = "left"
        pad_id = self.tokenizer.pad_token_id
        device = compute_device()  # every engine builds its inputs on the device of the model it runs
        if role == "policy":
            with loading():
                self.model, self.base = load_policy_model(self.cfg, self.store, ref, path, self.scratch, trainable=True)
            self.model = self.model.to(device)
            self.actor = self._new_actor(pad_id)
            if state is not None:
                self.actor.load_state_dict(state)
            # Rank 0 generates unless the rollout role is placed apart; the other ranks too where they can.
            colocated = self.cfg.ray.rollout_placement == "colocated" and (self.rank == 0 or every_rank_generates(self.cfg))
            self.rollout = build_rollout_engine(self.cfg, self.model, self.tokenizer, self._engine_dir(path), self.rollout) if colocated else None
        elif role == "ref":
            with loading():
                self.ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval().requires_grad_(False).to(device)
        elif role == "critic":
            torch.manual_seed(self.cfg.trainer.seed)  # the fresh value head is the same on every load
            # classifier_dropout=0: a deterministic value head, as verl's (HF's default is 0.1)
            config = AutoConfig.from_pretrained(path, num_labels=1)
            config.classifier_dropout = 0.0  # not every config class declares it, so set after loading
            model = AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=dtype).eval().to(device)
            self.critic = TorchCritic(model, self.cfg.critic, pad_id, self.total_steps)
            if state is not None:
                self.critic.load_state_dict(state)
        else:
            raise ValueError(f"unknown role {role!r}; valid: {', '.join(ROLES)}")
        self.versions[role] = ref.version

    def _engine_dir(self, path: Path) -> str:
        """The folder a vLLM engine starts from: a LoRA policy's base weights, its adapter pushed after (HF
        shares the model)."""
        if self.base is None or engine_traits(self.cfg.rollout.engine).in_memory:
            return str(path)
        folder = self.scratch / "base"
        shutil.rmtree(folder, ignore_errors=True)
        save_hf(self.model, self.tokenizer, folder, merged=False)
        return str(folder)

    def _new_actor(self, pad_id: int) -> TorchActor:
        """The train engine ``actor.engine`` names, training ``self.model`` (ZeRO-3: a copy of it)."""
        if self.cfg.actor.engine == "torch":
            if self.world_size > 1:  # the group's env was set by join()
                return DataParallelTorchActor(self.model, self.cfg.actor, pad_id, self.total_steps)
            return TorchActor(self.model, self.cfg.actor, pad_id, self.total_steps)
        import deepspeed  # lazy: only runs with actor.engine=deepspeed pay for the import

        from rlstage.engines.training.actor_deepspeed import DeepSpeedActor

        deepspeed.utils.logger.setLevel("WARNING")  # its INFO lines would flood the Ray worker's log
        if isinstance(self.actor, DeepSpeedActor):
            self.actor.close()  # a reload (resume, replay): release the old engine; the process group stays
        if not torch.distributed.is_initialized() and self.world_size == 1:
            # This worker is a world of one. Values inherited from the driver's environment describe another
            # process (a reused MASTER_PORT is EADDRINUSE); DeepSpeedActor picks a free port when none is set.
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
            os.environ.pop("MASTER_PORT", None)
        # DeepSpeedActor skips the shm_comm op build. ZeRO-3 partitions the module it trains, while rollout
        # and checkpoints need whole weights: rank 0 trains a copy (_sync_policy_weights); the other ranks
        # only train, so they keep just their partition.
        zero3_rank0 = self.cfg.actor.zero_stage == 3 and self.rank == 0
        train_model = copy.deepcopy(self.model) if zero3_rank0 else self.model
        return DeepSpeedActor(train_model, self.cfg.actor, pad_id, self.total_steps)

    def _sync_policy_weights(self) -> None:
        """After an update: ZeRO-3's gathered weights into rank 0's whole model (a no-op for other engines)."""
        # a gather every rank takes part in; ranks 1..N-1 train their partition only and keep no whole copy
        self.actor.gather_into(None if self.actor.trained_module is self.model else self.model)

    def _push_rollout_weights(self) -> None:
        """After an update: the trained weights into this rank's rollout engine, in memory (vLLM: shared-memory
        buckets; a LoRA policy: its adapter; HF shares the model: nothing to take), whether or not this update staged
        a checkpoint."""
        if self.rollout is not None:
            self.rollout.load_weights(self.model)

    def close(self) -> None:
        """Call before ``ray.kill``: a vLLM engine killed with the actor leaves ~400 MB of /dev/shm/psm_* behind."""
        if self.rollout is not None:
            self.rollout.close()
        shutil.rmtree(self.scratch, ignore_errors=True)

    def _require(self, version: str, role: str = "policy") -> None:
        if self.versions[role] != version:
            raise RuntimeError(f"worker holds {role} version {self.versions[role]}, stage needs {version}")

    # ------------------------------------------------------------------ compute
    def generate_ids(self, version: str, prompt_ids: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Completions of rendered prompts (the stage renders chat messages with the policy's template)."""
        self._require(version)
        self.drill.point("rollout" if self.rank == 0 else f"rank{self.rank}")
        return self.rollout.generate_ids(prompt_ids, params)

    def agent_generate(self, version: str, rows: list[dict], params: SamplingParams) -> tuple[list[AgentCompletion], dict]:
        """Multi-turn tool-calling rollouts of prompts-table rows (``agent`` config); completions and timings."""
        self._require(version)
        self.drill.point("rollout")
        from rlstage.engines.agents.endpoint import run_agents

        return run_agents(self.rollout, self.cfg.agent, rows, params, self.cfg.data.source_settings, self.cfg.data.max_prompt_length)

    def _scorer(self) -> TorchActor:
        """What computes the policy's log-probs: the train engine, or under ZeRO-3 a bare actor over rank 0's
        whole weights (a partitioned forward would wait for the other ranks to gather with it)."""
        return self.actor if self.actor.trained_module is self.model else self._bare(self.model)

    def _bare(self, model) -> TorchActor:
        """The actor's no-grad passes (its batching, temperature and micro-batch sizes) on ``model``, no optimizer."""
        bare = TorchActor.__new__(TorchActor)
        bare.cfg, bare.pad_id, bare.model = self.cfg.actor, self.tokenizer.pad_token_id, model
        return bare

    def log_probs(self, version: str, prompt_ids: list, response_ids: list, temperature: float) -> list:
        self._require(version)
        self.drill.point("actor")
        return self._scorer().compute_log_probs(prompt_ids, response_ids, temperature)

    def log_probs_and_sum_pi_squared(self, version: str, prompt_ids: list, response_ids: list, temperature: float) -> tuple:
        """Old log-probs and the per-token sum of pi^2 (optimal_token_baseline's input) from one forward."""
        self._require(version)
        self.drill.point("actor")
        return self._scorer().compute_log_probs_and_sum_pi_squared(prompt_ids, response_ids, temperature)

    def ref_log_probs(self, version: str, prompt_ids: list, response_ids: list, temperature: float) -> list:
        self._require(version, "ref")
        self.drill.point("ref")
        # The same batching and temperature as the actor's recompute, on the frozen weights.
        if not self.cfg.model.lora:
            return self._bare(self.ref_model).compute_log_probs(prompt_ids, response_ids, temperature)
        if self.base is None or self.base.version != version:
            raise RuntimeError(f"the reference {version} is a LoRA policy's base, but the policy held trains on {self.base}")
        with self.model.disable_adapter():
            return self._bare(self.model).compute_log_probs(prompt_ids, response_ids, temperature)

    def values(self, version: str, prompt_ids: list, response_ids: list) -> list:
        self._require(version, "critic")
        self.drill.point("critic")
        return self.critic.compute_values(prompt_ids, response_ids)

    def update(self, version: str, experience_json: dict, iteration: int, checkpoint: bool = True) -> dict:
        """One iteration's policy update from a committed experience artifact (read here, not shipped).

        Skipped during critic warm-up. With ``checkpoint`` the new weights and trainer state are staged
        for ``commit``; between checkpoints nothing is written. The worker then holds an uncommitted
        policy (version None) until ``commit``.
        """
        self._require(version)
        cfg = self.cfg
        exp = self.store.read_table(Manifest.model_validate(experience_json), "experience.parquet")
        columns = ("prompt_ids", "response_ids", "response_mask", "old_log_probs", "advantages")
        columns += ("ref_log_probs",) if algos.actor_needs_ref(cfg.actor) else ()
        columns += ("rollout_log_probs",) if cfg.actor.rollout_correction.enabled else ()
        batch = update_batch(exp, columns)
        seed = iteration_seed(cfg.trainer.seed, iteration)
        skip = cfg.critic.enable and iteration <= cfg.critic.warmup_iterations
        torch.manual_seed(seed)
        point = "update" if self.rank == 0 else f"update@rank{self.rank}"
        fault_point(cfg, point, iteration, where="kill_worker_at")
        t0 = time.time()
        hold_point(cfg, f"{point}:{iteration}")
        metrics = {"actor/skipped": 1.0} if skip else self.actor.update(batch, cfg.rollout.temperature, seed)
        self.busy.append((t0, time.time()))
        self._sync_policy_weights()
        self.versions["policy"], self.pending = None, True
        # Rank 0 stages the weights and its optimizer state (whole under ZeRO-0, the same on every rank); under
        # ZeRO 1-3 each other rank stages its own partition. A rollout role placed apart takes each policy from this
        # worker in memory (push_start), except a pipelined one, which generates while this trains: it reads the
        # store, so every policy's weights are stored then.
        ahead = cfg.ray.rollout_placement == "separate" and cfg.trainer.async_staleness > 0
        if self.rank == 0 and (checkpoint or ahead):
            # written out at once (live buffers, no copy of the optimizer state in memory)
            self._stage("policy", self.model, self.actor.state_dict(live=True) if checkpoint else None)
        elif self.rank > 0 and checkpoint and self._sharded_state():
            shard = self.scratch / "staged-shard"
            shutil.rmtree(shard, ignore_errors=True)
            save_trainer_state(self.actor.state_dict(live=True), shard)
            self.staged["shard"] = shard
        if not skip:
            self._push_rollout_weights()
        return metrics

    def serves_weights(self, ref_json: dict) -> bool:
        """Whether the rollout role placed apart takes ``ref`` from this worker in memory (``push_start``): it holds
        it, or it lies between checkpoints, with no stored weights (only a trainer can rebuild it)."""
        ref = PolicyRef.model_validate(ref_json)
        if self.versions["policy"] == ref.version:
            return True
        if ref.path is not None:
            return False
        manifest = self.store.manifest(ref.run, ref.iteration, ref.stage)
        return manifest is not None and not any(f.startswith(MODEL_DIR + "/") for f in manifest.files)

    def push_start(self, version: str, have: str | None) -> PushPlan:
        """Begin sending the policy ``version`` (held) to rollout workers that hold ``have``: a delta against it with
        ``rollout.weight_sync: delta`` when it is what this worker sent last, else whole weights."""
        self._require(version)
        if self.sender is None:
            r = self.cfg.rollout
            self.sender = WeightSender(delta=r.weight_sync == "delta", bucket_bytes=r.weight_bucket_mib << 20)
        return self.sender.start(self.model, version, have, self.tokenizer)

    def push_bucket(self) -> Bucket:
        """The next bucket of the push ``push_start`` began (its ``last`` ends it)."""
        return self.sender.next_bucket()

    def critic_update(self, version: str, experience_json: dict, iteration: int, checkpoint: bool = True) -> dict:
        self._require(version, "critic")
        exp = self.store.read_table(Manifest.model_validate(experience_json), "experience.parquet")
        batch = update_batch(exp, ("prompt_ids", "response_ids", "response_mask", "values", "returns"))
        seed = iteration_seed(self.cfg.trainer.seed, iteration)
        torch.manual_seed(seed)
        metrics = self.critic.update(batch, seed)
        self.versions["critic"] = None
        if checkpoint:
            self._stage("critic", self.critic.model, self.critic.state_dict())
        return metrics

    def _stage(self, role: str, model, state: dict | None) -> Path:
        """Write a checkpoint (weights, and trainer state unless None) into a local folder ``commit`` stores."""
        folder = self.scratch / f"staged-{role}"
        shutil.rmtree(folder, ignore_errors=True)
        if role == "policy" and self.base is not None:
            save_adapters(model, self.tokenizer, folder / MODEL_DIR, self.base)  # the adapter + its base's reference
        else:
            model.save_pretrained(folder / MODEL_DIR)
            self.tokenizer.save_pretrained(folder / MODEL_DIR)
        if state is not None:
            save_trainer_state(state, folder / (state_shard_dir(0) if self._sharded_state() and role == "policy" else STATE_DIR))
        self.staged[role] = folder
        return folder
