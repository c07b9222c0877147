"""Prompts in the policy's own tokens, verl's way: chat messages through the model's chat template.

A prompts-table row with ``messages`` is rendered with ``apply_chat_template(add_generation_prompt=True)``
(as verl's RL dataset does); a row without (the tiny kit's plain-text tasks) is tokenized as it stands.
Generation stops at eos and at the token that closes an assistant turn in the template.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from rlstage.schemas.config import ConfigError

_PROBE = "@@rlstage-assistant@@"


class ChatTemplateError(ConfigError):
    """Chat-message prompts and a tokenizer that cannot render them: one line naming the model."""


@lru_cache(maxsize=4)
def policy_tokenizer(model_path: str | None) -> Any:
    """The tokenizer of the policy at ``model_path`` (None: the tiny kit's), loaded once per process.

    Callers only read it (padding side is passed explicitly where it matters).
    """
    if model_path is None:
        from rlstage.engines.models.tinykit import build_char_tokenizer

        return build_char_tokenizer()
    from transformers import AutoTokenizer

    path = Path(model_path).expanduser()
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ChatTemplateError(f"model.path {model_path}: no usable tokenizer ({err})".splitlines()[0]) from None


def _model_name(tokenizer: Any) -> str:
    return getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__


def render_prompt_ids(tokenizer: Any, row: dict) -> list[int]:
    """The prompt ids of one prompts-table row (``messages`` or ``prompt``) for ``tokenizer``'s model."""
    messages = row.get("messages")
    if not messages:
        return list(tokenizer(row["prompt"], add_special_tokens=False)["input_ids"])
    check_chat_template(tokenizer, f"data_source {row.get('data_source')!r}")
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    # The template writes its own special tokens (bos, <|im_start|>): none are added on top.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def check_chat_template(tokenizer: Any, prompts: str) -> None:
    """Chat-message ``prompts`` (named in the error) need a tokenizer with a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            f"config error: model.path {_model_name(tokenizer)} has no chat template, but the prompts of "
            f"{prompts} are chat messages (use a model folder whose tokenizer carries one)"
        )


def render_batch(tokenizer: Any, rows: Sequence[dict]) -> list[list[int]]:
    return [render_prompt_ids(tokenizer, r) for r in rows]


def stop_token_ids(tokenizer: Any) -> list[int]:
    """eos first, then the special token that ends an assistant turn in the chat template (if another).

    The turn's end is read off a rendered assistant message: the first token after its content,
    when that token is a special one (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``).
    """
    stops = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if not getattr(tokenizer, "chat_template", None):
        return stops
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # a template that refuses this conversation (a tool-only format, say) adds no stop
        return stops
    at = text.rfind(_PROBE)
    closing = tokenizer(text[at + len(_PROBE) :], add_special_tokens=False)["input_ids"] if at >= 0 else []
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    if closing and closing[0] in special and closing[0] not in stops:
        stops.append(closing[0])
    return stops
