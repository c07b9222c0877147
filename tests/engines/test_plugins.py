"""Open registries and plugins: names checked against the registries at load, entries that declare what they need
and their own settings, third-party entries from plugins (an installed package trains: tests/integration/test_plugin_package.py)."""

from __future__ import annotations

import hashlib
import json
import sys
import uuid
from pathlib import Path

import pytest

from rlstage.engines import algorithms as algos

# every registry exists before a test adds to it
from rlstage.engines.agents import tools as _tools  # noqa: F401
from rlstage.engines.data import datasets  # noqa: F401
from rlstage.engines.plugins import PluginError, load_plugins, plugins_used
from rlstage.engines.preflight import check_registered_names
from rlstage.engines.registry import REGISTRIES, needs_of
from rlstage.engines.rewards import rules as rewards  # noqa: F401
from rlstage.engines.rollout import engines as rollout_engines  # noqa: F401
from rlstage.flows.checks import check_run_config, record_run_config, stored_config
from rlstage.infra.store import ArtifactStore
from rlstage.schemas.config import ALLOWED_CALLABLES_ENV, ConfigError, load_config
from rlstage.schemas.stages import view_hash
from rlstage.tasks.runtime import stage_config_hash

LOSS = """
from pydantic import BaseModel, Field

from rlstage.engines.algorithms import register_policy_loss


class Settings(BaseModel):
    model_config = {{"extra": "forbid"}}
    beta: float = Field(1.0, gt=0)


@register_policy_loss({name!r}, settings=Settings)
def loss(*args, **kw):
    raise AssertionError("not run here")
"""


@pytest.fixture
def plugin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A folder on the path for plugin modules; what they register is forgotten afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(ALLOWED_CALLABLES_ENV, raising=False)
    before = {kind: set(registry) for kind, registry in REGISTRIES.items()}
    modules = set(sys.modules)
    yield tmp_path
    for kind, registry in REGISTRIES.items():
        for name in set(registry) - before.get(kind, set(registry)):
            registry.remove(name)
    for name in set(sys.modules) - modules:
        if name.startswith("plug_"):  # this test's own modules only (a library imported meanwhile stays)
            del sys.modules[name]


def _module(folder: Path, source: str) -> str:
    name = f"plug_{uuid.uuid4().hex[:8]}"  # a fresh name: imported anew
    (folder / f"{name}.py").write_text(source)
    return name


def _load(*overrides: str):
    """The CLI's loading (flows/cli.py: _load): the config model, then its names against the registries."""
    cfg = load_config(None, list(overrides))
    check_registered_names(cfg)
    return cfg


def test_a_config_module_registers_a_loss_the_config_then_names(plugin_dir):
    mod = _module(plugin_dir, LOSS.format(name="beta_loss"))
    cfg = _load(f"plugins=[{mod}]", "actor.policy_loss={name: beta_loss, beta: 0.5}")
    assert algos.policy_loss_settings(cfg.actor.policy_loss).beta == 0.5
    used = plugins_used(cfg)
    assert list(used) == [mod] and used[mod].startswith("sha256:")  # no distribution: its source's hash
    # the update stage's key carries the plugin's version; a stage that names no plugin entry keeps its view's hash
    assert stage_config_hash(cfg, "update") != view_hash(cfg, "update")
    assert stage_config_hash(cfg, "reward") == view_hash(cfg, "reward")
    key = stage_config_hash(cfg, "update")
    (plugin_dir / f"{mod}.py").write_text(LOSS.format(name="beta_loss") + "# another version\n")
    assert stage_config_hash(cfg, "update") != key  # another version of the plugin: another stage


def test_runs_without_plugins_keep_their_keys():
    cfg = load_config(None, [])
    assert plugins_used(cfg) == {}
    assert all(
        stage_config_hash(cfg, s) == view_hash(cfg, s, needs_of) for s in ("rollout", "reward", "advantage", "update")
    )


