"""What the tests share: the repository's folders, the tiny kit's settings (a run that takes seconds), and helpers that
read a run's store, its Prefect states and the processes it left."""

from __future__ import annotations

import os
import random
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent  # the repository (the package rlstage); tests/ may nest
SHARED = REPO.parent / "shared"
GSM8K = SHARED / "data" / "gsm8k"


def tiny_overrides() -> list[str]:
    return [
        "kit.train_size=400",
        "kit.test_size=40",
        "kit.hidden_size=32",
        "kit.num_layers=1",
        "kit.num_heads=2",
        "kit.intermediate_size=64",
        "sft.steps=20",
        "sft.batch_size=32",
        "sft.target_accuracy=null",
        "data.prompts_per_iteration=8",
        "rollout.n=4",
        "rollout.batch_size=64",
        "actor.ppo_mini_batch_size=16",
        "actor.micro_batch_size=8",
        "trainer.iterations=2",
        "tracking.rollout_sample_rows=4",
    ]


def agent_overrides() -> list[str]:
    """The kit's multiply task with the calculator tool: multi-turn tool-calling rollouts on the tiny model."""
    return [
        "kit.task=multiply",
        "kit.digits=3",
        "sft.steps=120",
        "sft.lr=3e-3",
        "rollout.max_new_tokens=80",
        "agent.enable=true",
        "agent.tools=[{name: calculator, callable: 'rlstage.engines.agents.tools:calculator', "
        "parameters: {type: object, properties: {expression: {type: string}}, required: [expression]}}]",
        "agent.max_turns=3",
        "agent.max_response_tokens=160",
    ]


def moving_overrides() -> list[str]:
    """On the tiny settings every reward is 0 (so is every advantage); an entropy bonus and a larger step
    make every update change the weights, so that kill, resume and replay tests compare moving runs."""
    return ["actor.entropy_coeff=0.01", "actor.optim.lr=1e-3"]


def tiny_config(root, run: str, *extra: str):
    """A tiny-kit run ``run`` in the store at ``root`` whose weights move every iteration, with ``extra`` overrides."""
    from rlstage.schemas.config import load_config

    return load_config(None, [f"store.root={root}", f"run_name={run}", *tiny_overrides(), *moving_overrides(), *extra])


def iteration_stages() -> tuple[str, ...]:
    """The stages of each iteration of a default run, in order (the critic's aside), from the stage registry."""
    from rlstage.schemas.config import RunConfig
    from rlstage.schemas.stages import SPECS

    return tuple(s.name for s in SPECS if s.per_iteration and s.active(RunConfig()) and "critic" not in set(s.inputs) - set(s.optional))


def checksums(store, run: str, iterations, stages: tuple[str, ...] = ()) -> dict[str, str]:
    """Every committed file's sha256 by ``<iteration>/<stage>/<file>``, for ``iterations`` (a count: 1..n) and
    ``stages`` (default: ``iteration_stages()``); each must be committed."""
    out = {}
    for it in range(1, iterations + 1) if isinstance(iterations, int) else iterations:
        for stage in stages or iteration_stages():
            m = store.manifest(run, it, stage)
            assert m is not None, f"{stage} of iteration {it} not committed"
            out.update({f"{it}/{stage}/{name}": entry.sha256 for name, entry in m.files.items()})
    return out


def update_weights(store, run: str, iteration: int) -> dict:
    """The policy weights committed by ``iteration``'s update (a LoRA policy's: its adapter)."""
    from safetensors.torch import load

    manifest = store.manifest(run, iteration, "update")
    name = "model/model.safetensors" if "model/model.safetensors" in manifest.files else "model/adapter_model.safetensors"
    return load(store.read_bytes(manifest, name))


def stage_rows(cfg, run: str, iteration: int | None, stage: str, name: str) -> list[dict]:
    """The rows of one table a stage committed (``iteration`` None: the run's data prep and SFT)."""
    from rlstage.tasks.runtime import store_for

    store = store_for(cfg)
    return store.read_table(store.manifest(run, iteration, stage), name).to_pylist()


