"""The tiny local model kit: a character tokenizer and a tiny Llama, both in Hugging Face format.

No model hub is reachable here, so the project builds its own; any local Hugging Face model
directory can replace the kit through ``model.path``.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from rlstage.schemas.config import KitConfig

if TYPE_CHECKING:  # imported where used: a process that never builds the kit skips transformers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
# Every printable ASCII character is one token, so synthetic tasks (and tool-call JSON) all fit.
CHARS = [c for c in string.printable if c not in "\r\x0b\x0c"]
# A compact chat template (every character is a token): one role letter per message, the
# assistant's turn ends with eos, and a tool role so multi-turn tool calling has a format.
#   U:What is 12*34?\nA:<tool_call>{...}</tool_call><eos>\nR:408\nA:408<eos>\n
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ 'S:' + m['content'] + '\\n' }}"
    "{% elif m['role'] == 'user' %}{{ 'U:' + m['content'] + '\\n' }}"
    "{% elif m['role'] == 'assistant' %}{{ 'A:' + m['content'] + eos_token + '\\n' }}"
    "{% elif m['role'] == 'tool' %}{{ 'R:' + m['content'] + '\\n' }}"
    "{% else %}{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'A:' }}{% endif %}"
)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    split = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    hf = word_level_tokenizer(CHARS, split, decoders.Fuse())  # characters join back without separators
    hf.chat_template = CHAT_TEMPLATE
    return hf


def word_level_tokenizer(words: list[str], pre_tokenizer, decoder=None) -> PreTrainedTokenizerFast:
    """A left-padding Hugging Face tokenizer whose ids are ``SPECIAL_TOKENS`` then ``words``, one id each."""
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(SPECIAL_TOKENS + words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizer
    if decoder is not None:
        tok.decoder = decoder
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
    )


def tiny_llama_config(cfg: KitConfig, tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def build_tiny_llama(cfg: KitConfig, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    from transformers import LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    return LlamaForCausalLM(tiny_llama_config(cfg, tokenizer))


def save_model_dir(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
