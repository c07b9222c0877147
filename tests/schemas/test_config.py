import json

import pytest

from rlstage.schemas.config import ConfigError, RunConfig, load_config, parse_overrides
from tests_support import REPO


def test_defaults_validate():
    cfg = load_config()
    assert isinstance(cfg, RunConfig)
    assert cfg.algorithm.adv_estimator.name == "grpo"


def test_yaml_and_dotted_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("run_name: x\nactor:\n  optim:\n    lr: 0.001\n")
    cfg = load_config(p, ["actor.optim.lr=1e-5", "algorithm.adv_estimator=rloo", "rollout.n=4"])
    assert cfg.run_name == "x"
    assert cfg.actor.optim.lr == pytest.approx(1e-5)
    assert cfg.algorithm.adv_estimator.name == "rloo"
    assert cfg.rollout.n == 4


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["actor.optim.lrr=1"], "config error: actor.optim.lrr: not a setting; did you mean actor.optim.lr?"),
        (["rollout.nn=1", "rollotu.n=2", "actor.qq=1"], "config error: rollout.nn: not a setting; did you mean rollout.n?; also unknown: actor.qq, rollotu (did you mean rollout?)"),
        (["actor.optim.lr=-1"], "config error: actor.optim.lr:"),
        (["rollout.n=0"], "config error: rollout.n:"),
        (["algorithm.adv_estimator=foo"], "config error: algorithm.adv_estimator: unknown advantage estimator 'foo'"),
        (["actor.policy_loss.clip_ratio_low=-0.1"], "config error: actor.policy_loss.clip_ratio_low: Input should be"),
        (["actor.policy_loss=gspoo"], "config error: actor.policy_loss: unknown policy loss 'gspoo'; registered: vanilla"),
        (["actor.policy_loss={name: sapo, clip_ratio_low: 0.1}"], "actor.policy_loss.clip_ratio_low: sapo takes no"),
        (["actor.loss_agg_mode=mean"], "config error: actor.loss_agg_mode: unknown loss aggregation mode 'mean'"),
        (["algorithm.kl_penalty=k4"], "config error: algorithm.kl_penalty: unknown KL penalty 'k4'; registered: kl, k1"),
        (["actor.zero_stage=4"], "config error: actor.zero_stage:"),
        (["run_name=a/b"], "config error: run_name:"),
        (["run_name=.."], "config error: run_name:"),
        (["ray.stages.rollot.num_cpus=1"], "unknown stage 'rollot'"),
        (["rollout.n=1"], "needs groups"),
        (["algorithm.adv_estimator=gae"], "needs a critic"),
        (["data.source=gsm8k"], "data.train_path is required"),
        (["nonsense"], "is not of the form key=value"),
        (["actor.group_mini_batches=true", "actor.ppo_mini_batch_size=12", "actor.micro_batch_size=12", "data.prompts_per_iteration=12"],
         "actor.group_mini_batches: actor.ppo_mini_batch_size=12 must be a multiple of rollout.n=8"),
        (["rollout.share_prompts=true", "rollout.engine=vllm"], "rollout.share_prompts is the HF engine's"),
    ],
)
def test_bad_config_names_the_key(overrides, needle):
    with pytest.raises(ConfigError) as err:
        load(overrides)
    msg = str(err.value)
    assert needle in msg
    assert "\n" not in msg


def load(overrides):
    """What the CLI loads: the config model, then the names it gives against the engines' registries."""
    from rlstage.engines.preflight import check_registered_names

    check_registered_names(cfg := load_config(None, overrides))
    return cfg


