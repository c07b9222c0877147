"""Settings shared by the integration tests: a run of the tiny kit that takes seconds."""

from __future__ import annotations

import os
from pathlib import Path


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
    from pathlib import Path

    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join([*inherited, str(Path(__file__).resolve().parent.parent)])


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