def test_bad_plugins_are_one_line_each(plugin_dir):
    broken = _module(plugin_dir, "raise ImportError('needs a package this machine lacks')\n")
    with pytest.raises(
        PluginError,
        match=rf"^config error: plugins\.0: plugin '{broken}' failed to import: ImportError: needs a package",
    ):
        _load(f"plugins=[{broken}]")
    a, b = _module(plugin_dir, LOSS.format(name="twin")), _module(plugin_dir, LOSS.format(name="twin"))
    with pytest.raises(
        PluginError,
        match=rf"^config error: plugins\.1: plugin '{b}': policy loss 'twin' is registered twice: by {a} and by {b}$",
    ):
        _load(f"plugins=[{a}, {b}]")
    clash = _module(plugin_dir, LOSS.format(name="gspo"))  # a built-in's name
    with pytest.raises(
        PluginError,
        match=rf"policy loss 'gspo' is registered twice: by rlstage\.engines\.algorithms\.losses and by {clash}",
    ):
        _load(f"plugins=[{clash}]")
    strict = _module(plugin_dir, LOSS.format(name="strict"))
    with pytest.raises(
        ConfigError, match=r"^config error: actor\.policy_loss\.beta: Input should be greater than 0$"
    ):
        _load(f"plugins=[{strict}]", "actor.policy_loss={name: strict, beta: -1}")
    with pytest.raises(
        ConfigError,
        match=r"^config error: actor\.policy_loss: unknown policy loss 'strictt'; registered: vanilla",
    ):
        _load(f"plugins=[{strict}]", "actor.policy_loss=strictt")


def test_a_stored_run_records_its_plugins_and_refuses_another_version(plugin_dir):
    mod = _module(plugin_dir, LOSS.format(name="recorded_loss"))
    cfg = _load(f"plugins=[{mod}]", "actor.policy_loss=recorded_loss", "run_name=plugged")
    store = ArtifactStore(str(plugin_dir / "store"))
    record_run_config(store, cfg)
    doc = store.get_json("plugged", "run.json")
    assert doc["plugins"] == plugins_used(cfg)
    assert check_run_config(store, cfg)  # the same plugin: the run continues
    (plugin_dir / f"{mod}.py").write_text(LOSS.format(name="recorded_loss") + "# changed\n")
    with pytest.raises(
        PluginError,
        match=rf"^config error: run 'plugged' was run with plugin {mod} sha256:\w+, this environment has sha256:\w+: its stages would not be reused",
    ):
        check_run_config(store, cfg)
    # a plugin distribution this environment lacks
    path = plugin_dir / "store" / "plugged" / "run.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "plugins": {"rlstage-gone": "1.2.0"}}))
    with pytest.raises(
        PluginError,
        match=r"run 'plugged' was run with plugin rlstage-gone==1\.2\.0, which is not installed here: pip install 'rlstage-gone==1\.2\.0'$",
    ):
        check_run_config(store, cfg)


def test_a_stored_config_never_imports_its_plugins(plugin_dir):
    marker = plugin_dir / "marker"
    mod = _module(plugin_dir, f"import pathlib\npathlib.Path({str(marker)!r}).write_text('imported')\n")
    store = ArtifactStore(str(plugin_dir / "store"))
    record_run_config(store, load_config(None, ["run_name=victim"]))
    path = plugin_dir / "store" / "victim" / "run.json"
    doc = json.loads(path.read_text())
    doc["config"]["plugins"] = [mod]  # a writer of the store names code
    path.write_text(json.dumps(doc))
    with pytest.raises(
        ConfigError, match=rf"plugins\.0: '{mod}' comes from the stored config .* may not name code to import"
    ):
        stored_config(store, "victim")
    assert not marker.exists()
    named = stored_config(store, "victim", [f"plugins=[{mod}]"])  # named by this command: loaded
    assert named.plugins == [mod]
    assert marker.read_text() == "imported"


def test_rewards_registered_by_a_plugin_are_named_by_reward_function(plugin_dir):
    mod = _module(
        plugin_dir,
        "from rlstage.engines.rewards.rules import register_reward_fn\n\n\n"
        "@register_reward_fn('always_half')\ndef always_half(response_text, ground_truth, extra_info):\n    return 0.5\n",
    )
    load_plugins([mod])
    cfg = _load(f"plugins=[{mod}]", "reward.function=always_half")
    assert rewards.REWARD_FNS.entry("always_half").module == mod
    assert list(plugins_used(cfg)) == [mod]
    assert stage_config_hash(cfg, "reward") != view_hash(cfg, "reward")


