"""A verifiers taskset (PyPI verifiers 0.4.0) as a data source plus reward, in an environment of its own.

``scripts/verifiers-env.sh`` makes the environment (verifiers' pins cannot share rlstage's); the test installs a
small taskset there, written with verifiers' own classes (an addition question a task, a reward of its own), and
trains the tiny kit on it: data prep lists its tasks, and every rollout and eval sample is an episode played by
verifiers' chat harness against rlstage's endpoint, scored by the taskset."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from rlstage.engines.data import datasets
from rlstage.schemas.config import ConfigError, load_config, stored_config_from
from tests_support import (
    REPO,
    assert_agents_trained,
    moving_overrides,
    prepared_rows,
    stage_rows,
    tiny_overrides,
)

TASKSET = """
import verifiers.v1 as vf


def question(i: int) -> tuple[str, str]:
    a, b = i % 50 + 10, i % 37 + 10
    return f"What is {a}+{b}? ", str(a + b)


def reward(reply: str, answer: str) -> float:
    return 1.0 if reply.strip() == answer else -0.125 * min(len(reply), 8)  # in eighths: exact in float32 too


class AddData(vf.TaskData):
    answer: str


class AddTask(vf.Task[AddData]):
    @vf.reward
    async def exact(self, trace: vf.Trace) -> float:
        print("scored", self.data.idx)  # a taskset's prints must not reach the sidecar's protocol
        return reward(trace.last_reply or "", self.data.answer)


class AddConfig(vf.TasksetConfig):
    num_tasks: int = 100


class AddTaskset(vf.Taskset[AddTask, AddConfig]):
    def load(self):
        print("listing", self.config.num_tasks, "tasks")
        for i in range(self.config.num_tasks):
            prompt, answer = question(i)
            yield AddTask(AddData(idx=i, prompt=prompt, answer=answer), self.config.task)


