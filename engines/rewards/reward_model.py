"""Learned rewards: a Hugging Face sequence-classification model, or a scorer behind a loopback HTTP endpoint.

The model scores prompt + response on the last non-pad token (verl's ``reward_model`` convention: one
logit, ``num_labels=1``), batched by count or by a token budget with ``engines/training/batching.py``. The plain HTTP
backend sends ``{"prompts": [...], "responses": [...]}`` and reads ``{"scores": [...]}``; a request that
fails or times out errors only its own samples, a null score errors only its sample. The judge backend asks
an OpenAI-style chat-completions endpoint, one greedy request per sample, and reads the first number of the
reply; a failed request or a reply without a number errors only its sample.
"""

from __future__ import annotations

import json
import re
import socket
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import torch

from rlstage.engines.training.batching import plan_micro_batches

RM_SETTING = "reward_model.forward_max_token_len_per_gpu"


@dataclass(frozen=True)
class RMScore:
    score: float
    error: str | None = None


def check_reward_model_path(path: str) -> str | None:
    """Why ``path`` is not a sequence-classification model with one label, or None when it is."""
    config_file = Path(path).expanduser() / "config.json"
    if not config_file.is_file():
        return f"{path} is not a Hugging Face model folder (no config.json)"
    config = json.loads(config_file.read_text())
    archs = config.get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        return f"{path} is not a sequence-classification model (architectures: {', '.join(archs) or 'none'})"
    labels = config.get("num_labels", len(config.get("id2label") or {}) or 2)
    if labels != 1:
        return f"{path} has num_labels={labels}; a reward model has one output (num_labels=1)"
    return None


def load_reward_model(path: str) -> tuple[torch.nn.Module, object]:
    """The model in eval mode and its tokenizer, read from ``path`` by the process that scores."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    problem = check_reward_model_path(path)
    if problem is not None:
        raise ValueError(f"reward_model.model.path: {problem}")
    model = AutoModelForSequenceClassification.from_pretrained(path, torch_dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def _encode(tokenizer, prompts: list[str], responses: list[str]) -> tuple[list[list[int]], list[list[int]]]:
    p_ids = [tokenizer(p, add_special_tokens=True)["input_ids"] for p in prompts]
    r_ids = [tokenizer(r, add_special_tokens=False)["input_ids"] for r in responses]
    return p_ids, r_ids


def _forward(model: torch.nn.Module, rows: list[list[int]], pad_id: int) -> torch.Tensor:
    """One logit per row, read at its last real token (rows right-padded)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    # The model's own pooling finds the last token by pad id, which breaks when pad == eos inside a row.
    hidden = model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
    last = hidden[torch.arange(len(rows)), mask.sum(-1) - 1]
    return model.score(last).squeeze(-1).float()


@torch.no_grad()
def score_texts(
    model: torch.nn.Module,
    tokenizer,
    prompts: list[str],
    responses: list[str],
    *,
    micro_batch_size: int,
    token_budget: int | None = None,
) -> list[float]:
    """The reward model's score of each prompt + response, in order."""
    p_ids, r_ids = _encode(tokenizer, prompts, responses)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    out = [0.0] * len(prompts)
    plans = plan_micro_batches(
        list(range(len(prompts))), p_ids, r_ids, count=micro_batch_size, budget=token_budget, packed=False, setting=RM_SETTING
    )
    for plan in plans:
        scores = _forward(model, [p_ids[i] + r_ids[i] for i in plan], pad)
        for i, s in zip(plan, scores.tolist(), strict=True):
            out[i] = float(s)
    return out


