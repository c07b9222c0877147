"""Tests of engines/data/datasets.py: the synthetic task, GSM8K (real data when present), verl parquet, bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlstage.engines.data import datasets as D
from rlstage.engines.metrics import is_correct
from rlstage.engines.rewards import rules as R
from rlstage.schemas.artifacts import PROMPTS
from tests_support import REPO

GSM8K_DIR = REPO.parent / "shared" / "data" / "gsm8k"


# ---------------------------------------------------------------- synthetic addition


def test_addition_problem_format() -> None:
    assert D.addition_problem(23, 58) == ("What is 23+58? ", "81")
    assert D.addition_problem(0, 0) == ("What is 0+0? ", "0")


def test_addition_splits_disjoint_deterministic_and_conforming() -> None:
    train, test = D.make_addition_splits(digits=2, train_size=900, test_size=100, seed=7)
    assert train.schema == PROMPTS and test.schema == PROMPTS
    assert (train.num_rows, test.num_rows) == (900, 100)

    def pairs(t: pa.Table) -> list[tuple[int, int]]:
        infos = [json.loads(s) for s in t.column("extra_info").to_pylist()]
        return [(i["a"], i["b"]) for i in infos]

    assert not set(pairs(train)) & set(pairs(test))
    assert len(set(pairs(train))) == 900  # no duplicates within a split either
    for (a, b), prompt, truth in zip(
        pairs(train),
        train.column("prompt").to_pylist(),
        train.column("ground_truth").to_pylist(),
        strict=True,
    ):
        assert 0 <= a < 100 and 0 <= b < 100
        assert (prompt, truth) == D.addition_problem(a, b)
    assert set(train.column("data_source").to_pylist()) == {"synthetic/addition"}
    assert train.column("messages").null_count == train.num_rows
    assert train.column("prompt_id").to_pylist()[:2] == ["addition-train-0", "addition-train-1"]

    again_train, again_test = D.make_addition_splits(digits=2, train_size=900, test_size=100, seed=7)
    assert again_train.equals(train) and again_test.equals(test)
    other, _ = D.make_addition_splits(digits=2, train_size=900, test_size=100, seed=8)
    assert not other.equals(train)


def test_addition_splits_can_use_every_pair_and_refuse_more() -> None:
    train, test = D.make_addition_splits(digits=1, train_size=90, test_size=10, seed=0)
    assert train.num_rows + test.num_rows == 100
    with pytest.raises(ValueError, match=r"train_size=90 \+ test_size=11 = 101.*only 100 exist for digits=1"):
        D.make_addition_splits(digits=1, train_size=90, test_size=11, seed=0)


def test_addition_splits_large_digit_counts_are_cheap() -> None:
    train, test = D.make_addition_splits(digits=6, train_size=1000, test_size=10, seed=1)
    assert train.num_rows == 1000 and test.num_rows == 10


# ---------------------------------------------------------------- GSM8K: the real data


@pytest.fixture(scope="module")
def gsm8k_dir() -> Path:
    if not (GSM8K_DIR / "train.jsonl").is_file():
        pytest.skip(f"GSM8K data not found at {GSM8K_DIR} (expected ../shared/data/gsm8k next to the repo)")
    return GSM8K_DIR


@pytest.fixture(scope="module")
def gsm8k_tables(gsm8k_dir: Path) -> dict[str, pa.Table]:
    return {split: D.load_gsm8k(str(gsm8k_dir / f"{split}.jsonl")) for split in ("train", "test")}


def test_gsm8k_row_counts_and_schema(gsm8k_tables: dict[str, pa.Table]) -> None:
    assert gsm8k_tables["train"].num_rows == 7473
    assert gsm8k_tables["test"].num_rows == 1319
    for split, table in gsm8k_tables.items():
        assert table.schema == PROMPTS
        ids = table.column("prompt_id").to_pylist()
        assert ids[0] == f"gsm8k-{split}-0" and len(set(ids)) == len(ids)
        assert set(table.column("data_source").to_pylist()) == {"openai/gsm8k"}


def test_gsm8k_ground_truths_are_numbers(gsm8k_tables: dict[str, pa.Table]) -> None:
    number = re.compile(r"-?\d+(\.\d+)?")
    for table in gsm8k_tables.values():
        bad = [gt for gt in table.column("ground_truth").to_pylist() if not number.fullmatch(gt)]
        assert not bad, bad[:5]


def test_gsm8k_prompts_carry_the_instruction_and_messages(gsm8k_tables: dict[str, pa.Table]) -> None:
    row = gsm8k_tables["train"].slice(0, 1).to_pylist()[0]
    assert row["prompt"].startswith("Natalia sold clips")
    assert row["prompt"].endswith(' Let\'s think step by step and output the final answer after "####".')
    assert row["messages"] == [{"role": "user", "content": row["prompt"]}]
    assert row["ground_truth"] == "72"
    info = json.loads(row["extra_info"])
    assert info["split"] == "train" and info["index"] == 0 and info["answer"].endswith("#### 72")


def test_gsm8k_reference_answers_score_one(gsm8k_tables: dict[str, pa.Table]) -> None:
    for table in gsm8k_tables.values():
        truths = table.column("ground_truth").to_pylist()
        answers = [json.loads(s)["answer"] for s in table.column("extra_info").to_pylist()]
        scores = [R.gsm8k_strict(a, t, {}) for a, t in zip(answers, truths, strict=True)]
        assert sum(scores) == len(scores)
    # A sample through the sandboxed scorer, with the reward function chosen by data_source.
    rows = gsm8k_tables["test"].slice(0, 300).to_pylist()
    batch = [{**r, "response_text": json.loads(r["extra_info"])["answer"]} for r in rows]
    results = R.score_batch(batch, timeout_s=5.0)
    assert [r.score for r in results] == [1.0] * len(rows)
    assert {r.reward_fn for r in results} == {"gsm8k"}


# ---------------------------------------------------------------- GSM8K: bad input


def _write(path: Path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


GOOD = json.dumps({"question": "1+1?", "answer": "1+1=2\n#### 2"})


def test_gsm8k_small_file_and_blank_lines(tmp_path: Path) -> None:
    table = D.load_gsm8k(
        _write(tmp_path / "mini.jsonl", [GOOD, "", json.dumps({"question": "q", "answer": "#### 1,234"})])
    )
    assert table.column("ground_truth").to_pylist() == ["2", "1234"]
    assert table.column("prompt_id").to_pylist() == ["gsm8k-mini-0", "gsm8k-mini-1"]


def test_gsm8k_missing_file(tmp_path: Path) -> None:
    with pytest.raises(D.DatasetError, match=r"nope\.jsonl: file does not exist"):
        D.load_gsm8k(str(tmp_path / "nope.jsonl"))


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_gsm8k_empty_file(tmp_path: Path, content: str) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(D.DatasetError, match=r"empty\.jsonl: file is empty"):
        D.load_gsm8k(str(path))


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"question": "q", "answer": ', r"invalid JSON"),
        ('["not", "an", "object"]', r"expected a JSON object"),
        (json.dumps({"question": "q"}), r"row has no 'answer'"),
        (json.dumps({"answer": "#### 3"}), r"row has no 'question'"),
        (json.dumps({"question": "q", "answer": "just 3"}), r"answer has no '####' final-answer marker"),
        (json.dumps({"question": "q", "answer": "3 ####  "}), r"answer has nothing after '####'"),
    ],
)
def test_gsm8k_bad_line_names_file_and_line(tmp_path: Path, bad_line: str, message: str) -> None:
    path = _write(tmp_path / "bad.jsonl", [GOOD, GOOD, bad_line, GOOD])
    with pytest.raises(D.DatasetError, match=re.escape(f"{path}:3: ") + message):
        D.load_gsm8k(path)


# ---------------------------------------------------------------- verl-format parquet


def _verl_table(n: int = 3) -> pa.Table:
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    return pa.table(
        {
            "data_source": ["openai/gsm8k"] * n,
            "prompt": pa.array(
                [
                    [
                        {"role": "system", "content": "Be brief."},
                        {"role": "user", "content": f"What is {i}+1?"},
                    ]
                    for i in range(n)
                ],
                type=pa.list_(message),
            ),
            "ability": ["math"] * n,
            "reward_model": [{"style": "rule", "ground_truth": str(i + 1)} for i in range(n)],
            "extra_info": [
                {
                    "split": "train",
                    "index": i,
                    "tools_kwargs": {"calc": {"create_kwargs": {"ground_truth": str(i + 1)}}},
                }
                for i in range(n)
            ],
        }
    )


def test_verl_parquet_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "train.parquet"
    pq.write_table(_verl_table(), path)
    table = D.load_verl_parquet(str(path))
    assert table.schema == PROMPTS and table.num_rows == 3
    row = table.to_pylist()[1]
    assert row["prompt_id"] == "verl-train-1"
    assert row["data_source"] == "openai/gsm8k"
    assert row["ground_truth"] == "2"
    assert row["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 1+1?"},
    ]
    assert row["prompt"] == "system: Be brief.\nuser: What is 1+1?"
    info = json.loads(row["extra_info"])
    assert info["tools_kwargs"] == {"calc": {"create_kwargs": {"ground_truth": "2"}}}
    assert (info["ability"], info["reward_style"], info["index"], info["split"]) == (
        "math",
        "rule",
        1,
        "train",
    )


def test_verl_parquet_extra_info_as_json_string_and_non_string_truth(tmp_path: Path) -> None:
    table = _verl_table(2).drop_columns(["extra_info", "ability"])
    table = table.append_column("extra_info", pa.array([json.dumps({"k": 1}), None]))
    table = table.set_column(
        table.column_names.index("reward_model"), "reward_model", pa.array([{"ground_truth": [1, 2]}] * 2)
    )
    path = tmp_path / "x.parquet"
    pq.write_table(table, path)
    rows = D.load_verl_parquet(str(path)).to_pylist()
    assert json.loads(rows[0]["extra_info"]) == {"k": 1}
    assert json.loads(rows[1]["extra_info"]) == {}
    assert json.loads(rows[0]["ground_truth"]) == [1, 2]


def test_verl_parquet_bad_input(tmp_path: Path) -> None:
    with pytest.raises(D.DatasetError, match="file does not exist"):
        D.load_verl_parquet(str(tmp_path / "missing.parquet"))
    path = tmp_path / "nocols.parquet"
    pq.write_table(_verl_table().drop_columns(["reward_model"]), path)
    with pytest.raises(D.DatasetError, match=r"nocols\.parquet: missing columns \['reward_model'\]"):
        D.load_verl_parquet(str(path))
    path = tmp_path / "empty.parquet"
    pq.write_table(_verl_table().slice(0, 0), path)
    with pytest.raises(D.DatasetError, match=r"empty\.parquet: file is empty"):
        D.load_verl_parquet(str(path))
    path = tmp_path / "garbage.parquet"
    path.write_text("not parquet")
    with pytest.raises(D.DatasetError, match="not a readable parquet file"):
        D.load_verl_parquet(str(path))
    path = tmp_path / "notruth.parquet"
    t = _verl_table()
    t = t.set_column(t.column_names.index("reward_model"), "reward_model", pa.array([{"style": "rule"}] * 3))
    pq.write_table(t, path)
    with pytest.raises(
        D.DatasetError, match=r"notruth\.parquet: row 0: 'reward_model' has no 'ground_truth'"
    ):
        D.load_verl_parquet(str(path))
    path = tmp_path / "blanktruth.parquet"
    t = _verl_table()
    blank = [{"style": "rule", "ground_truth": g} for g in ("1", "  ", "3")]
    t = t.set_column(t.column_names.index("reward_model"), "reward_model", pa.array(blank))
    pq.write_table(t, path)
    with pytest.raises(D.DatasetError, match=r"blanktruth\.parquet: row 1: 'reward_model\.ground_truth' is empty \(a row without its answer\)"):
        D.load_verl_parquet(str(path))


class _ChatTokenizer:
    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages: list, tokenize: bool, add_generation_prompt: bool) -> str:
        assert tokenize is False and add_generation_prompt is True
        return "".join(f"<|{m['role']}|>{m['content']}" for m in messages) + "<|assistant|>"


class _PlainTokenizer:
    chat_template = None


def test_render_messages() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    assert D.render_messages(msgs) == "user: hi"
    assert D.render_messages(msgs, _PlainTokenizer()) == "user: hi"
    assert D.render_messages(msgs, _ChatTokenizer()) == "<|user|>hi<|assistant|>"


# ---------------------------------------------------------------- dispatcher


def test_load_prompts_dispatch(tmp_path: Path) -> None:
    test = D.load_prompts("synthetic", None, split="test", digits=1, train_size=50, test_size=20, seed=3)
    assert test.num_rows == 20 and test.column("prompt_id").to_pylist()[0] == "addition-test-0"
    assert test.equals(D.make_addition_splits(1, 50, 20, 3)[1])
    assert D.load_prompts("gsm8k", _write(tmp_path / "g.jsonl", [GOOD])).num_rows == 1
    pq.write_table(_verl_table(), tmp_path / "v.parquet")
    assert D.load_prompts("verl_parquet", str(tmp_path / "v.parquet")).num_rows == 3
    with pytest.raises(D.DatasetError, match="needs a path"):
        D.load_prompts("gsm8k", None)
    with pytest.raises(
        D.DatasetError, match="unknown data source 'csv'; registered: synthetic, gsm8k, verl_parquet"
    ):
        D.load_prompts("csv", "x.csv")


# ---------------------------------------------------------------- reasoning-gym

PRODUCTS = {"task": "products", "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}}


def test_reasoning_gym_splits_share_no_question_and_score_with_the_tasks_checker() -> None:
    settings = {**PRODUCTS, "train_size": 400, "test_size": 50, "seed": 3, "instruction": "Give only the final answer."}
    train, test = D.prepare_splits("reasoning_gym", None, None, settings)
    assert train.schema == PROMPTS and test.schema == PROMPTS
    assert test.num_rows == 50 and 0 < train.num_rows <= 400
    assert not set(train.column("prompt").to_pylist()) & set(test.column("prompt").to_pylist())
    assert D.prepare_splits("reasoning_gym", None, None, settings)[1].equals(test)  # the seed fixes the held-out split
    row = test.to_pylist()[0]
    assert row["data_source"] == "reasoning_gym/products" and row["prompt"].endswith(" Give only the final answer.")
    info = json.loads(row["extra_info"])
    assert R.default_reward_fn(row["data_source"]) == "reasoning_gym"
    truth = row["ground_truth"]
    # The checker sees the response's last number: working before the answer costs nothing, a wrong one scores 0.
    assert R.reasoning_gym_score(f"First multiply the tens. So the product is {truth}.", truth, info) == 1.0
    assert R.reasoning_gym_score(f"{truth} is not it, the answer is {int(truth) + 1}", truth, info) == 0.0
    assert R.reasoning_gym_score("I don't know", truth, info) == 0.0
    # the checker's partial credit (the truth inside a longer number) can pass one half: the eval's count of correct
    # answers takes full credit only, as the rule registers
    row = next(r for r in test.to_pylist() if len(r["ground_truth"]) > 1)
    truth, info = row["ground_truth"], json.loads(row["extra_info"])
    assert 0.5 < R.reasoning_gym_score(truth + "0", truth, info) < 1.0  # 645 answered 6450: 0.75
    assert R.correct_at("reasoning_gym") == 1.0 and R.correct_at("gsm8k") is None
    assert not is_correct(R.reasoning_gym_score(truth + "0", truth, info), R.correct_at("reasoning_gym"))
    assert is_correct(R.reasoning_gym_score(truth, truth, info), R.correct_at("reasoning_gym"))
    assert is_correct(0.75) and not is_correct(0.1)  # the default rule: above one half


def test_reasoning_gym_bad_settings_are_one_line() -> None:
    from rlstage.engines.preflight import check_algorithm_names
    from rlstage.schemas.config import ConfigError, load_config

    def check(*overrides: str) -> None:
        check_algorithm_names(load_config(None, ["data.source=reasoning_gym", *overrides]))

    check(f"data.source_settings={json.dumps(PRODUCTS)}")
    with pytest.raises(ConfigError, match=r"^config error: data\.source_settings\.task: reasoning_gym has no task 'prodcuts'"):
        check('data.source_settings={"task": "prodcuts"}')
    with pytest.raises(ConfigError, match=r"^config error: data\.source_settings\.size: reasoning_gym takes no size"):
        check('data.source_settings={"task": "products", "size": 3}')
    with pytest.raises(ConfigError, match=r"^config error: data\.source_settings\.task: Field required"):
        check("data.source_settings={}")
    with pytest.raises(ConfigError, match=r"^config error: data\.source_settings\.task: gsm8k takes no settings"):
        check_algorithm_names(load_config(None, ["data.source=gsm8k", "data.train_path=a", "data.test_path=b", 'data.source_settings={"task": "x"}']))
    mine = ["data.source=jsonl", "data.train_path=a.jsonl", "data.test_path=b.jsonl"]
    with pytest.raises(ConfigError, match=r"^config error: reward\.function: rows of data\.source=jsonl \(data_source 'user'\) have no registered reward"):
        check_algorithm_names(load_config(None, mine))
    check_algorithm_names(load_config(None, [*mine, "reward.function=exact_match"]))
    check_algorithm_names(load_config(None, [*mine, 'data.source_settings={"data_source": "openai/gsm8k"}']))
    with pytest.raises(D.DatasetError, match=r"^reasoning_gym task 'products': .*"):
        D.load_prompts("reasoning_gym", None, split="test", task="products", config={"min_digits": 0})


def test_your_own_jsonl_and_parquet_by_column_names(tmp_path: Path) -> None:
    rows = [{"q": "What is 2+3?", "a": 5, "level": 1}, {"q": [{"role": "user", "content": "Say hi"}], "a": "hi", "level": 2}]
    _write(tmp_path / "mine.jsonl", [json.dumps(r) for r in rows])
    pq.write_table(pa.Table.from_pylist([{**r, "q": json.dumps(r["q"]) if isinstance(r["q"], list) else r["q"]} for r in rows[:1]]), tmp_path / "mine.parquet")
    cols = {"prompt_column": "q", "answer_column": "a", "instruction": "Answer with a number."}
    table = D.load_prompts("jsonl", str(tmp_path / "mine.jsonl"), **cols)
    first, second = table.to_pylist()
    assert first["messages"] == [{"role": "user", "content": "What is 2+3? Answer with a number."}]
    assert (first["ground_truth"], first["data_source"], json.loads(first["extra_info"])["level"]) == ("5", "user", 1)
    assert second["messages"] == [{"role": "user", "content": "Say hi"}] and second["ground_truth"] == "hi"
    assert D.load_prompts("parquet", str(tmp_path / "mine.parquet"), **cols).column("ground_truth").to_pylist() == ["5"]
    with pytest.raises(D.DatasetError, match=r"mine\.jsonl: row 1: no 'question' column \(data\.source_settings names it; the row has \['a', 'level', 'q'\]\)"):
        D.load_prompts("jsonl", str(tmp_path / "mine.jsonl"), prompt_column="question")


def test_a_row_without_its_answer_and_a_held_out_prompt_also_trained_on_are_one_line(tmp_path: Path) -> None:
    cols = {"prompt_column": "q", "answer_column": "a"}
    train = _write(tmp_path / "train.jsonl", [json.dumps({"q": f"What is {i}+1?", "a": str(i + 1)}) for i in range(5)])
    with pytest.raises(D.DatasetError, match=r"gap\.jsonl: row 2: no 'a' column"):
        D.load_prompts("jsonl", _write(tmp_path / "gap.jsonl", ['{"q": "x", "a": "1"}', '{"q": "y", "a": ""}']), **cols)
    test = _write(tmp_path / "test.jsonl", [json.dumps({"q": f"What is {i}+1?", "a": str(i + 1)}) for i in (3, 4, 9)])
    with pytest.raises(D.DatasetError) as err:
        D.prepare_splits("jsonl", train, test, cols)
    assert str(err.value) == f"{test}: 2 of 3 held-out prompts are also in {train}; the held-out split is never trained on: remove them from one file"
    apart = _write(tmp_path / "apart.jsonl", [json.dumps({"q": "What is 9+1?", "a": "10"})])
    assert [t.num_rows for t in D.prepare_splits("jsonl", train, apart, cols)] == [5, 1]


def test_a_registered_source_that_generates_its_prompts_needs_no_files():
    """``generates=True`` is the source's own trait: its two splits are generated, and a config names no files."""
    from rlstage.engines.preflight import check_data_paths
    from rlstage.schemas.config import load_config

    @D.register_data_source("test_generated", generates=True)
    def generated(path: str | None = None, split: str = "train", **kw: object) -> pa.Table:
        assert path is None
        n = 3 if split == "train" else 2
        return D.load_prompts("synthetic", None, split=split, digits=1, train_size=n, test_size=n, seed=0).slice(0, n)

    try:
        assert D.generates_prompts("test_generated") and not D.generates_prompts("jsonl")
        train, test = D.prepare_splits("test_generated", None, None, {})
        assert (train.num_rows, test.num_rows) == (3, 2)
        check_data_paths(load_config(None, ["data.source=test_generated"]))  # no data.train_path asked for
        assert not D.uses_kit("test_generated") and D.uses_kit("synthetic")
    finally:
        D.DATA_SOURCES.remove("test_generated")
