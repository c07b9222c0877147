"""The stage registry: every stage declared once, its code reads only its config view, and its cache
key changes exactly when a setting in that view changes."""

from __future__ import annotations

import dataclasses
import inspect
import typing

import pyarrow as pa
import pytest
import torch
from pydantic import BaseModel
from transformers import LlamaForTokenClassification

from rlstage.engines.models.tinykit import build_char_tokenizer, build_tiny_llama
from rlstage.engines.registry import NAMED_SETTINGS, REGISTRIES, needs_of
from rlstage.engines.training.actor import TorchActor
from rlstage.engines.training.critic import TorchCritic
from rlstage.flows.iteration import Artifacts
from rlstage.schemas.config import ConfigError, KitConfig, RunConfig, build_config, load_config, merge_dicts
from rlstage.schemas.manifest import Manifest, PolicyRef
from rlstage.schemas.stages import (
    EXECUTION,
    REPLAYABLE,
    SPECS,
    STAGE_FILES,
    STAGES,
    AdvantageInputs,
    ConfigView,
    UndeclaredConfigRead,
    covers,
    spec,
    stage_view,
    view_paths,
)
from rlstage.tasks import kit as _kit  # noqa: F401  (registers the sft stage's task)
from rlstage.tasks.stages import BODIES, TASKS, StageOutput, run_stage
from rlstage.workers.group import total_update_steps
from tests_support import REPO

CALC = {"name": "calculator", "callable": "rlstage.engines.agents.tools:calculator", "description": "changed"}
# Bases whose views differ: conditional reads (kit, agent, critic, decaying schedules, eval_n) on and off.
BASES = {
    "default": ["data.train_path=train.jsonl", "data.test_path=test.jsonl"],
    "gae": [
        "algorithm.adv_estimator=gae", "critic.enable=true", "actor.optim.lr_schedule=cosine",
        "critic.optim.lr_schedule=linear", "trainer.eval_n=2", "algorithm.use_kl_in_reward=true",
    ],  # fmt: skip
    "agent": None,  # configs/agent_calc.yaml
    # settings valid only beside others: DAPO's overlong buffer and dynamic sampling, data-parallel ranks,
    # pipelined rollouts, LoRA
    "scaled": [
        "data.train_path=train.jsonl", "data.test_path=test.jsonl", "reward.overlong_buffer.len=4", "actor.engine=deepspeed",
        "ray.rollout_placement=separate", "reward_model.enable=true", "reward_model.model.path=rm",
        "reward_model.server.model=judge",  # so that reward_model.server.api=openai_chat is a valid change
        "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=3", "model.lora_rank=4",
        "trainer.max_actor_ckpt_to_keep=2",  # so that trainer.keep_checkpoint_every is a valid change
    ],  # fmt: skip
}


def _base(name: str) -> RunConfig:
    overrides = BASES[name]
    return load_config(REPO / "configs" / "agent_calc.yaml") if overrides is None else load_config(None, overrides)


def _leaves(model: type[BaseModel], prefix: str = "") -> list[tuple[str, typing.Any]]:
    out = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += _leaves(ann, f"{prefix}{name}.")
        else:
            out.append((prefix + name, ann))
    return out


# actor.rollout_correction is copied from algorithm.rollout_correction at load (verl's layout): never set alone.
LEAVES = [(p, ann) for p, ann in _leaves(RunConfig) if not p.startswith("actor.rollout_correction.")]
EXPLICIT = {
    "agent.tools": [[CALC]],
    "agent.function": ["rlstage.engines.agents.examples:calculator_agent"],
    "ray.stages": [{"rollout": {"num_cpus": 1.0}}],
    "store.storage_options": [{"anon": True}],
    "ray.trainer_resources": [{"node_a": 1.0}],
    "ray.rollout_resources": [{"node_b": 1.0}],
    "ray.ref_critic_resources": [{"node_b": 1.0}],
    "optim.betas": [[0.8, 0.99]],
    "filter_groups.metric": ["seq_reward"],
    "data.source_settings": [{"prompt_column": "question"}],
    "reward.by_data_source": [{"synthetic/addition": "gsm8k_flexible"}],
}


