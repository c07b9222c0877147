"""An OpenEnv environment (PyPI openenv-core) as a data source plus reward, played through the agent endpoint.

The test defines a small environment with OpenEnv's own server classes and serves it for real (uvicorn on
127.0.0.1, OpenEnv's WebSocket sessions): two addition questions an episode, reward 1 for each right answer.
rlstage asks it for each episode's first question at data prep and plays every episode in the rollout and eval
stages through ``rlstage.engines.agents.openenv:episode``."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time

import pytest
from openenv.core.env_server import Environment, create_fastapi_app
from openenv.core.env_server.types import Action, Observation, State

from rlstage.engines.data import datasets
from rlstage.schemas.config import load_config
from tests_support import assert_agents_trained, moving_overrides, prepared_rows, stage_rows, tiny_overrides

STEPS = 2  # questions an episode


class AddAction(Action):
    message: str


class AddObservation(Observation):
    prompt: str = ""


def question(seed: int, step: int) -> tuple[str, str]:
    a, b = seed % 50 + 10 + step, seed % 37 + 10
    return f"What is {a}+{b}? ", str(a + b)


def reward(reply: str, answer: str) -> float:
    return 1.0 if reply.strip() == answer else -0.125 * min(len(reply), 8)  # in eighths: exact in float32 too


class AddEnv(Environment):
    """Two questions an episode; reward 1.0 for an answer that is exactly right, else minus 1/8 a character (at most 8)."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    resets = 0  # sessions reset, over every instance

    def __init__(self) -> None:
        super().__init__()
        self.seed, self.step_count = 0, 0

    def reset(self, seed=None, episode_id=None, **kw) -> AddObservation:
        AddEnv.resets += 1
        self.seed, self.step_count = seed or 0, 0
        return AddObservation(prompt=question(self.seed, 0)[0])

    def step(self, action: AddAction, timeout_s=None, **kw) -> AddObservation:
        r = reward(action.message, question(self.seed, self.step_count)[1])
        self.step_count += 1
        return AddObservation(prompt=question(self.seed, self.step_count)[0], reward=r, done=self.step_count >= STEPS)

    @property
    def state(self) -> State:
        return State(step_count=self.step_count)


@pytest.fixture(scope="module")
def env_url():
    import uvicorn

    app = create_fastapi_app(AddEnv, AddAction, AddObservation, max_concurrent_envs=64)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    # critical: OpenEnv's server logs a client that closes its session first as an ASGI error
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    logging.getLogger("uvicorn.error").setLevel(logging.CRITICAL)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=10)


def settings(url: str, **kw) -> str:
    return "data.source_settings=" + json.dumps({"url": url, "train_size": 24, "test_size": 8, "max_steps": STEPS, **kw})


@pytest.fixture(scope="module")
def run(prefect_api, env_url, tmp_path_factory):
    from rlstage.flows.training import train

    store = tmp_path_factory.mktemp("openenv") / "store"
    cfg = load_config(None, [
        f"store.root={store}", "run_name=openenv", *tiny_overrides(), *moving_overrides(),
        "data.source=openenv", settings(env_url), "agent.enable=true",
        "agent.function=rlstage.engines.agents.openenv:episode", f"agent.max_turns={STEPS}", "agent.max_response_tokens=64",
    ])  # fmt: skip
    return cfg, train(config=cfg)


def test_the_environments_episodes_are_the_prompts_and_its_rewards_the_scores(run):
    cfg, result = run
    train_rows, test_rows = prepared_rows(cfg, "openenv")
    for row in train_rows + test_rows:  # each prompt is the first observation of its episode's seed
        seed = json.loads(row["extra_info"])["seed"]
        assert row["prompt"] == question(seed, 0)[0] and row["data_source"] == "openenv"
    assert {json.loads(r["extra_info"])["seed"] for r in test_rows} == set(range(8))
    two_questions = nonzero = 0
    for it in (1, 2):
        rollouts = stage_rows(cfg, "openenv", it, "rollout", "rollouts.parquet")
        scores = [r["score"] for r in stage_rows(cfg, "openenv", it, "reward", "rewards.parquet")]
        assert len(rollouts) == 8 * 4
        for r, score in zip(rollouts, scores, strict=True):
            seed = json.loads(r["extra_info"])["seed"]
            msgs = json.loads(r["messages_json"])
            users = [m["content"] for m in msgs if m["role"] == "user"]
            replies = [m["content"] for m in msgs if m["role"] == "assistant"]
            assert users == [question(seed, k)[0] for k in range(len(users))]
            two_questions += len(users) == STEPS
            # the environment's rewards, summed over the episode, are the sample's reward and its score
            total = sum(reward(reply, question(seed, k)[1]) for k, reply in enumerate(replies))
            assert r["agent_reward"] == score == total
            nonzero += total != 0
    assert nonzero > 0
    assert two_questions > 0  # multi-turn: the environment's second question came back as a user turn
    assert AddEnv.resets >= len(train_rows) + len(test_rows) + 2 * 8 * 4
    assert_agents_trained(cfg, result, "openenv", 8 * 4)


def test_an_unreachable_server_or_a_wrong_field_is_one_line(env_url):
    with pytest.raises(datasets.DatasetError, match=r"^OpenEnv server http://127\.0\.0\.1:1: reset failed: ") as err:
        datasets.load_openenv(split="test", url="http://127.0.0.1:1", test_size=2, timeout_s=2)
    assert "\n" not in str(err.value)
    with pytest.raises(datasets.DatasetError, match=r"observation field 'question' is not text \(the observation has: prompt\)"):
        datasets.load_openenv(split="test", url=env_url, test_size=2, observation_field="question")