def test_unknown_estimator_lists_valid_names():
    with pytest.raises(ConfigError) as err:
        load(["algorithm.adv_estimator=ppo2"])
    assert "grpo" in str(err.value) and "rloo" in str(err.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_policy_loss_settings_nest_under_their_loss():
    from rlstage.engines import algorithms as algos

    cfg = load(["actor.policy_loss={name: gspo, clip_ratio_low: 0.0003, clip_ratio_high: 0.0004}"])
    settings = algos.policy_loss_settings(cfg.actor.policy_loss)
    assert isinstance(settings, algos.LossSettings)
    assert (settings.clip_ratio_low, settings.clip_ratio_high, settings.clip_ratio_c) == (0.0003, 0.0004, 3.0)
    plain = load(["actor.policy_loss=sapo"])  # a plain name: the loss's defaults
    assert algos.policy_loss_settings(plain.actor.policy_loss).model_dump() == {"tau_pos": 1.0, "tau_neg": 1.05}


def test_flat_loss_settings_are_read_with_a_deprecation_line_and_hash_as_before():
    with pytest.warns(DeprecationWarning, match=r"actor\.clip_ratio_high is deprecated: set actor\.policy_loss\.clip_ratio_high"):
        flat = load(["actor.policy_loss=gspo", "actor.clip_ratio_high=0.28"])
    nested = load(["actor.policy_loss={name: gspo, clip_ratio_high: 0.28}"])
    assert flat.actor.policy_loss == nested.actor.policy_loss
    assert flat.stage_hash("actor") == nested.stage_hash("actor")
    # the hashed form is 0.1's flat one: a loss name and every flat setting beside it
    actor = nested.hashed_dump()["actor"]
    assert actor["policy_loss"] == "gspo" and actor["clip_ratio_high"] == 0.28 and actor["dro_beta"] is None
    with pytest.raises(ConfigError, match=r"actor\.clip_ratio_high \(deprecated\) and actor\.policy_loss\.clip_ratio_high"):
        load_config(None, ["actor.policy_loss={name: gspo, clip_ratio_high: 0.3}", "actor.clip_ratio_high=0.28"])


_VLLM_SET = {
    "kv_cache_bytes": 134217728, "block_size": 32, "max_num_seqs": 64, "cpu_threads_bind": "auto",
    "quiet_waits": True, "enforce_eager": False,
}  # fmt: skip


def test_flat_vllm_settings_are_read_with_a_deprecation_line_and_both_set_is_one_line():
    with pytest.warns(DeprecationWarning) as said:
        flat = load_config(None, [f"rollout.vllm_{k}={v}" for k, v in _VLLM_SET.items()])
    assert sorted(str(w.message) for w in said) == sorted(
        f"rollout.vllm_{k} is deprecated: set rollout.vllm.{k} (the flat name is read until 0.3)"
        for k in _VLLM_SET
    )
    nested = load_config(None, [f"rollout.vllm.{k}={v}" for k, v in _VLLM_SET.items()])
    assert flat.rollout.vllm == nested.rollout.vllm and nested.rollout.vllm.model_dump() == _VLLM_SET
    with pytest.raises(ConfigError) as err:
        load_config(None, ["rollout.vllm.max_num_seqs=8", "rollout.vllm_max_num_seqs=16"])
    assert str(err.value) == (
        "config error: rollout: rollout.vllm_max_num_seqs (deprecated) and rollout.vllm.max_num_seqs are both "
        "set: keep the second"
    )


def test_vllm_settings_keep_the_cache_keys_of_their_flat_names():
    """A store written before rollout.vllm nested continues without re-executing a stage: the stage views hash its
    settings by their flat names (the expected keys were computed by the commit before the move, with flat names)."""
    import warnings

    from rlstage.schemas.stages import view_hash

    given = [f"rollout.vllm.{k}={v}" for k, v in _VLLM_SET.items()]
    nested = load_config(None, ["rollout.engine=vllm", *given])
    default = load_config(None, [])
    shipped = load_config(REPO / "configs" / "reasoning-smollm2.yaml")
    keys = [view_hash(cfg, stage) for cfg in (default, nested, shipped) for stage in ("rollout", "eval")]
    assert keys == [
        "61aad12cac92a249", "9a020844e4582c57", "7edbdba6c191abfe", "92a4faec9c72ef21", "c326ddc5baa3bcbd",
        "ac5943b54a497d53",
    ]  # fmt: skip
    assert nested.stage_hash("rollout") == "4648fec527682201"
    flat = [f"rollout.vllm_{k}" for k in _VLLM_SET]
    assert nested.stage_hash("rollout.vllm") == nested.stage_hash(*flat)  # the section: every flat name
    assert nested.stage_hash("rollout.vllm.block_size") == nested.stage_hash("rollout.vllm_block_size")
    assert not {"vllm", "vllm_block_size"} & set(default.hashed_dump()["rollout"])  # block_size unset
    # a stored config of before (every flat setting, block_size unset) loads as the defaults, saying nothing
    stored = {f"vllm_{k}": v for k, v in default.rollout.vllm.model_dump().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert RunConfig.model_validate({"rollout": stored}).rollout == default.rollout


def test_override_values_are_yaml_scalars():
    assert parse_overrides(["a.b=true", "a.c=3", "d=x"]) == {"a": {"b": True, "c": 3}, "d": "x"}


def test_stage_hash_depends_only_on_named_sections():
    a = load_config(None, ["actor.optim.lr=1e-4"])
    b = load_config(None, ["actor.optim.lr=2e-4"])
    assert a.stage_hash("reward") == b.stage_hash("reward")
    assert a.stage_hash("actor") != b.stage_hash("actor")


def test_the_config_package_imports_no_engine_task_or_flow_module():
    """schemas/ is a leaf: loading and validating a config (agent tools included) imports no code that runs."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from rlstage.schemas.config import load_config\n"
        "import rlstage.schemas.stages, rlstage.schemas.artifacts, rlstage.schemas.manifest\n"
        "load_config('configs/agent_calc.yaml', ['rollout.engine=vllm', \"agent.tools=[{name: c, callable: 'rlstage.engines.agents.tools:calculator'}, {name: t, callable: 'no_such:fn'}]\"])\n"
        "print(sorted(m for m in sys.modules if m.split('.')[:2] in (['rlstage', 'engines'], ['rlstage', 'tasks'], ['rlstage', 'flows'])))\n"
    )
    root = REPO
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["agent.tools=[{name: c, callable: 'no_such_module:fn'}]"], "config error: agent.tools.0.callable: cannot import 'no_such_module:fn'"),
        (["agent.tools=[{name: c, callable: 'rlstage.engines.agents.tools:calculator', parameters: {type: objekt}}]"], "config error: agent.tools.0.parameters: not a valid JSON schema"),
        (["agent.enable=true", "agent.chat_template=/no/such/template.jinja"], "config error: agent.chat_template: "),
        (["model.path=/no/such/model"], "model.path /no/such/model: not a directory"),
    ],
)
def test_preflight_checks_give_one_line(overrides, needle):
    """Checks that need a user's module, a template file or a model directory: before any stage (the CLI and
    every flow run flows/checks.py's input checks, then engines/preflight.py's)."""
    from rlstage.engines.preflight import preflight
    from rlstage.flows.checks import InputError, check_inputs

    cfg = load_config(None, overrides)  # the config itself is valid
    with pytest.raises((ConfigError, InputError)) as err:
        check_inputs(cfg)
        preflight(cfg)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_preflight_accepts_the_agent_demo_config():
    from rlstage.engines.preflight import preflight

    preflight(load_config("configs/agent_calc.yaml"))


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["trainer.eval_require_maj=true"], "trainer.eval_require_maj: maj@N votes over trainer.eval_n >= 2 sampled answers, got 0"),
        (
            ["trainer.eval_require_maj=true", "trainer.eval_n=4", "data.source=gsm8k", "data.train_path=t", "data.test_path=h"],
            "trainer.eval_require_maj: the reward function of data.source=gsm8k, gsm8k extracts no answer",
        ),
        (
            ["trainer.eval_require_maj=true", "trainer.eval_n=4", "reward.function=my_rewards.py:score"],
            "trainer.eval_require_maj: reward.function my_rewards.py:score extracts no answer",
        ),
    ],
)
def test_required_maj_without_an_answer_extractor_is_one_line(overrides, needle):
    from rlstage.engines.preflight import check_registered_names

    with pytest.raises(ConfigError) as err:
        check_registered_names(load_config(None, overrides))  # the extractors' registry is the engines
    assert needle in str(err.value) and "\n" not in str(err.value)
    # without the requirement the same data is evaluated, maj@N left out as verl leaves it out without a pred
    load_config(None, [o for o in overrides if not o.startswith("trainer.eval_require_maj")])


def test_required_maj_with_an_extracting_reward_function_loads():
    cfg = load_config(None, ["trainer.eval_require_maj=true", "trainer.eval_n=4", "reward.function=gsm8k_strict"])
    assert cfg.trainer.eval_require_maj


LATE_SETTINGS = ["actor.share_prompts", "actor.optim.fused", "actor.group_mini_batches", "rollout.share_prompts"]


@pytest.mark.parametrize("late", LATE_SETTINGS)
def test_a_run_recorded_before_a_late_setting_continues_after_the_upgrade(tmp_path, late):
    """A nightly run recorded by a version without a setting (``hashed_when_set``) continues under a version
    with it, while the setting stays at its default: the same stage keys, the same run identity. Set, it
    conflicts (the stored stages were computed without it)."""
    from rlstage.flows.checks import _identity, check_run_config, record_run_config
    from rlstage.infra.store import ArtifactStore

    store = ArtifactStore(str(tmp_path))
    cfg = load_config(None, ["run_name=nightly"])
    record_run_config(store, cfg)
    stored = store.get_json("nightly", "run.json")

    def section(doc: dict, path: str) -> tuple[dict, str]:
        *parents, leaf = path.split(".")
        for p in parents:
            doc = doc[p]
        return doc, leaf

    for doc in (stored["config"], stored["identity"]):  # as the older version wrote it
        node, leaf = section(doc, late)
        node.pop(leaf, None)
    other = next(p for p in LATE_SETTINGS if p != late)
    node, leaf = section(stored["identity"], other)
    node[leaf] = False  # the other one recorded at its default, as versions before this check's fix wrote it
    store.put_json("nightly", "run.json", stored)
    assert check_run_config(store, cfg) is True
    section_name = late.split(".")[0]
    assert cfg.stage_hash(section_name) == load_config(None, []).stage_hash(section_name)
    assert late.rsplit(".", 1)[-1] not in json.dumps(_identity(cfg))
    with pytest.raises(ConfigError, match=rf"exists with another config \({late}: stored None, given True\)"):
        check_run_config(store, load_config(None, ["run_name=nightly", f"{late}=true"]))


# ---------------------------------------------------------------- named entries' flat settings, shipped configs
# a config whose run supplies a setting on the command line, as its header says
NEEDS = {"rm_tiny.yaml": ["reward_model.model.path=rm-kit"]}


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_every_shipped_config_loads(name):
    """The configs of configs/ (the wheel's rlstage/configs are the same files): the config model, then the names
    against the registries, their settings and what their entries read."""
    from rlstage.engines.preflight import check_registered_names

    check_registered_names(load_config(REPO / "configs" / name, NEEDS.get(name, [])))


def test_each_estimator_declares_which_flat_settings_it_reads():
    """verl keeps gamma, lam and norm_adv_by_std_in_grpo flat under algorithm.: an estimator's entry records which it
    reads (those its signature names), and another value of one it does not read is refused in one line."""
    from rlstage.engines import algorithms as algos

    reads = {n: algos.ADV_ESTIMATORS.entry(n).reads for n in ("gae", "grpo", "reinforce_plus_plus", "rloo")}
    assert reads == {
        "gae": {"gamma", "lam"},
        "grpo": {"norm_adv_by_std_in_grpo"},
        "reinforce_plus_plus": {"gamma"},
        "rloo": set(),
    }
    with pytest.raises(ConfigError) as err:
        load(["algorithm.gamma=0.99"])
    assert str(err.value) == "config error: algorithm.gamma: grpo takes no gamma (its settings: norm_adv_by_std_in_grpo)"
    with pytest.raises(ConfigError, match=r"^config error: algorithm\.norm_adv_by_std_in_grpo: rloo takes no norm_adv_by_std_in_grpo \(its settings: none\)$"):
        load(["algorithm.adv_estimator=rloo", "algorithm.norm_adv_by_std_in_grpo=false"])
    with pytest.raises(ConfigError, match=r"^config error: algorithm\.lam: reinforce_plus_plus takes no lam \(its settings: gamma\)$"):
        load(["algorithm.adv_estimator=reinforce_plus_plus", "algorithm.lam=0.95"])
    load(["algorithm.adv_estimator=gae", "critic.enable=true", "algorithm.gamma=0.99", "algorithm.lam=0.95"])
    load(["algorithm.adv_estimator=rloo", "algorithm.gamma=1.0"])  # at its default: nothing to ignore
    with pytest.raises(ConfigError, match=r"^config error: algorithm\.adv_estimator\.beta: grpo takes no settings$"):
        load(["algorithm.adv_estimator={name: grpo, beta: 1}"])


def test_an_estimator_named_as_a_section_hashes_as_its_plain_name():
    """``algorithm.adv_estimator: rloo`` and ``{name: rloo}`` are one config, hashed as 0.1 stored it (a string)."""
    import hashlib

    plain, nested = load(["algorithm.adv_estimator=rloo"]), load(["algorithm.adv_estimator={name: rloo}"])
    assert plain.algorithm.adv_estimator == nested.algorithm.adv_estimator
    assert plain.hashed_dump()["algorithm"]["adv_estimator"] == "rloo"
    expected = hashlib.sha256(json.dumps({"algorithm.adv_estimator": "rloo"}).encode()).hexdigest()[:16]
    assert nested.stage_hash("algorithm.adv_estimator") == expected


def test_loss_scale_factor_is_verls_read_by_the_mode_that_reads_it_and_hashed_only_when_set():
    cfg = load(["actor.loss_agg_mode=seq-mean-token-sum-norm", "actor.loss_scale_factor=64"])
    assert cfg.actor.loss_scale_factor == 64
    assert "loss_scale_factor" not in load([]).hashed_dump()["actor"]  # unset: stored runs keep their keys
    assert cfg.stage_hash("actor") != load(["actor.loss_agg_mode=seq-mean-token-sum-norm"]).stage_hash("actor")
    with pytest.raises(ConfigError) as err:
        load(["actor.loss_scale_factor=64"])
    assert str(err.value) == "config error: actor.loss_scale_factor: token-mean takes no loss_scale_factor (its settings: none)"


def test_every_command_that_loads_a_config_says_a_deprecated_name_once(tmp_path):
    """A 0.1 flat loss setting is one line, ``rlstage: actor.<name> is deprecated: ...``, whichever command loads the
    config: a config file (train) or a stored run's (nightly, replay, eval); each command here then stops at a
    missing input, after loading."""
    import subprocess
    import sys

    from rlstage.flows.checks import record_run_config
    from rlstage.infra.store import ArtifactStore
    from tests_support import cli_env

    store = ArtifactStore(str(tmp_path / "store"))
    missing = ["data.source=gsm8k", f"data.train_path={tmp_path}/no.jsonl", f"data.test_path={tmp_path}/no2.jsonl"]
    record_run_config(store, load_config(None, ["run_name=old", *missing]))
    path = tmp_path / "store" / "old" / "run.json"
    doc = json.loads(path.read_text())
    doc["config"]["actor"] |= {"policy_loss": "vanilla", "clip_ratio_high": 0.28}  # as 0.1 stored a flat setting
    path.write_text(json.dumps(doc))
    line = (
        "rlstage: actor.clip_ratio_high is deprecated: set actor.policy_loss.clip_ratio_high (the flat name is read "
        "until 0.3)"
    )
    commands = {
        "train": ["train", "run_name=new", "actor.clip_ratio_high=0.28", *missing],
        "nightly": ["nightly", "old", "--store", str(tmp_path / "store")],
        "replay": ["replay", "old", "1", "update", "--store", str(tmp_path / "store")],
        "eval": ["eval", "old", "--store", str(tmp_path / "store")],
    }
    for name, args in commands.items():
        done = subprocess.run(
            [sys.executable, "-m", "rlstage.flows.cli", *args], cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 2, (name, done.stderr[-2000:])
        lines = done.stderr.strip().splitlines()
        assert lines.count(line) == 1 and len(lines) == 2, (name, lines)  # the deprecation, then the command's error