def _candidates(path: str, value: typing.Any, ann: typing.Any) -> list:
    """Other values for a leaf, tried in order until the config validates."""
    named = path.removesuffix(".name")
    if named in NAMED_SETTINGS and not isinstance(value, list):  # a registered name: the others of its registry
        return [n for n in REGISTRIES[NAMED_SETTINGS[named]] if n != value]
    for key, values in EXPLICIT.items():
        if path.endswith(key):
            return values
    args = typing.get_args(ann)
    if typing.get_origin(ann) is typing.Literal:
        return [a for a in args if a != value]
    if isinstance(value, list):
        return [["rollout:1"]]
    if value is None:
        inner = next(a for a in args if a is not type(None))
        if typing.get_origin(inner) is typing.Literal:
            return list(typing.get_args(inner))
        return {int: [4096, 7], float: [0.5], str: ["changed"]}[inner]
    tail = [None] if type(None) in args else []
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [value + 1, value * 2, value // 2, value - 1, *tail]
    if isinstance(value, float):
        return [value * 0.5, value + 0.5, value * 2, *tail]
    if isinstance(value, str):
        return [value + "x", *tail]
    raise AssertionError(f"no candidate values for {path} ({ann})")


def _get(dump: dict, path: str) -> typing.Any:
    for part in path.split("."):
        dump = dump[part]
    return dump


def _changed(base: RunConfig, path: str, ann: typing.Any) -> RunConfig | None:
    dump = base.model_dump(mode="json")
    for value in _candidates(path, _get(dump, path), ann):
        tree: dict = {}
        node = tree
        *parents, leaf = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
        try:
            changed = build_config(merge_dicts(dump, tree))
        except ConfigError:
            continue
        if _get(changed.model_dump(mode="json"), path) != _get(dump, path):
            return changed
    return None


class _Executed(Exception):
    pass


def _produce_fails() -> StageOutput:
    raise _Executed


def _executes(cfg: RunConfig, stage: str) -> bool:
    """Whether ``run_stage`` (the real skip-or-produce path) would execute ``stage`` under ``cfg``."""
    iteration = None if stage in ("data_prep", "sft") else 1
    try:
        run_stage(stage_view(cfg, stage, needs_of), stage, iteration, {}, _produce_fails, run="keys")
    except _Executed:
        return True
    return False


@pytest.mark.parametrize("base_name", list(BASES))
def test_every_leaf_reexecutes_exactly_the_stages_whose_view_holds_it(base_name, tmp_path):
    base = _base(base_name).model_copy(update={"store": RunConfig().store.model_copy(update={"root": str(tmp_path)})})
    table = pa.table({"x": [1]})
    for stage in STAGES:  # the base's artifacts, committed under the base's keys
        iteration = None if stage in ("data_prep", "sft") else 1
        run_stage(stage_view(base, stage, needs_of), stage, iteration, {}, lambda: StageOutput(tables={"t.parquet": table}), run="keys")
        assert not _executes(base, stage)
    walked, mismatches = [], []
    for path, ann in LEAVES:
        changed = _changed(base, path, ann)
        if changed is None:
            continue  # no valid other value in this base (e.g. critic.enable under gae); another base walks it
        walked.append(path)
        if path.split(".")[0] in EXECUTION:
            changed = changed.model_copy(update={"store": base.store, "run_name": base.run_name})
            expected = set()  # where a run executes never changes what a stage computes
        else:
            expected = {s for s in STAGES if covers(path, view_paths(base, s, needs_of))}
        executed = {s for s in STAGES if _executes(changed, s)}
        if executed != expected:
            mismatches.append(f"{path}: executed {sorted(executed)}, view holds it in {sorted(expected)}")
    assert not mismatches, "\n".join(mismatches)
    assert len(walked) > 0.9 * len(LEAVES)


def test_every_leaf_is_walked_in_some_base():
    unwalked = [p for p, ann in LEAVES if all(_changed(_base(b), p, ann) is None for b in BASES)]
    assert unwalked == []


def test_settings_no_stage_reads_by_default_are_the_documented_ones():
    """Settings outside every view of the default run: config checks, the flow's schedule, and
    settings that only matter once another one is set (agent.*, decaying schedules)."""
    cfg = load_config()
    unread = {
        p
        for p, _ in LEAVES
        if p.split(".")[0] not in EXECUTION and not any(covers(p, view_paths(cfg, s, needs_of)) for s in STAGES)
    }
    agent = {p for p in unread if p.startswith("agent.")}
    assert agent == {p for p, _ in LEAVES if p.startswith("agent.") and p != "agent.enable"}
    rm = {p for p in unread if p.startswith("reward_model.")}  # read once reward_model.enable is set
    assert rm == {p for p, _ in LEAVES if p.startswith("reward_model.") and p != "reward_model.enable"}
    assert unread - agent - rm == {
        "trainer.iterations",  # read by decaying schedules only (workers.group.total_update_steps)
        "trainer.eval_every",  # the flow's eval schedule
        "trainer.async_staleness",  # the flow's schedule: which policy a rollout gets (recorded as its input)
        "trainer.eval_require_maj",  # a config check, and read by the eval once trainer.eval_n > 0
        "trainer.max_actor_ckpt_to_keep",  # the flow's checkpoint retention after each iteration
        "trainer.keep_checkpoint_every",
        "rollout.weight_sync",  # how weights reach a rollout role placed apart (its workers), not which
        "rollout.weight_bucket_mib",
    }


def test_registry_derives_the_stage_lists_and_every_stage_has_one_task():
    assert STAGES == tuple(s.name for s in SPECS) and set(TASKS) == set(STAGES)
    assert STAGE_FILES == {
        "rollout": "rollouts.parquet", "reward": "rewards.parquet", "filter_groups": "groups.parquet",
        "advantage": "experience.parquet",
        "critic": "metrics.parquet", "update": "metrics.parquet", "eval": "eval.parquet",
    }  # fmt: skip
    assert REPLAYABLE == ("rollout", "reward", "filter_groups", "advantage", "update", "eval")
    held = {f.name for f in dataclasses.fields(Artifacts)}  # what an iteration holds, by the names stages take
    for s in SPECS:
        assert set(s.inputs) <= held, s.name
        for path in s.reads:  # every declared path is a setting
            node: typing.Any = RunConfig()
            for part in path.split("."):
                node = getattr(node, part)
    for name in STAGES:
        assert load_config(None, [f"ray.stages.{name}.num_cpus=1"]).ray.resources(name).num_cpus == 1
    with pytest.raises(ConfigError, match="unknown stage 'rollot'; valid: data_prep, sft, rollout"):
        load_config(None, ["ray.stages.rollot.num_cpus=1"])


def test_reading_an_undeclared_setting_names_the_stage_and_the_path():
    view = stage_view(load_config(), "reward")
    assert view.reward.timeout_s == 2.0 and view.store.retries == 3 and view.run_name == "demo"
    with pytest.raises(UndeclaredConfigRead) as err:
        view.rollout.n  # noqa: B018
    msg = str(err.value)
    assert "stage 'reward' read config 'rollout.n'" in msg and "schemas/stages.py" in msg and "\n" not in msg
    with pytest.raises(UndeclaredConfigRead, match="'needs_ref'"):
        view.needs_ref  # noqa: B018  (a derived property reads settings outside the view)
    with pytest.raises(TypeError, match="read-only"):
        view.reward.timeout_s = 3.0


def test_a_stage_body_reading_outside_its_view_fails_before_producing(tmp_path):
    """The data_prep body under a view without its conditional kit paths: the real code's read fails."""
    cfg = load_config(None, [f"store.root={tmp_path}"])
    body = BODIES["data_prep"]  # the stage's own code, given a narrower view than its spec declares
    narrow = ConfigView(cfg, "data_prep", ("data.source", "data.test_path", "data.train_path"))
    with pytest.raises(UndeclaredConfigRead, match="stage 'data_prep' read config 'kit.task'"):
        body(narrow)
    result = TASKS["data_prep"].fn(cfg)  # the registered task: the declared view suffices
    assert result.executed and result.metrics["data/train_prompts"] == cfg.kit.train_size


def test_total_update_steps_reads_only_what_decaying_schedules_declare():
    decaying = load_config(None, ["actor.optim.lr_schedule=cosine", "trainer.iterations=3"])
    assert total_update_steps(stage_view(decaying, "update")) == total_update_steps(decaying)
    with pytest.raises(UndeclaredConfigRead, match="stage 'update' read config 'data.prompts_per_iteration'"):
        total_update_steps(stage_view(load_config(), "update"))  # constant: the schedule's length is unread


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    model = build_tiny_llama(KitConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), tok)
    critic = LlamaForTokenClassification(model.config.__class__(**{**model.config.to_dict(), "num_labels": 1}))
    prompts = [tok("What is 1+2? ", add_special_tokens=False)["input_ids"]] * 4
    responses = [[5, 6, 7], [5, 6], [8], [9, 9, 9, 9]]
    batch = {
        "prompt_ids": prompts,
        "response_ids": responses,
        "response_mask": [[1] * len(r) for r in responses],
        "old_log_probs": [[-1.0] * len(r) for r in responses],
        "ref_log_probs": [[-1.0] * len(r) for r in responses],
        "advantages": [[0.5] * len(r) for r in responses],
        "values": [[0.0] * len(r) for r in responses],
        "returns": [[1.0] * len(r) for r in responses],
    }
    return tok, model, critic, batch