__all__ = ["AddTaskset"]
"""
NAME = "rlstage_test_addition"


def question(i: int) -> tuple[str, str]:  # the taskset's, read back here
    a, b = i % 50 + 10, i % 37 + 10
    return f"What is {a}+{b}? ", str(a + b)


def reward(reply: str, answer: str) -> float:
    return 1.0 if reply.strip() == answer else -0.125 * min(len(reply), 8)


@pytest.fixture(scope="module")
def python(tmp_path_factory) -> str:
    """The verifiers environment's interpreter, with the test's taskset installed (a .pth to its folder)."""
    out = subprocess.run(
        ["bash", str(REPO / "scripts" / "verifiers-env.sh"), str(REPO / ".venv-verifiers")],
        capture_output=True,
        text=True,
        check=True,
    )
    interpreter = out.stdout.strip().splitlines()[-1]
    folder = tmp_path_factory.mktemp("tasksets")
    (folder / NAME).mkdir()
    (folder / NAME / "__init__.py").write_text(TASKSET)
    purelib = subprocess.run(
        [interpreter, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    )
    (Path(purelib.stdout.strip()) / f"{NAME}.pth").write_text(f"{folder}\n")
    return interpreter


def settings(python: str, **kw) -> dict:
    return {"taskset": NAME, "python": python, "train_size": 12, "test_size": 4, **kw}


@pytest.fixture(scope="module")
def run(prefect_api, python, tmp_path_factory):
    from rlstage.flows.training import train

    store = tmp_path_factory.mktemp("verifiers") / "store"
    cfg = load_config(None, [
        f"store.root={store}", "run_name=verifiers", *tiny_overrides(), *moving_overrides(),
        "data.prompts_per_iteration=4", "rollout.n=2", "actor.ppo_mini_batch_size=8",
        "data.source=verifiers", "data.source_settings=" + json.dumps(settings(python)), "agent.enable=true",
        "agent.function=rlstage.engines.agents.verifiers_env:episode", "agent.max_response_tokens=32",
    ])  # fmt: skip
    return cfg, train(config=cfg)


def test_the_tasksets_tasks_are_the_prompts_and_its_rewards_the_scores(run):
    cfg, result = run
    train_rows, test_rows = prepared_rows(cfg, "verifiers")
    # The taskset's order: the first 4 held out, the next 12 trained on; each row keeps its task's data.
    assert [r["prompt"] for r in test_rows] == [question(i)[0] for i in range(4)]
    assert [r["prompt"] for r in train_rows] == [question(i)[0] for i in range(4, 16)]
    for row in train_rows + test_rows:
        task = json.loads(row["extra_info"])["verifiers"]["data"]
        assert row["data_source"] == "verifiers" and (task["prompt"], task["answer"]) == question(task["idx"])
    for it in (1, 2):
        rollouts = stage_rows(cfg, "verifiers", it, "rollout", "rollouts.parquet")
        scores = [r["score"] for r in stage_rows(cfg, "verifiers", it, "reward", "rewards.parquet")]
        assert len(rollouts) == 4 * 2
        for r, score in zip(rollouts, scores, strict=True):
            idx = json.loads(r["extra_info"])["verifiers"]["data"]["idx"]
            msgs = json.loads(r["messages_json"])
            # The harness's request, as the endpoint recorded it: the task's question, the policy's one reply.
            assert [m["content"] for m in msgs if m["role"] == "user"] == [question(idx)[0]]
            (reply,) = [m["content"] for m in msgs if m["role"] == "assistant"]
            assert (
                r["agent_reward"] == score == reward(reply.strip(), question(idx)[1])
            )  # verifiers' last_reply is stripped
            assert sum(r["response_mask"]) == len(r["response_ids"]) > 0  # one turn, every token the policy's
    assert_agents_trained(cfg, result, "verifiers", 4 * 2)


def test_an_unknown_taskset_or_interpreter_is_one_line(python):
    with pytest.raises(
        datasets.DatasetError, match=r"^verifiers taskset 'no_such_taskset' \(.*\): .*not found"
    ) as err:
        datasets.load_verifiers(split="test", **settings(python, taskset="no_such_taskset"))
    assert "\n" not in str(err.value)
    with pytest.raises(datasets.DatasetError, match=r"/nowhere/python is not an executable interpreter"):
        datasets.load_verifiers(split="test", **settings("/nowhere/python"))


def test_a_stored_config_may_not_name_a_taskset_or_interpreter(python):
    stored = {"config": {"data": {"source": "verifiers", "source_settings": settings(python)}}}
    with pytest.raises(
        ConfigError,
        match=r"data\.source_settings\.taskset: 'rlstage_test_addition' comes from the stored config",
    ):
        stored_config_from(stored, "run.json")
    overrides = [f"data.source_settings.taskset={NAME}", f"data.source_settings.python={python}"]
    assert (
        stored_config_from(stored, "run.json", overrides).data.source == "verifiers"
    )  # named by the command itself


def test_a_failed_episode_is_that_samples_error_and_the_sidecar_serves_on(python):
    import asyncio

    from rlstage.engines.data.verifiers_env import VerifiersError, VerifiersSettings, sidecar_for

    sidecar = sidecar_for(VerifiersSettings.model_validate(settings(python)))
    task = {"idx": 0, "prompt": question(0)[0], "answer": question(0)[1]}
    with pytest.raises(VerifiersError, match=r"answer"):  # task data the taskset's own type refuses
        asyncio.run(sidecar.episode({"idx": 0, "prompt": "x"}, "http://127.0.0.1:1/v1", {}, "policy"))
    with pytest.raises(VerifiersError) as err:  # a model endpoint that is gone (a stage that has ended)
        asyncio.run(sidecar.episode(task, "http://127.0.0.1:1/v1", {}, "policy"))
    assert (
        "\n" not in str(err.value)
        and sidecar.alive
        and sidecar_for(VerifiersSettings.model_validate(settings(python))) is sidecar
    )
