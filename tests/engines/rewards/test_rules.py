"""Tests of engines/rewards/rules.py: extraction cases, the registry, and the sandboxed scorer's failure isolation.

The test-only reward functions below are module-level so the scorer's spawned child can import them
(by module name, or from this file when ``tests/`` is not on its path).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from rlstage.engines.rewards import rules as R


@R.register_reward_fn("test_chaos")
def chaos(response_text: str, ground_truth: str, extra_info: dict) -> float:
    """Misbehaves on command: the response text says how."""
    if response_text == "raise":
        raise ValueError("boom")
    if response_text == "hang":
        time.sleep(60)  # interrupted by the scorer's SIGALRM
    if response_text == "busy":
        while True:  # a pure-Python loop: also interrupted by SIGALRM
            pass
    if response_text == "die":
        os._exit(7)
    if response_text == "deaf":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})  # only the parent's watchdog ends this
        time.sleep(60)
    if response_text == "nan":
        return float("nan")
    return float(response_text == ground_truth)


def _rows(texts: list[str], truth: str = "ok", source: str = "synthetic/addition") -> list[dict]:
    return [
        {"response_text": t, "ground_truth": truth, "data_source": source, "extra_info": "{}"} for t in texts
    ]


# ---------------------------------------------------------------- reward functions


@pytest.mark.parametrize(
    ("response", "truth", "score"),
    [
        ("81", "81", 1.0),
        ("  81  ", "81", 1.0),
        ("81<eos>garbage", "81", 1.0),
        ("81 and more", "81", 1.0),
        ("81\n99", "81", 1.0),
        ("8", "81", 0.0),
        ("811", "81", 0.0),
        ("", "81", 0.0),
        ("<eos>81", "81", 0.0),
    ],
)
def test_exact_match(response: str, truth: str, score: float) -> None:
    assert R.exact_match(response, truth, {}) == score


@pytest.mark.parametrize(
    ("text", "strict", "flexible"),
    [
        ("so 3+4=7\n#### 7", "7", "7"),
        ("#### 1,234", "1234", "1234"),
        ("#### $1,234.50", "1234.50", "1234.50"),
        ("#### -5", "-5", "-5"),
        ("####12", "12", "12"),
        ("first #### 3 then #### 4", "4", "4"),
        ("#### 72.", "72", "72"),
        ("The answer is 42.", None, "42"),
        ("It costs $18 for 3 items", None, "3"),
        ("no numbers here", None, None),
        ("#### seven", None, None),
        ("#### 5 " + "x" * 400, None, None),  # like verl, only the last 300 characters are searched
    ],
)
def test_extract_gsm8k_answer(text: str, strict: str | None, flexible: str | None) -> None:
    assert R.extract_gsm8k_answer(text, "strict") == strict
    assert R.extract_gsm8k_answer(text, "flexible") == flexible


def test_gsm8k_scores() -> None:
    assert R.gsm8k_strict("work...\n#### 1,000", "1000", {}) == 1.0
    assert R.gsm8k_strict("#### 72.00", "72", {}) == 1.0
    assert R.gsm8k_strict("The answer is 72", "72", {}) == 0.0  # strict needs the "####" format
    assert R.gsm8k_strict("#### 71", "72", {}) == 0.0
    assert R.gsm8k_flexible("The answer is 72", "72", {}) == 1.0
    assert R.gsm8k_flexible("72 or maybe 73", "72", {}) == 0.0
    with pytest.raises(ValueError, match="unknown gsm8k method"):
        R.extract_gsm8k_answer("#### 1", "loose")


@pytest.mark.parametrize(
    ("text", "strict", "flexible"),
    [
        ("so 3+4=7\n#### 7", "7", "7"),
        ("#### 1,234", "1234", "1,234"),  # flexible keeps the commas as written
        ("#### -5", "-5", "-5"),
        ("first #### 3 then #### 4", "4", "4"),  # the last one
        ("#### 72.", "72.", "72."),  # a trailing full stop is part of the number
        ("####12", None, "12"),  # strict wants "#### " with the space
        ("#### $18", None, "18"),  # and no currency sign after it
        ("The answer is 42.", None, "42."),
        ("costs $18 for 3 items. . .", None, "3"),  # a lone "." is not an answer
        ("No idea.", None, "."),  # unless nothing else matches: verl's loop then ends on the first match
        ("no numbers here", None, None),
        ("#### 5 " + "x" * 400, None, None),  # only the last 300 characters are searched
    ],
)
def test_verl_gsm8k_extraction(text: str, strict: str | None, flexible: str | None) -> None:
    assert R.verl_gsm8k_answer(text, "strict") == strict
    assert R.verl_gsm8k_answer(text, "flexible") == flexible


def test_verl_gsm8k_score_compares_strings_and_pays_the_format_score() -> None:
    assert R.gsm8k("work...\n#### 1,000", "1000", {}) == 1.0
    assert R.gsm8k("#### 71", "72", {}) == 0.0  # verl's default format_score is 0
    assert R.gsm8k("#### 71", "72", {}, format_score=0.1) == 0.1  # parsable, wrong
    assert R.gsm8k("#### 72.00", "72", {}, format_score=0.1) == 0.1  # compared as strings, as verl does
    assert R.gsm8k("The answer is 72", "72", {}, format_score=0.1) == 0.0  # nothing to parse: no format score
    assert R.gsm8k("The answer is 72", "72", {}, method="flexible") == 1.0
    assert R.gsm8k("No idea.", "72", {}, method="flexible", format_score=0.1) == 0.1  # verl's "." quirk
    assert R.gsm8k("#### 72", "72", {}, score=2.0) == 2.0
    # rlstage's numeric scorer, kept under its own names, compares numbers.
    assert R.gsm8k_strict("#### 72.00", "72", {}) == 1.0


def test_default_reward_fn() -> None:
    assert R.default_reward_fn("synthetic/addition") == "exact_match"
    assert R.default_reward_fn("openai/gsm8k") == "gsm8k"  # verl's default_compute_score
    with pytest.raises(
        ValueError, match=r"no reward function for data_source 'lighteval/MATH'.*reward\.function"
    ):
        R.default_reward_fn("lighteval/MATH")
    assert {"exact_match", "gsm8k", "gsm8k_strict", "gsm8k_flexible"} <= set(R.REWARD_FNS)


def test_a_data_source_maps_to_a_reward_in_the_config_or_at_registration() -> None:
    """``reward.by_data_source`` maps your own sources (before the registered mapping); a reward function may
    declare the sources it scores when registered."""
    mapping = {"my_org/gsm8k_v2": "gsm8k_flexible", "openai/gsm8k": "gsm8k_strict"}
    assert R.default_reward_fn("my_org/gsm8k_v2", mapping) == "gsm8k_flexible"
    assert R.default_reward_fn("openai/gsm8k", mapping) == "gsm8k_strict"  # the config's mapping comes first
    assert R.has_rule("my_org/gsm8k_v2", None, mapping) and not R.has_rule("my_org/gsm8k_v2", None)
    with pytest.raises(ValueError, match=r"map it with reward\.by_data_source \(\{my_org/other: gsm8k\}\)"):
        R.default_reward_fn("my_org/other", mapping)
    rows = _rows(["#### 72", "72"], truth="72", source="my_org/gsm8k_v2")
    assert [r.score for r in R.score_batch(rows, timeout_s=2.0, by_data_source=mapping)] == [1.0, 1.0]
    assert {r.reward_fn for r in R.score_batch(rows, timeout_s=2.0, by_data_source=mapping)} == {"gsm8k_flexible"}

    @R.register_reward_fn("test_declares_sources", data_sources=("my_org/declared", "openai/gsm8k"))
    def declared(response_text: str, ground_truth: str, extra_info: dict) -> float:
        return 1.0

    try:
        assert R.default_reward_fn("my_org/declared") == "test_declares_sources"
        assert R.default_reward_fn("openai/gsm8k") == "gsm8k"  # a built-in source keeps its rule
    finally:
        R.REWARD_FNS.remove("test_declares_sources")
    assert not R.has_rule("my_org/declared", None)  # a source is its registration's trait: gone with it


# ---------------------------------------------------------------- the sandboxed scorer


def test_score_batch_many_cheap_samples_in_order() -> None:
    texts = [str(i % 10) for i in range(5000)]
    start = time.monotonic()
    results = R.score_batch(_rows(texts, truth="3"), timeout_s=2.0)
    assert [r.score for r in results] == [1.0 if t == "3" else 0.0 for t in texts]
    assert {r.reward_fn for r in results} == {"exact_match"} and all(r.error is None for r in results)
    pid = R._POOL[0].proc.pid
    assert R.score_batch(_rows(texts, truth="3"), timeout_s=2.0) == results  # deterministic
    assert R._POOL[0].proc.pid == pid  # the scorer process is kept across calls
    assert time.monotonic() - start < 10


def test_score_batch_chooses_by_data_source_and_method() -> None:
    rows = _rows(["#### 5"], truth="5", source="openai/gsm8k") + _rows(
        ["I get 5"], truth="5", source="openai/gsm8k"
    )
    rows += [
        {"response_text": "12", "ground_truth": "12", "data_source": "synthetic/addition", "extra_info": {}}
    ]
    strict = R.score_batch(rows, timeout_s=2.0)
    assert [(r.score, r.reward_fn) for r in strict] == [
        (1.0, "gsm8k"),
        (0.0, "gsm8k"),
        (1.0, "exact_match"),
    ]
    flexible = R.score_batch(rows, timeout_s=2.0, gsm8k_method="flexible")
    assert [r.score for r in flexible] == [1.0, 1.0, 1.0]
    wrong = _rows(["#### 6", "I get 6"], truth="5", source="openai/gsm8k")
    assert [r.score for r in R.score_batch(wrong, timeout_s=2.0, format_score=0.1)] == [0.1, 0.0]
    with pytest.raises(ValueError, match="unknown gsm8k method 'loose'"):
        R.score_batch(rows, timeout_s=2.0, gsm8k_method="loose")
    with pytest.raises(ValueError, match="no reward function for data_source 'nope'"):
        R.score_batch(_rows(["1"], source="nope"), timeout_s=2.0)
    assert R.score_batch([], timeout_s=1.0) == []


def test_score_batch_forced_function() -> None:
    rows = _rows(["#### 5"], truth="5", source="synthetic/addition")
    assert R.score_batch(rows, timeout_s=2.0)[0].score == 0.0
    replay = R.score_batch(rows, timeout_s=2.0, function="gsm8k_strict")[0]
    assert (replay.score, replay.reward_fn) == (1.0, "gsm8k_strict")
    by_path = R.score_batch(_rows(["ok"]), timeout_s=2.0, function="rlstage.engines.rewards.rules:exact_match")[0]
    assert (by_path.score, by_path.reward_fn) == (1.0, "rlstage.engines.rewards.rules:exact_match")
    with pytest.raises(
        ValueError, match=r"unknown reward function 'nope'; valid: .*exact_match.*gsm8k_strict"
    ):
        R.score_batch(rows, timeout_s=2.0, function="nope")


def test_score_batch_function_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "my_reward.py"
    path.write_text(
        "def length(response_text, ground_truth, extra_info):\n    return len(response_text) + extra_info['bonus']\n"
    )
    rows = [
        {
            "response_text": "abc",
            "ground_truth": "",
            "data_source": "x",
            "extra_info": json.dumps({"bonus": 1}),
        }
    ]
    assert R.score_batch(rows, timeout_s=2.0, function=f"{path}:length")[0].score == 4.0


# A scorer file written the way verl's are (verl/utils/reward_score/gsm8k.py's shape behind verl's
# default_compute_score): keyword parameters, the data_source asserted, a dict with extra keys returned.
VERL_SCORER = """
import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    assert data_source == "openai/gsm8k", data_source
    found = re.findall(r"#### (-?[0-9.,]+)", solution_str)
    answer = found[-1].replace(",", "") if found else None
    correct = answer == ground_truth
    return {"score": 1.0 if correct else 0.0, "acc": correct, "pred": answer or "", "split": extra_info["split"]}