def test_the_train_engines_read_only_their_stages_views(tiny):
    """What the policy worker runs for each stage, given that stage's view of its sections."""
    tok, model, critic_model, batch = tiny
    cfg = load_config(None, [*BASES["gae"], "actor.use_kl_loss=true", "actor.micro_batch_tokens=300"])
    adv, upd, crit = (stage_view(cfg, s, needs_of) for s in ("advantage", "update", "critic"))
    P, R, pad = batch["prompt_ids"], batch["response_ids"], tok.pad_token_id
    # advantage: the no-grad recompute on a bare actor (as the worker's reference pass), and the values
    frozen = TorchActor.__new__(TorchActor)
    frozen.model, frozen.cfg, frozen.pad_id = model, adv.actor, pad
    assert [len(x) for x in frozen.compute_log_probs(P, R, 1.0)] == [3, 2, 1, 4]
    bare = TorchCritic.__new__(TorchCritic)
    bare.model, bare.cfg, bare.pad_id = critic_model, adv.critic, pad
    assert [len(x) for x in bare.compute_values(P, R)] == [3, 2, 1, 4]
    # update and critic: the engines built and stepped from the views (decaying schedules included)
    actor = TorchActor(model, upd.actor, pad, total_update_steps(upd))
    assert "actor/pg_loss" in actor.update(batch, upd.rollout.temperature, upd.trainer.seed)
    critic = TorchCritic(critic_model, crit.critic, pad, total_update_steps(crit))
    assert "critic/vf_loss" in critic.update(batch, crit.trainer.seed)
    with pytest.raises(UndeclaredConfigRead, match="stage 'advantage' read config 'actor.optim.lr'"):
        TorchActor(model, adv.actor, pad, 10)  # the advantage stage never builds an optimizer