# ---------------------------------------------------------------- the HTTP backend
def check_server(url: str, timeout_s: float) -> str | None:
    """Why the server at ``url`` cannot be reached (a TCP connect to its host and port), or None."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{url!r} is not an http(s) URL"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout_s).close()
    except OSError as err:
        return f"cannot reach {parts.hostname}:{port} ({err.strerror or err})"
    return None


def _post(url: str, prompts: list[str], responses: list[str], timeout_s: float) -> list:
    body = json.dumps({"prompts": prompts, "responses": responses}).encode()
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        scores = json.loads(resp.read())["scores"]
    if not isinstance(scores, list) or len(scores) != len(prompts):
        raise ValueError(f"the server answered {len(scores) if isinstance(scores, list) else type(scores).__name__} scores for {len(prompts)} samples")
    return scores


# What a failed request can raise: the samples it carried get the error, the others are unaffected.
_REQUEST_ERRORS = (urllib.error.URLError, OSError, ValueError, KeyError, IndexError, TypeError)


def _request_error(err: BaseException, timeout_s: float) -> str:
    reason = getattr(err, "reason", None) if isinstance(err, urllib.error.URLError) else None
    if isinstance(err, TimeoutError) or isinstance(reason, TimeoutError):
        return f"timeout: reward server took over {timeout_s:g}s"
    return f"reward server: {type(err).__name__}: {err}"


def score_server(url: str, prompts: list[str], responses: list[str], *, timeout_s: float, batch_size: int) -> list[RMScore]:
    """Each sample's score from the server; a failed request errors its samples, a non-number score its sample."""
    out: list[RMScore] = []
    for u in range(0, len(prompts), batch_size):
        p, r = prompts[u : u + batch_size], responses[u : u + batch_size]
        try:
            scores = _post(url, p, r, timeout_s)
        except _REQUEST_ERRORS as err:
            out += [RMScore(0.0, _request_error(err, timeout_s))] * len(p)
            continue
        for s in scores:
            ok = isinstance(s, (int, float)) and not isinstance(s, bool)
            out.append(RMScore(float(s)) if ok else RMScore(0.0, f"reward server returned a non-number score {s!r}"))
    return out


_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


@dataclass(frozen=True)
class Judge:
    """An OpenAI-style chat-completions endpoint asked to score each sample (``reward_model.server``)."""

    url: str  # the endpoint itself, e.g. http://127.0.0.1:8000/v1/chat/completions
    model: str
    judge_prompt: str  # {prompt} and {response} are filled in (by replacement: other braces stay as written)
    score_scale: float
    max_tokens: int
    timeout_s: float
    concurrency: int
    api_key: str | None = None

    def _ask(self, prompt: str, response: str) -> str:
        content = self.judge_prompt.replace("{prompt}", prompt).replace("{response}", response)
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "temperature": 0.0,  # a judge's verdict should not be sampled
            "max_tokens": self.max_tokens,
        }
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url, data=json.dumps(body).encode(), headers=headers, method="POST")
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
            reply = json.loads(resp.read())["choices"][0]["message"]["content"]
        if not isinstance(reply, str):
            raise ValueError(f"the judge's message content is {type(reply).__name__}, not text")
        return reply

    def score_one(self, prompt: str, response: str) -> RMScore:
        try:
            reply = self._ask(prompt, response)
        except _REQUEST_ERRORS as err:
            return RMScore(0.0, _request_error(err, self.timeout_s))
        number = _NUMBER.search(reply)
        if number is None:
            return RMScore(0.0, f"judge reply has no number: {reply[:80]!r}")
        return RMScore(float(number.group()) / self.score_scale)

    def scores(self, prompts: list[str], responses: list[str]) -> list[RMScore]:
        """Each sample's score, ``concurrency`` requests at a time, in the samples' order."""
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            return list(pool.map(self.score_one, prompts, responses))


# ---------------------------------------------------------------- a tiny reward model for the kit
def _wrong_answer(answer: str, rng: torch.Generator) -> str:
    """A near miss of ``answer``: one digit changed, so the model must read the sum, not the format."""
    pos = int(torch.randint(len(answer), (1,), generator=rng))
    digit = (int(answer[pos]) + int(torch.randint(1, 10, (1,), generator=rng))) % 10 if answer[pos].isdigit() else 1
    return answer[:pos] + str(digit) + answer[pos + 1 :]


def labelled_pairs(prompts: list[str], answers: list[str], seed: int) -> tuple[list[str], list[str], list[float]]:
    """Each prompt twice: with its true answer (label 1) and with a near miss (label 0)."""
    rng = torch.Generator().manual_seed(seed)
    p, r, y = [], [], []
    for prompt, answer in zip(prompts, answers, strict=True):
        p += [prompt, prompt]
        r += [answer, _wrong_answer(answer, rng)]
        y += [1.0, 0.0]
    return p, r, y