def prepared_rows(cfg, run: str) -> tuple[list[dict], list[dict]]:
    """The training and held-out prompts the run's data prep committed."""
    return tuple(stage_rows(cfg, run, None, "data_prep", f"{split}.parquet") for split in ("train", "test"))


def assert_agents_trained(cfg, result: dict, run: str, samples: int) -> None:
    """A two-iteration agent run moved its weights, and its MLflow run counts each iteration's ``samples`` agent
    samples ok (the last iteration's count) and no failed one."""
    from mlflow.tracking import MlflowClient

    from rlstage.infra.tracking import tracking_uri_for
    from rlstage.tasks.runtime import store_for

    store = store_for(cfg)
    assert weights_moved(update_weights(store, run, 1), update_weights(store, run, 2))
    metrics = MlflowClient(tracking_uri_for(cfg)).get_run(result["mlflow_run_id"]).data.metrics
    assert metrics["agent/status/ok"] == samples and not any(k.startswith("agent/status/") and k != "agent/status/ok" for k in metrics)


def weights_moved(a: dict, b: dict) -> bool:
    return any((a[k] - b[k]).abs().max() > 0 for k in a)


def _flow_runs(flow_state) -> tuple[list, list]:
    """A training flow run (the state ``train(..., return_state=True)`` returns) and its iteration subflows,
    then the task runs of all of them, read from the Prefect API."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterParentFlowRunId

    with get_client(sync_client=True) as client:
        top = client.read_flow_run(flow_state.state_details.flow_run_id)
        children = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[top.id]))
        )
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[top.id, *(c.id for c in children)])))
    return [top, *children], runs


def stage_states(flow_state) -> dict:
    """(flow run name, stage) -> the final state of each stage task run of a training flow run and of its
    iteration subflows."""
    from rlstage.tasks.stages import TASKS

    states: dict = {}

    def unfinished() -> list:
        flows, runs = _flow_runs(flow_state)
        names = {r.id: r.name for r in flows}
        # A task run is named <task>-<suffix>; the stage tasks are named after their stage.
        states.clear()
        states.update({(names[r.flow_run_id], r.name.rsplit("-", 1)[0]): r.state for r in runs if r.name.rsplit("-", 1)[0] in TASKS})
        return [k for k, s in states.items() if s is None or not s.is_final()]

    # Prefect's server records a task run's states from the events its client sends, asynchronously: right after the
    # flow returns, a finished task run may still read as Running (seen under CI's load). Its final state is awaited.
    until_empty(unfinished, 60)
    return dict(states)


def flow_graph(flow_state) -> dict[str, set[str]]:
    """A training flow run's graph as the Prefect UI draws it: each node (a stage task as
    ``<flow run name>/<stage>``, an iteration subflow by its name) -> the nodes it waits for."""
    flow_runs, runs = _flow_runs(flow_state)
    flows = {r.id: r.name for r in flow_runs}
    subflow = {c.parent_task_run_id: c.name for c in flow_runs[1:]}  # the parent's stand-in task run of each subflow
    node = {r.id: subflow.get(r.id) or f"{flows[r.flow_run_id]}/{r.name.rsplit('-', 1)[0]}" for r in runs}

    def upstream(inp) -> str:
        return flows[inp.id] if inp.input_type == "flow_run" else node[inp.id]

    return {node[r.id]: {upstream(i) for given in r.task_inputs.values() for i in given} for r in runs}


def cli_env(**extra: str) -> dict[str, str]:
    """The environment of a CLI command run as a user would: no Prefect API, Prefect home or rlstage home of the
    test session (the command uses its own, under its cwd), the source tree importable."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "PREFECT_HOME", "RLSTAGE_"))}
    return {**env, "PYTHONPATH": source_path(), **extra}


def source_path() -> str:
    """PYTHONPATH for a command of this tree: an inherited PYTHONPATH first (a worktree whose folder is not named
    rlstage is importable through it, where the editable install names another checkout), then the tree."""
    import os

    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join([*inherited, str(REPO)])