"""


def test_a_reward_with_verls_signature_is_called_by_keyword_and_keeps_its_extra_keys(tmp_path: Path) -> None:
    path = tmp_path / "verl_gsm8k.py"
    path.write_text(VERL_SCORER)
    rows = _rows(["so #### 72", "so #### 71", "no answer"], truth="72", source="openai/gsm8k")
    for row in rows:
        row["extra_info"] = json.dumps({"split": "train", "index": 3})
    results = R.score_batch(rows, timeout_s=2.0, function=f"{path}:compute_score")
    assert [(r.score, r.error) for r in results] == [(1.0, None), (0.0, None), (0.0, None)]
    assert [r.metrics for r in results] == [
        {"acc": 1.0, "pred": "72", "split": "train"},
        {"acc": 0.0, "pred": "71", "split": "train"},
        {"acc": 0.0, "pred": "", "split": "train"},
    ]
    # verl's form of the setting ({path, name}) names the same function
    from rlstage.schemas.config import load_config

    cfg = load_config(None, [f"reward.function={{path: {path}, name: compute_score}}"])
    assert cfg.reward.function == f"{path}:compute_score"
    assert load_config(None, [f"reward.function={{path: {path}}}"]).reward.function == f"{path}:compute_score"


def test_verl_style_reads_the_keywords_a_function_takes() -> None:
    def plain(response_text, ground_truth, extra_info):
        return 0.0

    def verl(data_source, solution_str, ground_truth, extra_info=None):
        return 0.0

    def no_source(solution_str, ground_truth):
        return 0.0

    def catch_all(solution_str, **kwargs):
        return 0.0

    assert R.verl_style(plain) is None
    assert R.verl_style(verl) == set(R.VERL_PARAMS)
    assert R.verl_style(no_source) == {"solution_str", "ground_truth"}
    assert R.verl_style(catch_all) == set(R.VERL_PARAMS)
    assert R.verl_style(len) is None  # a builtin without a readable signature is called positionally


@pytest.mark.parametrize("value", ["1e39", "-1.7e308", "float('inf')", "float('nan')", "{'score': 1e39}"])
def test_a_reward_beyond_float32_is_that_samples_failure(tmp_path: Path, value: str) -> None:
    path = tmp_path / "huge.py"
    path.write_text(f"def score(response_text, ground_truth, extra_info):\n    return {value}\n")
    (got,) = R.score_batch(_rows(["x"]), timeout_s=2.0, function=f"{path}:score")
    assert got.score == 0.0 and got.error is not None and got.error.startswith("ValueError: reward is not a finite float32")


def test_a_dict_return_without_a_score_is_that_samples_failure(tmp_path: Path) -> None:
    path = tmp_path / "noscore.py"
    path.write_text("def score(response_text, ground_truth, extra_info):\n    return {'acc': 1.0}\n")
    (got,) = R.score_batch(_rows(["x"]), timeout_s=2.0, function=f"{path}:score")
    assert got.score == 0.0 and "needs a 'score' key" in got.error


def test_local_functions_are_refused() -> None:
    @R.register_reward_fn("test_local")
    def local(response_text: str, ground_truth: str, extra_info: dict) -> float:
        return 1.0

    try:
        with pytest.raises(ValueError, match="not a module-level function"):
            R.score_batch(_rows(["x"]), timeout_s=1.0, function="test_local")
    finally:
        R.REWARD_FNS.remove("test_local")


def test_raising_and_hanging_functions_cost_only_their_sample() -> None:
    texts = ["ok"] * 300 + ["raise", "ok", "hang", "busy", "nan", "ok", "bad extra"] + ["x"] * 700
    rows = _rows(texts)
    rows[306]["extra_info"] = "[1, 2]"
    R.score_batch(_rows(["ok"]), timeout_s=0.5, function="test_chaos")
    scorer = R._POOL[0].proc.pid
    results = R.score_batch(rows, timeout_s=0.5, function="test_chaos")
    assert len(results) == len(rows)
    errors = {i: r.error for i, r in enumerate(results) if r.error is not None}
    assert errors == {
        300: "ValueError: boom",
        302: "timeout after 0.5s",
        303: "timeout after 0.5s",
        304: "ValueError: reward is not a finite float32: nan",
        306: "ValueError: extra_info must be a JSON object, got list",
    }
    assert [r.score for r in results] == [1.0 if t == "ok" else 0.0 for t in texts]
    assert {r.reward_fn for r in results} == {"test_chaos"}
    # The hangs were cut by the child's own per-sample timer: the watchdog never had to kill the scorer.
    assert R._POOL[0].proc.pid == scorer and R._POOL[0].alive()


def test_dying_and_deaf_children_are_killed_and_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(R, "_MARGIN_S", 0.5)  # keep the watchdog's wait short for the test
    monkeypatch.setattr(R, "_CHUNK", 64)
    texts = ["ok"] * 100 + ["die"] + ["ok"] * 100 + ["deaf"] + ["ok"] * 100 + ["die"]
    results = R.score_batch(_rows(texts), timeout_s=0.3, function="test_chaos")
    errors = {i: r.error for i, r in enumerate(results) if r.error is not None}
    assert set(errors) == {100, 201, 302}
    assert errors[100] == errors[302] == "reward scorer process died (exit code 7)"
    assert errors[201].startswith("timeout after 0.3s")
    assert [r.score for r in results] == [1.0 if t == "ok" else 0.0 for t in texts]
    # The pool recovers: a fresh process scores the next batch.
    assert R.score_batch(_rows(["ok", "no"]), timeout_s=1.0, function="test_chaos") == [
        R.RewardResult(1.0, "test_chaos"),
        R.RewardResult(0.0, "test_chaos"),
    ]


def test_shutdown_and_restart() -> None:
    R.score_batch(_rows(["ok"]), timeout_s=1.0)
    proc = R._POOL[0].proc
    R.shutdown_scorer()
    assert not proc.is_alive() and R._POOL == []
    assert R.score_batch(_rows(["ok"], truth="ok"), timeout_s=1.0)[0].score == 1.0


def test_bad_timeout() -> None:
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        R.score_batch(_rows(["x"]), timeout_s=0)


def test_the_reward_stage_keeps_a_dict_returns_keys_as_per_sample_columns_and_metrics(tmp_path: Path) -> None:
    """verl's ``reward_extra_info``: each other key of a dict return is a column of ``reward_extra.parquet`` (null where a
    sample's return lacked it) and, when numeric, a mean metric; a reward without extra keys writes no such file."""
    import pyarrow as pa

    from rlstage.engines.tables import REWARD_EXTRA
    from rlstage.schemas.config import load_config
    from rlstage.tasks.stages import score_round

    path = tmp_path / "verl_gsm8k.py"
    path.write_text(VERL_SCORER)
    table = pa.table(
        {
            "sample_id": ["a", "b", "c"],
            "response_text": ["#### 72", "#### 1", "#### 72"],
            "ground_truth": ["72", "72", "72"],
            "data_source": ["openai/gsm8k"] * 3,
            "extra_info": [json.dumps({"split": "train"})] * 3,
            "prompt": ["p"] * 3,
            "response_ids": [[1], [2], [3]],
            "sample_index": [0, 1, -1],  # c: a ReMax greedy baseline, not a sample of the metrics
            "group_id": [0, 0, 0],
        }
    )
    out = score_round(load_config(None, [f"reward.function={path}:compute_score"]), table)
    assert out.metrics["reward/flat_group_share"] == 0.0  # a and b, one group, scored 1 and 0 (c is no sample)
    assert out.tables[REWARD_EXTRA].to_pylist() == [
        {"sample_id": "a", "acc": 1.0, "pred": "72", "split": "train"},
        {"sample_id": "b", "acc": 0.0, "pred": "1", "split": "train"},
        {"sample_id": "c", "acc": 1.0, "pred": "72", "split": "train"},
    ]
    assert out.metrics["reward/extra/acc/mean"] == 0.5 and out.metrics["critic/score/mean"] == 0.5
    assert not any(k.startswith("reward/extra/pred") for k in out.metrics)  # text is a column, not a metric
    plain = score_round(load_config(None, ["reward.function=gsm8k"]), table)
    assert set(plain.tables) == {"rewards.parquet"} and not any(k.startswith("reward/extra/") for k in plain.metrics)
