"""The reward model: scoring on the last token, the HTTP backend, combining with rules, bad input (its role in a run:
tests/integration/test_reward_model_runs.py)."""

from __future__ import annotations

import json
import math
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlstage.engines.data import datasets
from rlstage.engines.models.tinykit import build_char_tokenizer, save_model_dir
from rlstage.engines.preflight import check_reward_model
from rlstage.engines.rewards import rules as rewards
from rlstage.engines.rewards.reward_model import (
    answer_swaps,
    check_reward_model_path,
    classification_accuracy,
    labelled_pairs,
    ranking_accuracy,
    score_server,
    score_texts,
    train_reward_model,
)
from rlstage.schemas.config import ConfigError, build_config
from rlstage.schemas.stages import view_hash
from tests_support import tiny_rm


def test_scores_read_the_last_real_token_whatever_the_batching():
    model, tok = tiny_rm()
    prompts = ["1+2=", "10+20=", "3+4=", "99+1="]
    responses = ["3", "30", "8", "100<eos>"]
    one_by_one = score_texts(model, tok, prompts, responses, micro_batch_size=1)
    budgeted = score_texts(model, tok, prompts, responses, micro_batch_size=1, token_budget=24)
    for a, b in zip(one_by_one, budgeted, strict=True):
        assert a == pytest.approx(b, abs=1e-5)  # padding never changes a score
    ids = tok("1+2=3")["input_ids"]
    with torch.no_grad():
        direct = model(input_ids=torch.tensor([ids])).logits[0, 0].item()
    assert one_by_one[0] == pytest.approx(direct, abs=1e-5)
    with pytest.raises(ValueError, match="reward_model.forward_max_token_len_per_gpu"):
        score_texts(model, tok, prompts, responses, micro_batch_size=1, token_budget=4)


class _Scorer(BaseHTTPRequestHandler):
    """Scores 1.0 when the response is the sum in the prompt; 'slow' sleeps, 'bad' answers a string."""

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if any(r == "slow" for r in body["responses"]):
            time.sleep(1.5)
        scores = []
        for p, r in zip(body["prompts"], body["responses"], strict=True):
            a, b = p.rstrip("=").split("+")
            scores.append("oops" if r == "bad" else float(r.strip() == str(int(a) + int(b))))
        out = json.dumps({"scores": scores}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def handle(self):
        try:
            super().handle()
        except BrokenPipeError:  # the client gave up on a slow request: expected here
            pass

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Scorer)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/score"
    srv.shutdown()
    srv.server_close()


def test_server_scores_with_per_request_and_per_sample_isolation(server):
    got = score_server(server, ["1+2=", "2+2=", "5+5=", "3+3=", "1+1="], ["3", "5", "bad", "6", "slow"], timeout_s=0.5, batch_size=2)
    assert [g.score for g in got[:2]] == [1.0, 0.0] and got[0].error is None
    assert got[2].error is not None and "non-number" in got[2].error
    assert got[3].score == 1.0 and got[3].error is None  # its batch-mate still scored
    assert got[4].error is not None and got[4].error.startswith("timeout")
    results = [rewards.RewardResult(g.score, "reward_model.server", g.error) for g in got]
    rewards.check_failures(results, 1.0)  # 2 of 5 failed: the stage goes on
    with pytest.raises(rewards.RewardFailure, match="stop_failure_share"):
        rewards.check_failures(results, 0.4)