def start_cli_until(cmd: list[str], cwd, env: dict[str, str], prefix: str):
    """Start a CLI command (stdout and stderr merged) and read its output up to a line starting with ``prefix``;
    the process, still running. Fails the test with the output when the command ends first."""
    import subprocess

    import pytest

    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(prefix):
            return proc
    proc.wait()
    pytest.fail(f"the command ended before a line {prefix!r}:\n" + "".join(lines))


def build_wheel(src, out) -> Path:
    """A wheel of the source tree ``src`` (no dependencies), built with this environment's setuptools."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(src)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = Path(out).glob("rlstage-*.whl")
    return wheel


def env_with_wheel(wheel, env_dir) -> Path:
    """A fresh virtual environment holding ``wheel`` and, as a plain path, this environment's packages (torch,
    Prefect, Ray, ...): a path entry's .pth files stay inactive, so this checkout's editable install is not
    seen there. Returns the environment's python."""
    import subprocess
    import sys
    import sysconfig
    import venv

    venv.EnvBuilder(with_pip=False).create(env_dir)  # this environment's pip installs into it (--python): no ensurepip
    py = Path(env_dir) / "bin" / "python"
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True, check=True)
    deps = [p for p in sys.path if p.endswith("site-packages")] or [sysconfig.get_paths()["purelib"]]
    (Path(site.stdout.strip()) / "zz_dependencies.pth").write_text("".join(f"{p}\n" for p in deps))
    install = [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index", str(wheel)]
    done = subprocess.run(install, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return py


def _in_shm(path: str) -> bool:
    """A file of /dev/shm itself (the test folders may lie in a folder of it: scripts/test.sh), not unlinked."""
    return os.path.dirname(path) == "/dev/shm" and not path.endswith("(deleted)")


def shm_files(pids) -> set[str]:
    """The /dev/shm files these processes have mapped or open (unlinked ones excluded: they go with the process)."""
    found: set[str] = set()
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                fields = line.split(maxsplit=5)  # address, perms, offset, dev, inode[, path]
                path = fields[5] if len(fields) == 6 else ""
                if _in_shm(path):
                    found.add(path)
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if _in_shm(target):
                    found.add(target)
        except OSError:  # gone meanwhile
            pass
    return found


def orphaned_shm(before: set[str]) -> set[str]:
    """Files of /dev/shm made since ``before`` (names) that no living process maps or holds open: what a killed
    process left behind. A file of another test's live engine (xdist runs vLLM beside this one) is held, so not one."""
    new = {f"/dev/shm/{n}" for n in set(os.listdir("/dev/shm")) - before}
    if not new:
        return set()
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    return {f for f in new - shm_files(pids) if os.path.isfile(f)}  # scripts/test.sh's folder of test stores is a folder


def until_empty(find, seconds: float, step: float = 0.2):
    """``find()`` again every ``step`` seconds until it finds nothing or ``seconds`` pass; its last finding.
    Processes that got their signal, and what they hold, may take a moment to go."""
    import time

    deadline = time.monotonic() + seconds
    while (found := find()) and time.monotonic() < deadline:
        time.sleep(step)
    return found


# ---------------------------------------------------------------- verl's recipes

AR = "actor_rollout_ref"
# verl's examples/grpo_trainer/run_qwen2-7b.sh, key for key (the shell's quotes removed as the shell does)
VERL_QWEN2_7B_GRPO = [
    "algorithm.adv_estimator=grpo", "data.train_files={train}", "data.val_files={test}", "data.train_batch_size=1024",
    "data.max_prompt_length=512", "data.max_response_length=1024", "data.filter_overlong_prompts=True", "data.truncation=error",
    f"{AR}.model.path={{model}}", f"{AR}.actor.optim.lr=1e-6", f"{AR}.model.use_remove_padding=True",
    f"{AR}.actor.ppo_mini_batch_size=256", f"{AR}.actor.ppo_micro_batch_size_per_gpu=40", f"{AR}.actor.use_kl_loss=True",
    f"{AR}.actor.kl_loss_coef=0.001", f"{AR}.actor.kl_loss_type=low_var_kl", f"{AR}.actor.entropy_coeff=0",
    f"{AR}.model.enable_gradient_checkpointing=True", f"{AR}.actor.fsdp_config.param_offload=False",
    f"{AR}.actor.fsdp_config.optimizer_offload=False", f"{AR}.rollout.log_prob_micro_batch_size_per_gpu=40",
    f"{AR}.rollout.tensor_model_parallel_size=2", f"{AR}.rollout.name=vllm", f"{AR}.rollout.gpu_memory_utilization=0.6",
    f"{AR}.rollout.n=5", f"{AR}.ref.log_prob_micro_batch_size_per_gpu=40", f"{AR}.ref.fsdp_config.param_offload=True",
    "algorithm.use_kl_in_reward=False", "trainer.critic_warmup=0", 'trainer.logger=["console","wandb"]',
    "trainer.project_name=verl_grpo_example_gsm8k", "trainer.experiment_name=qwen2_7b_function_rm",
    "trainer.n_gpus_per_node=8", "trainer.nnodes=1", "trainer.save_freq=20", "trainer.test_freq=5", "trainer.total_epochs=15",
]  # fmt: skip


# ---------------------------------------------------------------- models and plugins of the tiny kit


def tiny_rm(seed: int = 0):
    """A reward model of the tiny kit's shape (a sequence classifier, one label) and its tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from rlstage.engines.models.tinykit import build_char_tokenizer
    from rlstage.schemas.config import KitConfig

    tok = build_char_tokenizer()
    k = KitConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=k.hidden_size, intermediate_size=k.intermediate_size,
        num_hidden_layers=k.num_layers, num_attention_heads=k.num_heads, num_key_value_heads=k.num_heads,
        max_position_embeddings=256, num_labels=1, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    return LlamaForSequenceClassification(cfg).eval(), tok


EXAMPLES = REPO / "docs" / "examples" / "extending"
# module -> (registry kind, the name it registers)
PLUGINS = {
    "clipped_grpo": ("advantage estimator", "clipped_grpo"),
    "ppo_l2": ("policy loss", "ppo_l2"),
    "digit_match": ("reward function", "digit_match"),
    "csv_source": ("data source", "csv_qa"),
    "plain_sampler": ("rollout engine", "plain_sampler"),
}





# ---------------------------------------------------------------- processes and pages


def processes_with_env(entry: str) -> list[int]:
    """Processes of this user whose environment holds ``entry`` (``NAME=value``)."""
    from rlstage.infra.home import process_environs

    name, value = entry.encode().split(b"=", 1)
    return [pid for pid, env in process_environs() if env.get(name) == value]



PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
NOT_RUN = re.compile(r"^<!-- not run: (\S.*\S) -->$")


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    commands: tuple[tuple[str, ...], ...]  # command lines: continuations joined, comment lines dropped
    text: str
    not_run: str | None  # the reason the page gives


def shell_blocks() -> list[Block]:
    """The shell blocks of the README and the docs pages, in page order (tests/integration/test_docs_commands.py runs
    them, tests/docs/test_readme.py parses their commands)."""
    out = []
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            if m.group(1) not in ("bash", "sh", ""):
                continue
            line = text.count("\n", 0, m.start()) + 1
            before = [ln for ln in text[: m.start()].splitlines() if ln.strip()][-1:]
            why = NOT_RUN.match(before[0]) if before else None
            body = m.group(2).replace("\\\n", " ")
            words = [tuple(shlex.split(ln, comments=True)) for ln in body.splitlines() if not ln.lstrip().startswith("#")]
            out.append(Block(str(page.relative_to(REPO)), line, tuple(w for w in words if w), body, why and why.group(1)))
    return out


# ---------------------------------------------------------------- chaos schedules

ITERATIONS = 3  # of a chaos run (tests/integration/test_chaos.py)
KINDS = ("command", "prefect_server", "trainer", "rollout_worker", "stage_task")


@dataclass(frozen=True)
class Kill:
    kind: str
    iteration: int
    stage: str = ""  # a drill point's stage (stage_task)

    def drill(self) -> list[str]:
        """The drill setting that fires it (the external kinds have none)."""
        return {
            "trainer": [f"kill_worker_at=update:{self.iteration}"],
            "rollout_worker": [f"kill_worker_at=rollout@rollout:{self.iteration}"],
            "stage_task": [f"kill_at={self.stage}:{self.iteration}"],
        }.get(self.kind, [])


class ScheduleError(ValueError):
    pass


def schedule(seed: int, kinds: int, choose_from: tuple[str, ...] = KINDS) -> list[Kill]:
    """``kinds`` kills of distinct kinds, each at an iteration (and a stage) drawn from ``seed``."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ScheduleError(f"chaos seed must be an integer, got {seed!r}")
    unknown = sorted(set(choose_from) - set(KINDS))
    if unknown or not 1 <= kinds <= len(choose_from):
        raise ScheduleError(f"chaos kinds: {unknown or kinds} is not 1..{len(choose_from)} of {', '.join(KINDS)}")
    rng = random.Random(seed)
    # the external kinds fire on an iteration's line, so before the last one (the run must go on after it)
    return [
        Kill(kind, rng.randint(1, ITERATIONS - 1) if kind in ("command", "prefect_server") else rng.randint(1, ITERATIONS),
             rng.choice(("rollout", "reward", "advantage", "update")) if kind == "stage_task" else "")
        for kind in rng.sample(choose_from, kinds)
    ]  # fmt: skip


# ---------------------------------------------------------------- the algorithms' hand-computed cases


def T(*args, **kwargs):
    """torch.tensor (imported on first use: most modules of the suite never need torch)."""
    import torch

    return torch.tensor(*args, **kwargs)


def close(x, expected, atol: float = 1e-5) -> None:
    """x equals ``expected`` in float64, within ``atol`` (and 1e-5 relative)."""
    import torch

    torch.testing.assert_close(torch.as_tensor(x).double(), torch.as_tensor(expected, dtype=torch.float64), atol=atol, rtol=1e-5)


def outcome(scores, masks):
    """Token rewards with each score on the last policy token of its row."""
    import torch

    mask = T(masks, dtype=torch.float32)
    rewards = torch.zeros_like(mask)
    for i, s in enumerate(scores):
        last = int(mask[i].nonzero().max()) if mask[i].any() else mask.shape[1] - 1
        rewards[i, last] = s
    return rewards, mask


def whiten_tokens(values: list[float]) -> tuple[float, float]:
    """Mean and 1/sqrt(unbiased var + 1e-8) of a plain token list, computed independently."""
    import math
    import statistics

    return statistics.fmean(values), 1 / math.sqrt(statistics.variance(values) + 1e-8)


# ragged masks with a gap inside row 0 and row 2 (multi-turn tool output)
MASKS = [
    [1, 1, 0, 0, 1, 1, 0],
    [1, 1, 1, 0, 0, 0, 0],
    [1, 0, 1, 1, 1, 1, 1],
    [1, 1, 1, 1, 0, 0, 0],
    [1, 1, 0, 0, 0, 0, 0],
    [1, 1, 1, 1, 1, 0, 0],
]
INDEX = ["a", "a", "a", "b", "c", "c"]  # a: three members, b: one member, c: constant pair
SCORES = [1.0, 0.0, 0.0, 0.5, 1.0, 1.0]

# verl 0.9.1's names of each registry (engines/plugins.py may add more)
VERL_NAMES = {
    "ADV_ESTIMATORS": (
        "gae", "grpo", "grpo_vectorized", "rloo", "rloo_vectorized", "reinforce_plus_plus",
        "reinforce_plus_plus_baseline", "remax", "opo", "gpg", "grpo_passk", "gdpo", "optimal_token_baseline",
        "tir_optimal_token_baseline",
    ),
    "POLICY_LOSSES": (
        "vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dro", "cispo",
        "bypass_mode",
    ),
    "LOSS_AGG_MODES": ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
    "KL_TYPES": (
        "kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+",
    ),
}  # fmt: skip