def test_data_sources_registered_by_a_plugin_are_named_by_data_source(plugin_dir):
    mod = _module(
        plugin_dir,
        "from rlstage.engines.data.datasets import load_gsm8k, register_data_source\n\n\n"
        "@register_data_source('gsm8k_copy')\ndef gsm8k_copy(path, split=None):\n    return load_gsm8k(path, split)\n",
    )
    with pytest.raises(
        ConfigError,
        match=r"^config error: data\.source: unknown data source 'gsm8k_copy'; registered: synthetic",
    ):
        _load("data.source=gsm8k_copy", "data.train_path=t.jsonl", "data.test_path=h.jsonl")
    cfg = _load(
        f"plugins=[{mod}]", "data.source=gsm8k_copy", "data.train_path=t.jsonl", "data.test_path=h.jsonl"
    )
    assert stage_config_hash(cfg, "data_prep") != view_hash(cfg, "data_prep", needs_of)  # the loader's version is the stage's


def test_a_loss_that_needs_the_reference_gets_its_log_probs(plugin_dir):
    import torch

    from rlstage.engines.models.tinykit import build_char_tokenizer, build_tiny_llama
    from rlstage.engines.training.actor import TorchActor
    from rlstage.schemas.config import KitConfig

    seen = []

    @algos.register_policy_loss("ref_anchored", needs=("ref",))
    def ref_anchored(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", *, ref_log_prob, **kw
    ):
        seen.append(ref_log_prob.detach().clone())
        return algos.agg_loss((log_prob - ref_log_prob).square(), response_mask, loss_agg_mode), {}

    cfg = _load("actor.policy_loss=ref_anchored")
    assert algos.needs_reference(cfg) and not cfg.needs_ref  # the loss's need, not a KL setting's
    tok = build_char_tokenizer()
    model = build_tiny_llama(KitConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), tok)
    responses = [[5, 6, 7], [5, 6]]
    batch = {
        "prompt_ids": [tok("What is 1+2? ", add_special_tokens=False)["input_ids"]] * 2,
        "response_ids": responses,
        "response_mask": [[1] * len(r) for r in responses],
        "old_log_probs": [[-1.0] * len(r) for r in responses],
        "ref_log_probs": [[-2.0] * len(r) for r in responses],
        "advantages": [[0.5] * len(r) for r in responses],
    }
    actor_cfg = cfg.actor.model_copy(update={"ppo_mini_batch_size": 2, "micro_batch_size": 2})
    TorchActor(model, actor_cfg, tok.pad_token_id, 1).update(batch, 1.0, seed=0)
    assert seen and torch.equal(seen[0], torch.full((2, 3), -2.0) * torch.tensor([[1, 1, 1], [1, 1, 0]]))


def test_tools_registered_by_a_plugin_are_named_by_their_name(plugin_dir):
    from rlstage.engines.preflight import check_engines

    mod = _module(
        plugin_dir,
        "from rlstage.engines.agents.tools import register_tool\n\n\n"
        "@register_tool('shout')\ndef shout(text: str) -> str:\n    return text.upper()\n",
    )
    tools = "agent.tools=[{name: calc, callable: calculator}, {name: loud, callable: shout}]"
    cfg = _load(f"plugins=[{mod}]", "agent.enable=true", "kit.task=multiply", tools)
    check_engines(cfg)  # each tool resolves: the built-in calculator and the plugin's shout, by name
    assert list(plugins_used(cfg)) == [mod]
    assert stage_config_hash(cfg, "rollout") != view_hash(
        cfg, "rollout"
    )  # the rollout runs the plugin's tool
    with pytest.raises(
        ConfigError,
        match=r"^config error: agent\.tools\.1\.callable: unknown tool 'shoutt'; registered: calculator",
    ):
        check_engines(
            load_config(None, ["agent.enable=true", "kit.task=multiply", tools.replace("shout", "shoutt")])
        )


TWIN_ENGINE = """
from rlstage.engines.rollout.base import RolloutEngine
from rlstage.engines.rollout.engines import register_rollout_engine


class Twin(RolloutEngine):
    def __init__(self, path):
        self.path = path

    def generate_ids(self, encoded, params):
        return []

    def load_weights(self, source):
        self.path = source
        return 0.0


class Half(RolloutEngine):  # no load_weights
    def generate_ids(self, encoded, params):
        return []


class Bare:  # not a RolloutEngine at all
    def generate_ids(self, encoded, params):
        return []


@register_rollout_engine('hf_twin')
def hf_twin(cfg, model, tokenizer, path, current=None):
    return Twin(path)


@register_rollout_engine('half')
def half(cfg, model, tokenizer, path, current=None):
    return Half()


@register_rollout_engine('bare')
def bare(cfg, model, tokenizer, path, current=None):
    return Bare()
"""