def test_a_run_whose_schedule_reads_its_length_cannot_change_it(tmp_path):
    """trainer.iterations may change between invocations of a run unless a stage's view holds it."""
    from rlstage.flows.checks import record_run_config
    from rlstage.tasks.runtime import store_for

    for schedule, refused in (("constant", False), ("cosine", True)):
        cfg = load_config(None, [f"store.root={tmp_path}", f"run_name={schedule}", f"actor.optim.lr_schedule={schedule}"])
        record_run_config(store_for(cfg), cfg)
        longer = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"iterations": 20})})
        if refused:
            with pytest.raises(ConfigError, match="trainer.iterations: stored 10, given 20"):
                record_run_config(store_for(longer), longer)
        else:
            record_run_config(store_for(longer), longer)


def test_a_stage_tasks_parameters_and_cache_key_inputs_come_from_its_spec():
    """The task's keyword parameters are its spec's inputs (an optional one defaults to None); inputs given by
    position are refused; the cache key holds each given input's id, the last experience only under adaptive KL."""
    params = inspect.signature(TASKS["advantage"].fn).parameters
    assert list(params) == ["cfg", "iteration", *spec("advantage").inputs, "version", "meta"]
    assert [n for n, p in params.items() if p.default is None and n != "meta"] == ["ref", "critic", "prev_experience"]
    assert list(inspect.signature(TASKS["rollout"].fn).parameters)[-1] == "ahead"  # the body's own option
    assert list(inspect.signature(TASKS["data_prep"].fn).parameters) == ["cfg", "version", "meta"]
    m = Manifest(run="r", iteration=1, stage="rollout", artifact_id="ro", key="k", config_hash="c", code_version="v", created_at="t")
    pol, ref = PolicyRef(version="p"), PolicyRef(version="f")
    x = AdvantageInputs(rollouts=m, rewards=m, policy=pol, ref=ref, prev_experience=m)
    view = stage_view(load_config(None, []), "advantage", needs_of)
    assert x.key(view) == {"rollouts": "ro", "rewards": "ro", "policy": "p", "ref": "f"}
    kl = load_config(None, ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive"])
    assert x.key(stage_view(kl, "advantage", needs_of))["prev_experience"] == "ro"
    with pytest.raises(TypeError):
        TASKS["update"].fn(load_config(None, []), 1, m, pol)  # by position: never