class _Judge(_Scorer):
    """An OpenAI-style chat-completions judge of sums: 'Score: 10' for the right answer, '0' for a wrong one;
    'shrug' gets a reply without a number, 'crash' an HTTP 500, 'slow' an answer after 1.5 s."""

    requests: list[dict] = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Judge.requests.append({**body, "auth": self.headers.get("Authorization"), "path": self.path})
        text = body["messages"][-1]["content"]
        task = text.split("Task: ")[1].split("\n")[0]
        response = text.split("Response: ")[1]
        if response == "slow":
            time.sleep(1.5)
        if response == "crash":
            self.send_error(500, "judge down")
            return
        a, b = task.rstrip("=").split("+")
        reply = "I cannot tell" if response == "shrug" else ("Score: 10" if response == str(int(a) + int(b)) else "0")
        out = json.dumps({"object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


def test_an_openai_style_judge_scores_each_sample_on_its_own(monkeypatch):
    from rlstage.engines.rewards.reward_model import Judge
    from rlstage.schemas.config import DEFAULT_JUDGE_PROMPT

    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}/v1/chat/completions"
    _Judge.requests.clear()
    try:
        judge = Judge(url, "judge-1", DEFAULT_JUDGE_PROMPT, 10.0, 16, 0.5, concurrency=3, api_key="s3cret")
        prompts = ["1+2=", "2+2=", "5+5=", "3+3=", "1+1=", "4+4="]
        got = judge.scores(prompts, ["3", "5", "shrug", "crash", "slow", "8"])
    finally:
        srv.shutdown()
        srv.server_close()
    assert [g.score for g in got[:2]] == [1.0, 0.0] and got[0].error is None and got[1].error is None  # 10 / score_scale
    assert got[2].error == "judge reply has no number: 'I cannot tell'"
    assert got[3].error is not None and "500" in got[3].error
    assert got[4].error is not None and got[4].error.startswith("timeout")
    assert got[5].score == 1.0 and got[5].error is None  # the samples around the failures still scored
    first = next(r for r in _Judge.requests if "Task: 1+2=" in r["messages"][0]["content"])
    assert first["model"] == "judge-1" and first["temperature"] == 0.0 and first["max_tokens"] == 16
    assert first["auth"] == "Bearer s3cret" and first["path"] == "/v1/chat/completions"
    assert first["messages"] == [{"role": "user", "content": DEFAULT_JUDGE_PROMPT.replace("{prompt}", "1+2=").replace("{response}", "3")}]
    # the config that selects it, and its bad settings: one line naming the setting
    with pytest.raises(ConfigError, match=r"api=openai_chat needs reward_model.server.model") as err:
        build_config({"reward_model": {"enable": True, "server": {"url": url, "api": "openai_chat"}}})
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"judge_prompt must contain \{response\}"):
        build_config({"reward_model": {"enable": True, "server": {"url": url, "api": "openai_chat", "model": "m", "judge_prompt": "rate it"}}})
    monkeypatch.delenv("RLSTAGE_TEST_JUDGE_KEY", raising=False)
    keyed = build_config({"reward_model": {"enable": True, "server": {"url": url, "api": "openai_chat", "model": "m", "api_key_env": "RLSTAGE_TEST_JUDGE_KEY"}}})
    with pytest.raises(ConfigError, match="reward_model.server.api_key_env: the environment variable RLSTAGE_TEST_JUDGE_KEY is not set"):
        check_reward_model(keyed)


def test_combine_modes():
    rule, rm = [1.0, None, 0.0], [0.5, 0.25, -1.0]
    assert rewards.combine_scores("replace", rule, rm) == [0.5, 0.25, -1.0]
    assert rewards.combine_scores("add", rule, rm) == [1.5, 0.25, -1.0]
    assert rewards.combine_scores("rule_first", rule, rm) == [1.0, 0.25, 0.0]
    with pytest.raises(ValueError, match="reward_model.combine"):
        rewards.combine_scores("max", rule, rm)


def test_bad_reward_model_settings_fail_in_one_line(tmp_path, server):
    with pytest.raises(ConfigError, match="reward_model.combine"):
        build_config({"reward_model": {"enable": True, "combine": "mean", "model": {"path": "x"}}})
    with pytest.raises(ConfigError, match="exactly one of reward_model.model.path and reward_model.server.url"):
        build_config({"reward_model": {"enable": True}})
    causal = tmp_path / "causal"
    tok = build_char_tokenizer()
    save_model_dir(LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1)), tok, causal)
    for path, why in ((causal, "not a sequence-classification model"), (tmp_path / "missing", "no config.json")):
        cfg = build_config({"reward_model": {"enable": True, "model": {"path": str(path)}}})
        with pytest.raises(ConfigError, match=f"reward_model.model.path: .*{why}") as err:
            check_reward_model(cfg)
        assert "\n" not in str(err.value)
    rm_dir = tmp_path / "rm"
    save_model_dir(tiny_rm()[0], tok, rm_dir)
    assert check_reward_model_path(str(rm_dir)) is None
    check_reward_model(build_config({"reward_model": {"enable": True, "server": {"url": server}}}))
    dead = build_config({"reward_model": {"enable": True, "server": {"url": "http://127.0.0.1:9/score", "timeout_s": 1}}})
    with pytest.raises(ConfigError, match="reward_model.server.url: cannot reach 127.0.0.1:9"):
        check_reward_model(dead)