def test_rollout_engines_registered_by_a_plugin_are_named_by_rollout_engine(plugin_dir):
    from rlstage.engines.rollout.base import RolloutEngine
    from rlstage.engines.rollout.engines import build_rollout_engine

    mod = _module(plugin_dir, TWIN_ENGINE)
    with pytest.raises(
        ConfigError,
        match=r"^config error: rollout\.engine: unknown rollout engine 'hf_twin'; registered: hf, vllm",
    ):
        _load("rollout.engine=hf_twin")
    cfg = _load(f"plugins=[{mod}]", "rollout.engine=hf_twin")
    engine = build_rollout_engine(cfg, None, None, "weights")  # the worker builds the registered one
    assert isinstance(engine, RolloutEngine) and engine.path == "weights" and engine.batch_size == 1024
    engine.close()  # the interface's default: nothing to release
    assert stage_config_hash(cfg, "rollout") != view_hash(cfg, "rollout")
    assert stage_config_hash(cfg, "update") == view_hash(cfg, "update")  # the update does not generate


def test_a_plugin_engine_that_is_no_rollout_engine_is_refused_at_its_build_naming_what_it_lacks(plugin_dir):
    from rlstage.engines.rollout.engines import build_rollout_engine

    mod = _module(plugin_dir, TWIN_ENGINE)
    with pytest.raises(TypeError, match=r"abstract method '?load_weights"):  # Python's own refusal of a half subclass
        build_rollout_engine(_load(f"plugins=[{mod}]", "rollout.engine=half"), None, None, "weights")
    with pytest.raises(TypeError) as err:
        build_rollout_engine(_load(f"plugins=[{mod}]", "rollout.engine=bare"), None, None, "weights")
    assert str(err.value) == (
        "rollout.engine=bare: its factory returned a Bare, not a RolloutEngine (rlstage.engines.rollout.base): "
        "it lacks generate, load_weights, close"
    )


# ---------------------------------------------------------------- estimators' settings, declared needs and traits
ESTIMATOR = """
from pydantic import BaseModel, Field

from rlstage.engines.algorithms import register_adv_estimator


class Settings(BaseModel):
    model_config = {{"extra": "forbid"}}
    scale: float = Field(1.0, gt=0)


@register_adv_estimator({name!r}, settings=Settings)
def scaled(*, token_level_rewards, response_mask, scale, **kw):
    adv = token_level_rewards.sum(-1, keepdim=True) * scale * response_mask
    return adv, adv
"""


def test_a_plugin_estimator_takes_its_own_settings_nested_under_its_name(plugin_dir):
    import torch

    mod = _module(plugin_dir, ESTIMATOR.format(name="scaled_est"))
    cfg = _load(f"plugins=[{mod}]", "algorithm.adv_estimator={name: scaled_est, scale: 3.0}")
    settings = algos.adv_estimator_settings(cfg.algorithm.adv_estimator)
    assert settings.scale == 3.0 and algos.ADV_ESTIMATORS.entry("scaled_est").reads == frozenset()
    rewards, mask = torch.tensor([[0.0, 2.0]]), torch.ones(1, 2)
    adv, _ = algos.compute_advantage(
        "scaled_est", token_level_rewards=rewards, response_mask=mask, settings=settings
    )
    assert torch.equal(adv, torch.full((1, 2), 6.0))  # its setting reached it as a keyword
    assert _load(f"plugins=[{mod}]", "algorithm.adv_estimator=scaled_est").algorithm.adv_estimator.name == "scaled_est"
    # the run's advantage stage is keyed by the plugin's version (the flat form of the section is 0.1's otherwise)
    assert stage_config_hash(cfg, "advantage") != view_hash(cfg, "advantage", needs_of)
    refused = {  # overrides -> the one line
        ("algorithm.adv_estimator={name: scaled_est, scale: -1}",): "algorithm.adv_estimator.scale: Input should be greater than 0",
        ("algorithm.adv_estimator={name: scaled_est, scal: 2}",): "algorithm.adv_estimator.scal: scaled_est takes no scal (its settings: scale)",
        ("algorithm.adv_estimator=scaled_est", "algorithm.gamma=0.9"): "algorithm.gamma: scaled_est takes no gamma (its settings: scale)",
    }  # fmt: skip
    for overrides, line in refused.items():
        with pytest.raises(ConfigError) as err:
            _load(f"plugins=[{mod}]", *overrides)
        assert str(err.value) == f"config error: {line}"


