"""What the agent tests share: the tiny kit's character tokenizer, a scripted engine of fixed calculator turns, and
a batch of agent.function runs on it (engines/agents tests and their runs on vLLM). Apart from tests_support: building
the tokenizer takes ~1 s, which only these modules pay."""

from __future__ import annotations

import json

from rlstage.engines.agents.endpoint import run_function_batch
from rlstage.engines.agents.examples import CALCULATOR_TOOL
from rlstage.engines.agents.loop import AgentLimits, ChatFormat
from rlstage.engines.agents.tools import ToolSpec, calculator
from rlstage.engines.models.tinykit import build_char_tokenizer
from rlstage.engines.rollout.hf import Completion, SamplingParams

TOK = build_char_tokenizer()
FMT = ChatFormat(TOK)
EOS = TOK.eos_token_id
CALC = ToolSpec("calculator", "", CALCULATOR_TOOL["function"]["parameters"], calculator, 1.0)
TOOLS = {"calculator": CALC}
# A token decoding skips: text holding it re-tokenizes to other ids than the engine sampled.
SKIPPED = TOK.convert_tokens_to_ids("<bos>")


def call(name: str, **arguments) -> str:
    """A tool call as the policy writes it."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}, separators=(",", ":")) + "</tool_call>"


def ids(text: str) -> list[int]:
    return TOK.convert_tokens_to_ids(list(text))


class ScriptedEngine:
    """An engine whose turns are fixed: a calculator call wrapped in a skipped special token, then the tool's result.

    It records what it was asked and what it answered, so a test can compare the trainer's tokens with the engine's.
    """

    batch_size = 64
    tokenizer = TOK

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], list[int], list[float]]] = []

    def generate_ids(self, encoded: list[list[int]], params: SamplingParams) -> list[Completion]:
        out = []
        for j, prompt in enumerate(encoded):
            text = TOK.decode(prompt)
            if "\nR:" not in text:
                a, b = text.split("What is ")[1].split("?")[0].split("*")
                call = json.dumps({"name": "calculator", "arguments": {"expression": f"{a}*{b}"}}, separators=(",", ":"))
                resp = [SKIPPED] + ids(f"<tool_call>{call}</tool_call>") + [EOS]
            else:
                resp = ids(text.rsplit("\nR:", 1)[1].split("\n")[0]) + [SKIPPED, EOS]
            lps = [-0.05 - t / 1000 for t in range(len(resp))]
            self.calls.append((list(prompt), resp, lps))
            out.append(Completion(j, 0, prompt, resp, lps, TOK.decode(resp, skip_special_tokens=True), "stop"))
        return out


ROWS = [{"prompt": f"What is {a}*{a + 3}?", "messages": None, "extra_info": "{}", "ground_truth": str(a * (a + 3))} for a in (12, 40, 7)]
PARAMS = SamplingParams(n=2, temperature=1.0, max_new_tokens=120, seed=3)


def ik(sample) -> tuple[int, int]:
    """(prompt index, sample index) of a sample id ``<batch>-<i>-<k>``."""
    _, i, k = sample.sample_id.split("-")
    return int(i), int(k)


def run_fn(fn, engine=None, rows=ROWS, params=PARAMS, limits=AgentLimits(), **kw):
    return run_function_batch(engine or ScriptedEngine(), FMT, fn, rows, params, limits, tool_schemas=lambda r: [CALCULATOR_TOOL], **kw)