def test_reward_stage_cache_key_hashes_the_reward_model_settings():
    off = build_config({})
    on = build_config({"reward_model": {"enable": True, "model": {"path": "/a"}}})
    other = build_config({"reward_model": {"enable": True, "model": {"path": "/b"}}})
    added = build_config({"reward_model": {"enable": True, "model": {"path": "/a"}, "combine": "add"}})
    keys = {view_hash(c, "reward") for c in (off, on, other, added)}
    assert len(keys) == 4
    # Disabled, the RM's other settings do not touch the key.
    assert view_hash(build_config({"reward_model": {"model": {"path": "/a"}}}), "reward") == view_hash(off, "reward")


def test_tiny_reward_model_fits_labelled_pairs():
    # From scratch the tiny model memorises (held-out accuracy needs a policy body: see reward_model_from_policy).
    train, _ = datasets.make_task_splits("addition", 1, 80, 20, 7)
    model, tok = tiny_rm(seed=1)
    p, r, y = labelled_pairs(train.column("prompt").to_pylist(), train.column("ground_truth").to_pylist(), seed=0)
    assert sorted(set(y)) == [0.0, 1.0] and all(a != b for a, b in zip(r[::2], r[1::2], strict=True))
    before = classification_accuracy(score_texts(model, tok, p, r, micro_batch_size=64), y)
    losses = train_reward_model(model, tok, p, r, y, steps=400, batch_size=32, lr=3e-3, seed=0)
    after = classification_accuracy(score_texts(model, tok, p, r, micro_batch_size=64), y)
    assert sum(losses[-20:]) < sum(losses[:20])
    assert after >= 0.65 > before - 0.1


def test_answer_swaps_balance_each_prompt_and_ranking_reads_groups():
    p, r, y = answer_swaps(["a", "b", "c"], ["1", "2", "2"], k=3, seed=0)
    assert len(p) == 18 and sum(y) == 9  # per prompt: its answer 3 times, 3 answers of other prompts
    for prompt, response, label in zip(p, r, y, strict=True):
        own = {"a": "1", "b": "2", "c": "2"}[prompt]
        assert (response == own) == (label == 1.0)
    # Pairs are only compared within a group: group 1 orders its pair wrongly, group 0 rightly, group 2 has no pair.
    assert ranking_accuracy([0.9, 0.1, 0.2, 0.8, 5.0], [1, 0, 1, 0, 1], [0, 0, 1, 1, 2]) == 0.5
    assert math.isnan(ranking_accuracy([1.0, 2.0], [1, 1], [0, 0]))  # no (correct, incorrect) pair


def test_bad_reward_model_build_settings_fail_in_one_line(tmp_path, capsys):
    from rlstage.flows.cli import main

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("kept")
    store = f"store.root={tmp_path / 'store'}"
    cases = [
        (["-o", str(tmp_path / "full")], "--out .* exists and is not empty"),
        (["-o", str(tmp_path / "new"), "--steps", "0"], "--steps: must be >= 1, got 0"),
        (["-o", str(tmp_path / "new"), "--lr", "0"], "--lr: must be > 0"),
        (["-o", str(tmp_path / "new"), "model.path=/some/model"], "trains on the kit's synthetic task"),
    ]
    for args, why in cases:
        assert main(["reward-model", store, *args]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and re.search(why, err), err
    assert (tmp_path / "full" / "x").read_text() == "kept" and not (tmp_path / "new").exists()