def test_a_loss_that_needs_the_reference_may_place_it_apart(plugin_dir):
    """The reference/critic role placed apart holds the reference a policy loss declares it needs (``ref``), as it
    holds the one KL needs; a run with neither reference nor critic to place is still refused."""
    mod = _module(
        plugin_dir,
        "from rlstage.engines.algorithms import register_policy_loss\n\n\n"
        "@register_policy_loss('anchored', needs=('ref',))\ndef anchored(*args, **kw):\n    raise AssertionError\n",
    )
    cfg = _load(f"plugins=[{mod}]", "actor.policy_loss=anchored", "ray.ref_critic_placement=separate")
    assert algos.needs_reference(cfg) and not cfg.needs_ref and not cfg.critic.enable
    with pytest.raises(
        ConfigError,
        match=r"^config error: ray\.ref_critic_placement: ray\.ref_critic_placement=separate: this run has no reference",
    ):
        _load(f"plugins=[{mod}]", "ray.ref_critic_placement=separate")
    with pytest.raises(ConfigError, match=r"with model\.lora_rank > 0 the reference is the policy's own base"):
        _load(f"plugins=[{mod}]", "actor.policy_loss=anchored", "ray.ref_critic_placement=separate", "model.lora_rank=4")


def test_rollout_engine_facts_come_from_its_entry(plugin_dir):
    """What the checks and workers know of a rollout engine (shares prompts, generates in memory, seeds per batch, its
    largest LoRA rank) is what its entry declares, a plugin's too, not decided by its name."""
    from rlstage.engines.rollout.engines import engine_traits
    from rlstage.workers.policy import every_rank_generates

    mod = _module(
        plugin_dir,
        "from rlstage.engines.rollout.engines import EngineTraits, register_rollout_engine\n\n\n"
        "@register_rollout_engine('twin', traits=EngineTraits(in_memory=True, shares_prompts=True, max_lora_rank=8))\n"
        "def twin(cfg, model, tokenizer, path, current=None):\n    return None\n\n\n"
        "@register_rollout_engine('plain')\ndef plain(cfg, model, tokenizer, path, current=None):\n    return None\n",
    )
    assert engine_traits("hf").in_memory and engine_traits("hf").seeds_per_batch and not engine_traits("vllm").in_memory
    twin = _load(f"plugins=[{mod}]", "rollout.engine=twin", "rollout.share_prompts=true")
    assert every_rank_generates(twin)  # an engine in memory generates on every rank, as hf does
    assert not every_rank_generates(_load(f"plugins=[{mod}]", "rollout.engine=plain"))
    with pytest.raises(ConfigError) as err:
        _load(f"plugins=[{mod}]", "rollout.engine=plain", "rollout.share_prompts=true")
    assert str(err.value) == (
        "config error: rollout.share_prompts: rollout.share_prompts is for rollout.engine hf, twin; "
        "rollout.engine=plain shares a prompt's prefill through its own prefix cache"
    )
    with pytest.raises(
        ConfigError, match=r"^config error: model\.lora_rank: model\.lora_rank=16: rollout\.engine=twin serves LoRA adapters of rank 8 at most$"
    ):
        _load(f"plugins=[{mod}]", "rollout.engine=twin", "model.lora_rank=16")


# ---------------------------------------------------------------- code named by import path, recorded
REWARD = "def score(response_text, ground_truth, extra_info):\n    return 1.0\n"