def answer_swaps(prompts: list[str], answers: list[str], k: int, seed: int) -> tuple[list[str], list[str], list[float]]:
    """Each prompt with its true answer (label 1) and ``k`` true answers of other prompts (label 0), each as often.

    Positives and negatives then draw responses from one distribution, so the response alone tells nothing
    (otherwise a reward model learns which answers are common and a policy collapses onto them).
    """
    rng = torch.Generator().manual_seed(seed)
    p, r, y = [], [], []
    for prompt, answer in zip(prompts, answers, strict=True):
        wrong = [a for a in answers if a != answer]
        for _ in range(k if wrong else 0):
            p += [prompt, prompt]
            r += [answer, wrong[int(torch.randint(len(wrong), (1,), generator=rng))]]
            y += [1.0, 0.0]
    return p, r, y


def train_reward_model(
    model: torch.nn.Module, tokenizer, prompts: list[str], responses: list[str], labels: list[float], *, steps: int, batch_size: int, lr: float, seed: int
) -> list[float]:
    """Fit the one-logit head (and body) to 0/1 labels with a logistic loss; returns the loss per step."""
    p_ids, r_ids = _encode(tokenizer, prompts, responses)
    rows = [a + b for a, b in zip(p_ids, r_ids, strict=True)]
    y = torch.tensor(labels)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    model.train()
    losses = []
    for _ in range(steps):
        idx = torch.randint(len(rows), (batch_size,), generator=gen).tolist()
        logits = _forward(model, [rows[i] for i in idx], pad)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    return losses


@dataclass(frozen=True)
class Labelled:
    """Samples for a reward model: prompt, response, 0/1 label, and the index of the prompt (its group)."""

    prompts: list[str]
    responses: list[str]
    labels: list[float]
    groups: list[int]


def policy_samples(
    model: torch.nn.Module, tokenizer, prompts: list[str], answers: list[str], data_source: str, *, n: int, max_new_tokens: int, seed: int
) -> Labelled:
    """``n`` sampled responses of the policy per prompt, labelled by the task's rule (1 when correct).

    The policy's own samples are what RL will show the reward model; one-digit near misses alone leave it
    blind to the rest of that distribution, which a policy trained on it then exploits.
    """
    from rlstage.engines.rewards import rules as rewards
    from rlstage.engines.rollout.hf import HFRolloutEngine, SamplingParams

    torch.manual_seed(seed)
    comps = HFRolloutEngine(model, tokenizer, batch_size=1024).generate(
        prompts, SamplingParams(n=n, temperature=1.0, max_new_tokens=max_new_tokens)
    )
    rows = [
        {"response_text": c.text, "ground_truth": answers[c.prompt_index], "data_source": data_source, "extra_info": "{}"}
        for c in comps
    ]
    labels = [r.score for r in rewards.score_batch(rows, timeout_s=5.0)]
    return Labelled([prompts[c.prompt_index] for c in comps], [c.text for c in comps], labels, [c.prompt_index for c in comps])


def ranking_accuracy(scores: list[float], labels: list[float], groups: list[int]) -> float:
    """Within each prompt's group, the share of (correct, incorrect) pairs the scores order correctly:
    what GRPO's group-normalised advantage reads of a reward model. NaN when no group is mixed."""
    by_group: dict[int, list[tuple[float, float]]] = {}
    for s, y, g in zip(scores, labels, groups, strict=True):
        by_group.setdefault(g, []).append((s, y))
    right = total = 0
    for items in by_group.values():
        pos = [s for s, y in items if y > 0.5]
        neg = [s for s, y in items if y <= 0.5]
        right += sum(a > b for a in pos for b in neg)
        total += len(pos) * len(neg)
    return right / total if total else float("nan")


def classification_accuracy(scores: list[float], labels: list[float]) -> float:
    """Share of samples on the right side of 0 (logit > 0 means 'correct')."""
    return sum((s > 0) == (y > 0.5) for s, y in zip(scores, labels, strict=True)) / max(1, len(labels))


def reward_model_from_policy(policy_dir: str) -> tuple[torch.nn.Module, object]:
    """A one-logit classifier on a causal policy's body (its LM head dropped, a fresh score head)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(policy_dir)
    model = AutoModelForSequenceClassification.from_pretrained(policy_dir, num_labels=1, pad_token_id=tok.pad_token_id)
    return model, tok
