"""Prompts in the policy's own tokens on the tiny kit's character tokenizer (SmolLM2-135M-Instruct's real BPE
tokenizer and model: tests/integration/test_chat_smollm2.py)."""

from __future__ import annotations

from rlstage.engines.models.chat import render_prompt_ids
from rlstage.engines.models.tinykit import build_char_tokenizer


def test_plain_prompt_rows_are_tokenized_as_text() -> None:
    tok = build_char_tokenizer()
    row = {"prompt": "What is 2+3? ", "messages": None}
    assert render_prompt_ids(tok, row) == tok("What is 2+3? ", add_special_tokens=False)["input_ids"]
    chat_row = {"prompt": "ignored", "messages": [{"role": "user", "content": "hi"}]}
    assert tok.decode(render_prompt_ids(tok, chat_row)) == "U:hi\nA:"