def test_a_reward_function_given_by_import_path_is_recorded_and_checked(plugin_dir):
    from rlstage.engines.plugins import callables_used

    mod = _module(plugin_dir, REWARD)
    cfg = _load(f"reward.function={mod}:score", "run_name=scored")
    store = ArtifactStore(str(plugin_dir / "store"))
    record_run_config(store, cfg)
    doc = store.get_json("scored", "run.json")
    assert doc["callables"] == callables_used(cfg) and doc["callables"][mod].startswith("sha256:")
    assert "plugins" not in doc  # no registered plugin entry is named
    # not in the keys: a run stored before code was recorded keeps them
    assert all(stage_config_hash(cfg, s) == view_hash(cfg, s) for s in ("reward", "eval"))
    assert check_run_config(store, cfg)
    (plugin_dir / f"{mod}.py").write_text(REWARD + "# changed\n")
    line = (
        rf"^config error: run 'scored' was run with {mod} sha256:\w{{12}} \(its reward function or tools\), this "
        rf"environment has sha256:\w{{12}}: its committed stages would be reused as they are; restore {mod} "
        r"sha256:\w{12}, or start a new run_name$"
    )
    with pytest.raises(PluginError, match=line):
        check_run_config(store, cfg)
    with pytest.raises(PluginError, match=line):  # nightly, replay and eval load the stored config
        stored_config(store, "scored", [f"reward.function={mod}:score"])


def test_an_edit_to_a_local_module_a_reward_file_imports_is_another_version_of_it(plugin_dir):
    """The scorer a reward file wraps (verl's custom_reward_function importing its own helpers) is hashed with it: an
    edit there is caught when the run continues, not reused silently; a file that imports nothing local keeps the
    hash of that file alone (runs recorded before local imports were followed)."""
    from rlstage.engines.plugins import callables_used

    helper = _module(plugin_dir, "def check(text, truth):\n    return float(text == truth)\n")
    (plugin_dir / "scorers").mkdir()
    (plugin_dir / "scorers" / "__init__.py").write_text("")
    (plugin_dir / "scorers" / "deep.py").write_text("from . import rules\n")
    (plugin_dir / "scorers" / "rules.py").write_text("WEIGHT = 1.0\n")
    adapter = plugin_dir / "adapter.py"
    adapter.write_text(f"import json\nimport {helper}\nfrom scorers import deep\n\ndef score(r, t, e):\n    return {helper}.check(r, t)\n")
    cfg = _load(f"reward.function={adapter}:score", "run_name=wrapped")
    store = ArtifactStore(str(plugin_dir / "store"))
    record_run_config(store, cfg)
    recorded = callables_used(cfg)[str(adapter)]
    assert recorded != "sha256:" + hashlib.sha256(adapter.read_bytes()).hexdigest()[:12]  # more than the file itself
    assert check_run_config(store, cfg)
    (plugin_dir / "scorers" / "rules.py").write_text("WEIGHT = 2.0\n")  # two imports away, in a package
    with pytest.raises(PluginError, match=rf"was run with {adapter} {recorded} \(its reward function or tools\)"):
        check_run_config(store, cfg)
    alone = plugin_dir / "alone.py"
    alone.write_text("import json\n\ndef score(r, t, e):\n    return 1.0\n")  # json: the standard library's
    assert callables_used(_load(f"reward.function={alone}:score"))[str(alone)] == "sha256:" + hashlib.sha256(alone.read_bytes()).hexdigest()[:12]


def test_code_from_an_installed_distribution_is_recorded_by_its_version(plugin_dir):
    """A tool's callable in an installed distribution (PyYAML here) is recorded as that distribution and version; a
    run recorded with another version, or with a distribution this environment lacks, is refused in one line."""
    from importlib import metadata

    from rlstage.engines.plugins import callables_used

    tools = "agent.tools=[{name: c, callable: calculator}, {name: y, callable: 'yaml:safe_dump'}]"
    cfg = load_config(None, ["run_name=tooled", "agent.enable=true", "kit.task=multiply", tools])
    assert callables_used(cfg) == {"PyYAML": metadata.version("PyYAML")}  # the built-in calculator is rlstage's
    store = ArtifactStore(str(plugin_dir / "store"))
    record_run_config(store, cfg)
    path = plugin_dir / "store" / "tooled" / "run.json"
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({**doc, "callables": {"PyYAML": "0.0.1"}}))
    with pytest.raises(PluginError, match=r"was run with PyYAML 0\.0\.1 \(its reward function or tools\), this environment has "):
        check_run_config(store, cfg)
    path.write_text(json.dumps({**doc, "callables": {"rlstage-gone": "1.0"}}))
    with pytest.raises(
        PluginError, match=r"was run with rlstage-gone==1\.0 \(its reward function or tools\), which is not installed here"
    ):
        check_run_config(store, cfg)
