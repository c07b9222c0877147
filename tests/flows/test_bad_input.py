"""One line for every bad input: a table of mistakes walked through the real ``rlstage`` CLI.

Every case must end before any flow run, Ray or server starts, with exit code 2, exactly one stderr
line that names the file, setting or service, no traceback, and nothing written to the store.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import struct
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests_support import REPO, source_path

GOOD_GSM8K = '{"question": "What is 2+3?", "answer": "2+3=5\\n#### 5"}\n'


def _safetensors(data_bytes: int = 4, announce: int = 4) -> bytes:
    header = json.dumps({"w": {"dtype": "F32", "shape": [announce // 4], "data_offsets": [0, announce]}}).encode()
    return struct.pack("<Q", len(header)) + header + b"\0" * data_bytes


def _model_dir(root: Path, name: str, config: bytes | None = b"{}", files: dict[str, bytes] | None = None) -> str:
    d = root / name
    d.mkdir()
    if config is not None:
        (d / "config.json").write_bytes(config)
    for fname, data in (files or {}).items():
        (d / fname).write_bytes(data)
    return str(d)


class _Payload:
    """Unpickling this creates the marker file: what a crafted checkpoint would do."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _world(w: Path) -> dict[str, str]:
    """Files, model folders and a store holding the runs the table refers to."""
    from rlstage.flows.checks import record_run_config
    from rlstage.infra.store import ArtifactStore
    from rlstage.schemas.config import RunConfig

    p: dict[str, str] = {"w": str(w), "store": str(w / "store"), "marker": str(w / "marker")}
    data = w / "data"
    data.mkdir()
    files = {
        "good.jsonl": GOOD_GSM8K.encode(),
        "badline.jsonl": (GOOD_GSM8K + "{not json\n").encode(),
        "empty.jsonl": b"",
        "latin1.jsonl": '{"question": "caf\xe9", "answer": "#### 1"}\n'.encode("latin-1"),
        "nomarker.jsonl": b'{"question": "q", "answer": "5"}\n',
        "noquestion.jsonl": b'{"answer": "#### 5"}\n',
        "array.jsonl": b"[1, 2]\n",
        "noanswer.jsonl": b'{"prompt": "What is 2+2?", "answer": "4"}\n{"prompt": "What is 3+3?", "answer": ""}\n',
        "notparquet.parquet": b"PAR1 this is not parquet",
        "bad.yaml": b"run_name: x\nactor: [1, 2\n",
        "latin1.yaml": "run_name: caf\xe9\n".encode("latin-1"),
        "list.yaml": b"- a\n- b\n",
        "tabs.yaml": b"run_name: x\n\tactor: 1\n",
    }
    for name, content in files.items():
        (data / name).write_bytes(content)
        p[name.replace(".", "_")] = str(data / name)
    pq.write_table(pa.table({"foo": [1]}), data / "nocols.parquet")
    p["nocols_parquet"] = str(data / "nocols.parquet")
    verl = {"data_source": pa.array([], pa.string()), "prompt": pa.array([], pa.string()), "reward_model": pa.array([], pa.string())}
    pq.write_table(pa.table(verl), data / "empty.parquet")
    p["empty_parquet"] = str(data / "empty.parquet")
    for split in ("train", "test"):  # verl rows of a data_source no rule is registered for
        rows = {
            "data_source": ["my_org/gsm8k_v2"] * 2,
            "prompt": [[{"role": "user", "content": f"{split} question {i}?"}] for i in range(2)],
            "reward_model": [{"style": "rule", "ground_truth": str(i)} for i in range(2)],
        }
        pq.write_table(pa.table(rows), data / f"mine_{split}.parquet")
        p[f"mine_{split}_parquet"] = str(data / f"mine_{split}.parquet")
    models = w / "models"
    models.mkdir()
    p["m_noconfig"] = _model_dir(models, "noconfig", None, {"model.safetensors": _safetensors()})
    p["m_badjson"] = _model_dir(models, "badjson", b"{'not': json", {"model.safetensors": _safetensors()})
    p["m_latin1"] = _model_dir(models, "latin1", '{"n": "caf\xe9"}'.encode("latin-1"), {"model.safetensors": _safetensors()})
    p["m_noweights"] = _model_dir(models, "noweights")
    p["m_pickle"] = _model_dir(models, "pickle", files={"pytorch_model.bin": b"\x80\x04K\x01."})
    p["m_corrupt"] = _model_dir(models, "corrupt", files={"model.safetensors": b"\xff" * 64})
    p["m_truncated"] = _model_dir(models, "truncated", files={"model.safetensors": _safetensors(4, 4096)})
    p["m_index"] = _model_dir(models, "index", files={"model.safetensors.index.json": b'{"weight_map": {"w": "shard-1.safetensors"}}'})
    blocker = w / "blocker"
    blocker.write_text("a file where the store root's parent should be")
    p["blocker"] = str(blocker)

    store = ArtifactStore(p["store"])
    record_run_config(store, RunConfig(run_name="good"))
    kw = {"key": "k", "config_hash": "c", "code_version": "v", "inputs": {}}
    store.commit("good", None, "data_prep", tables={"train.parquet": pa.table({"x": [1]}), "test.parquet": pa.table({"x": [1]})}, **kw)
    store.commit("good", 1, "rollout", tables={"rollouts.parquet": pa.table({"x": [1]})}, **kw)
    # Runs whose run.json a writer of the store edited to name code.
    evil = data / "evil_reward.py"
    evil.write_text(f"import pathlib\npathlib.Path({p['marker']!r}).write_text('ran')\n\ndef score(*a):\n    return 1.0\n")
    (w / "evil_tool.py").write_text(evil.read_text())
    for run, edit in (
        ("evil", lambda c: c["reward"].update(function=f"{evil}:score")),
        ("eviltool", lambda c: c["agent"].update(tools=[{"name": "t", "callable": "evil_tool:score"}])),
    ):
        record_run_config(store, RunConfig(run_name=run))
        path = w / "store" / run / "run.json"
        doc = json.loads(path.read_text())
        edit(doc["config"])
        path.write_text(json.dumps(doc))
    # Checkpoints a writer of the store planted pickles in (each with a matching manifest): a run's iteration 1,
    # which a resume or an eval would load, and the kit's SFT, which a new run with the default settings shares.
    from rlstage.schemas.stages import kit_run_name

    pickled = {"model/model.safetensors": _safetensors(), "model/config.json": b"{}"}
    record_run_config(store, RunConfig(run_name="pickled"))
    store.commit("pickled", None, "data_prep", tables={"train.parquet": pa.table({"x": [1]}), "test.parquet": pa.table({"x": [1]})}, **kw)
    payload = pickle.dumps(_Payload(p["marker"]))
    store.commit("pickled", 1, "update", blobs={**pickled, "actor_state.pt": payload}, **kw)
    record_run_config(store, RunConfig(run_name="resumed"))  # its own checkpoint clean; its reference is the kit
    store.commit("resumed", 1, "update", blobs=pickled, **kw)
    kit = kit_run_name(RunConfig(run_name="fresh"))
    store.commit(kit, None, "sft", blobs={**pickled, "model/pytorch_model.bin": payload}, **kw)
    # A run that has run its length, over which its lr decays.
    from rlstage.schemas.config import load_config

    record_run_config(store, load_config(None, ["run_name=done", "trainer.iterations=1", "actor.optim.lr_schedule=linear"]))
    store.commit("done", 1, "update", blobs=pickled, **kw)
    (w / "store" / "broken").mkdir()
    (w / "store" / "broken" / "run.json").write_text("{half a document")
    # Plugins (modules on the commands' path): one that fails to import, two that register one name, one whose loss
    # has a settings model; and a run stored with a plugin distribution this environment lacks.
    loss = "from rlstage.engines.algorithms import register_policy_loss\n\n"
    (w / "broken_plugin.py").write_text("raise RuntimeError('this plugin is broken')\n")
    for mod in ("twin_a", "twin_b"):
        (w / f"{mod}.py").write_text(loss + "@register_policy_loss('twin')\ndef twin(*a, **kw):\n    raise AssertionError\n")
    (w / "strict_plugin.py").write_text(
        "from pydantic import BaseModel, Field\n\n" + loss + "class Strict(BaseModel):\n    beta: float = Field(1.0, gt=0)\n\n\n"
        "@register_policy_loss('strict', settings=Strict)\ndef strict(*a, **kw):\n    raise AssertionError\n"
    )
    record_run_config(store, RunConfig(run_name="plugged"))
    doc = json.loads((w / "store" / "plugged" / "run.json").read_text())
    (w / "store" / "plugged" / "run.json").write_text(json.dumps({**doc, "plugins": {"rlstage-no-such-plugin": "0.1.0"}}))
    # A run scored by a reward function given by import path, recorded with another version of its source.
    (w / "scorer.py").write_text("def score(response_text, ground_truth, extra_info):\n    return 1.0\n")
    record_run_config(store, RunConfig(run_name="scored", reward={"function": "scorer:score"}))
    doc = json.loads((w / "store" / "scored" / "run.json").read_text())
    (w / "store" / "scored" / "run.json").write_text(json.dumps({**doc, "callables": {"scorer": "sha256:000000000000"}}))
    return p


GSM = ["data.source=gsm8k"]
NOPYC = {"PYTHONDONTWRITEBYTECODE": "1"}


def _train_data(train: str, test: str = "{good_jsonl}", source: str = "gsm8k") -> list[str]:
    return [f"data.source={source}", f"data.train_path={train}", f"data.test_path={test}"]


# (name, argv with {placeholders} from _world, extra environment, pattern the one stderr line must match)
CASES: list[tuple[str, list[str], dict[str, str], str]] = [
    # ---- the command line
    ("unknown command", ["bogus"], {}, r"^rlstage: argument cmd: invalid choice: 'bogus'"),
    ("iteration not an int", ["replay", "good", "x", "reward"], {}, r"^rlstage replay: argument iteration: invalid int value: 'x'"),
    ("missing arguments", ["replay", "good"], {}, r"^rlstage replay: the following arguments are required: iteration, stage"),
    ("unknown option", ["train", "--nope"], {}, r"^rlstage: unrecognized arguments: --nope"),
    # ---- the config
    ("override without =", ["train", "nonsense"], {}, r"override 'nonsense' is not of the form key=value"),
    ("unknown key", ["train", "actor.optim.lrr=1"], {}, r"config error: actor\.optim\.lrr: not a setting; did you mean actor\.optim\.lr\?"),
    ("bad value", ["train", "actor.optim.lr=-1"], {}, r"config error: actor\.optim\.lr: Input should be greater than 0"),
    ("unknown estimator", ["demo", "algorithm.adv_estimator=ppo2"], {}, r"config error: algorithm\.adv_estimator: unknown advantage estimator 'ppo2'; registered: gae, grpo, "),
    ("estimator setting it does not read", ["train", "algorithm.gamma=0.99"], {}, r"^rlstage: config error: algorithm\.gamma: grpo takes no gamma \(its settings: norm_adv_by_std_in_grpo\)"),
    ("estimator setting it does not take", ["train", "algorithm.adv_estimator={{name: rloo, beta: 1}}"], {}, r"config error: algorithm\.adv_estimator\.beta: rloo takes no settings"),
    ("loss_scale_factor the mode does not read", ["train", "actor.loss_scale_factor=64"], {}, r"config error: actor\.loss_scale_factor: token-mean takes no loss_scale_factor"),
    ("ref placed apart with none to place", ["train", "ray.ref_critic_placement=separate"], {}, r"config error: ray\.ref_critic_placement: ray\.ref_critic_placement=separate: this run has no reference policy"),
    ("override value not YAML", ["train", "actor.optim.betas=[0.9,"], {}, r"config error: override actor\.optim\.betas: value is not YAML"),
    ("config file missing", ["train", "-c", "{w}/nope.yaml"], {}, r"config error: config file .*/nope\.yaml does not exist"),
    ("config file YAML syntax", ["train", "-c", "{bad_yaml}"], {}, r"config error: config file .*/bad\.yaml is not valid YAML \(expected .* at line 3, column 1\)"),
    ("config file with a tab", ["train", "-c", "{tabs_yaml}"], {}, r"config error: config file .*/tabs\.yaml is not valid YAML"),
    ("config file not UTF-8", ["train", "-c", "{latin1_yaml}"], {}, r"config error: config file .*/latin1\.yaml is not UTF-8 text"),
    ("config file not a mapping", ["train", "-c", "{list_yaml}"], {}, r"config error: .*/list\.yaml must hold a mapping"),
    ("run name with /", ["train", "run_name=a/b"], {}, r"config error: run_name: run name 'a/b' must be"),
    ("groups of one", ["train", "rollout.n=1"], {}, r"config error: rollout\.n: rollout\.n=1: algorithm\.adv_estimator=grpo needs groups"),
    ("dynamic sampling without a cap", ["train", "algorithm.filter_groups.enable=true"], {}, r"algorithm\.filter_groups\.max_num_gen_batches=0: dynamic sampling needs a cap"),
    ("maj@N without an extractor", ["train", *GSM, "data.train_path=t.jsonl", "data.test_path=h.jsonl", "trainer.eval_n=4", "trainer.eval_require_maj=true"], {}, r"trainer\.eval_require_maj: the reward function of data\.source=gsm8k, gsm8k extracts no answer"),
    ("no held-out set", ["train", *GSM, "data.train_path=x.jsonl"], {}, r"data\.test_path \(the held-out set\) is required for data\.source=gsm8k"),
    ("mini-batch remainder", ["train", "actor.ppo_mini_batch_size=48", "actor.micro_batch_size=16"], {}, r"actor\.ppo_mini_batch_size=48 does not divide the samples per iteration"),
    ("unknown reward name", ["train", "reward.function=exact_mtch"], {}, r"config error: reward\.function: unknown reward function 'exact_mtch'; valid: "),
    ("reward file missing", ["train", "reward.function={w}/nope.py:f"], {}, r"config error: reward\.function: reward function file .*/nope\.py does not exist"),
    ("reward module missing", ["train", "reward.function=no_such_mod:f"], {}, r"cannot load reward function 'no_such_mod:f': ModuleNotFoundError"),
    ("tool not importable", ["train", "agent.tools=[{{name: t, callable: no_such_mod:f}}]"], {}, r"config error: agent\.tools\.0\.callable: cannot import 'no_such_mod:f'"),
    ("agent function not importable", ["train", "agent.enable=true", "agent.function=no_such_mod:agent"], {}, r"config error: agent\.function: cannot import 'no_such_mod:agent': ModuleNotFoundError"),
    ("failure share 0", ["train", "reward.stop_failure_share=0"], {}, r"config error: reward\.stop_failure_share: Input should be greater than 0"),
    # ---- data files
    ("train file missing", ["train", *_train_data("{w}/nope.jsonl")], {}, r"data\.train_path .*/nope\.jsonl does not exist"),
    ("test file missing", ["train", *_train_data("{good_jsonl}", "{w}/nope.jsonl")], {}, r"data\.test_path .*/nope\.jsonl does not exist"),
    ("jsonl bad line", ["train", *_train_data("{badline_jsonl}")], {}, r"data\.train_path: .*/badline\.jsonl:2: invalid JSON"),
    ("jsonl empty", ["train", *_train_data("{empty_jsonl}")], {}, r"data\.train_path: .*/empty\.jsonl: file is empty"),
    ("jsonl not UTF-8", ["train", *_train_data("{good_jsonl}", "{latin1_jsonl}")], {}, r"data\.test_path: .*/latin1\.jsonl: not UTF-8 text"),
    ("jsonl no ####", ["train", *_train_data("{nomarker_jsonl}")], {}, r"nomarker\.jsonl:1: answer has no '####' final-answer marker"),
    ("jsonl no question", ["train", *_train_data("{noquestion_jsonl}")], {}, r"noquestion\.jsonl:1: row has no 'question'"),
    ("jsonl not an object", ["train", *_train_data("{array_jsonl}")], {}, r"array\.jsonl:1: expected a JSON object, got list"),
    ("held-out prompts trained on", ["train", *_train_data("{good_jsonl}", "{good_jsonl}")], {}, r"data\.test_path: .*/good\.jsonl: (\d+) of \1 held-out prompts are also in .*/good\.jsonl; the held-out split is never trained on"),
    ("a row without its answer", ["train", *_train_data("{noanswer_jsonl}", source="jsonl"), "reward.function=exact_match"], {}, r"data\.train_path: .*/noanswer\.jsonl: row 2: no 'answer' column"),
    ("parquet missing columns", ["train", *_train_data("{nocols_parquet}", "{nocols_parquet}", "verl_parquet")], {}, r"nocols\.parquet: missing columns"),
    ("parquet empty", ["train", *_train_data("{empty_parquet}", "{empty_parquet}", "verl_parquet")], {}, r"empty\.parquet: file is empty \(no rows\)"),
    ("not parquet", ["train", *_train_data("{notparquet_parquet}", "{notparquet_parquet}", "verl_parquet")], {}, r"notparquet\.parquet: not a readable parquet file"),
    ("files without a data.source", ["train", "data.train_path={good_jsonl}", "data.test_path={good_jsonl}"], {}, r"data\.train_path: data\.source=synthetic generates its prompts and reads no file; name the file's format with data\.source \(jsonl, parquet, verl_parquet or gsm8k\)"),
    ("verl rows of an unmapped data_source", ["train", *_train_data("{mine_train_parquet}", "{mine_test_parquet}", "verl_parquet")], {}, r"config error: reward\.function: rows of data\.source=verl_parquet have data_source 'my_org/gsm8k_v2' with no registered reward: map it \(reward\.by_data_source=\{my_org/gsm8k_v2: gsm8k\}\)"),
    ("a data_source mapped to an unknown reward", ["train", "reward.by_data_source={{my_org/x: gsm9k}}"], {}, r"config error: reward\.by_data_source\.my_org/x: unknown reward function 'gsm9k'; valid: "),
    ("data-prep bad line", ["data-prep", *_train_data("{badline_jsonl}")], {}, r"badline\.jsonl:2: invalid JSON"),
    # ---- the model folder
    ("model folder missing", ["train", "model.path={w}/nomodel"], {}, r"model\.path .*/nomodel: not a directory"),
    ("model without config.json", ["train", "model.path={m_noconfig}"], {}, r"model\.path .*/noconfig: no config\.json"),
    ("model config.json not JSON", ["train", "model.path={m_badjson}"], {}, r"model\.path .*/badjson: config\.json is unreadable"),
    ("model config.json not UTF-8", ["train", "model.path={m_latin1}"], {}, r"model\.path .*/latin1: config\.json is unreadable"),
    ("model without weights", ["train", "model.path={m_noweights}"], {}, r"model\.path .*/noweights: no \*\.safetensors weights"),
    ("model with pickled weights only", ["train", "model.path={m_pickle}"], {}, r"model\.path .*/pickle: no \*\.safetensors weights"),
    ("model weights corrupt", ["train", "model.path={m_corrupt}"], {}, r"model\.safetensors: not a readable safetensors file"),
    ("model weights truncated", ["train", "model.path={m_truncated}"], {}, r"model\.safetensors: truncated \(79 bytes, its header announces 4171\)"),
    ("model shard missing", ["train", "model.path={m_index}"], {}, r"shard-1\.safetensors: file is missing"),
    # ---- services and the store
    ("Prefect API unreachable", ["train", "store.root={w}/s2"], {"PREFECT_API_URL": "http://127.0.0.1:9/api"}, r"Prefect API http://127\.0\.0\.1:9/api \(PREFECT_API_URL\) is unreachable"),
    ("MLflow unreachable", ["train", "tracking.tracking_uri=http://127.0.0.1:9"], {}, r"MLflow tracking server http://127\.0\.0\.1:9 is unreachable"),
    ("store root unwritable", ["train", "store.root={blocker}/store"], {}, r"store root .*/blocker/store cannot be written"),
    ("empty store key", ["replay", "good", "1", "reward", "--store", "{store}"], {"RLSTAGE_STORE_HMAC_KEY": ""}, r"RLSTAGE_STORE_HMAC_KEY is set but empty"),
    ("unsigned store with a key", ["eval", "good", "--store", "{store}"], {"RLSTAGE_STORE_HMAC_KEY": "k"}, r"good/run\.json is unsigned, but RLSTAGE_STORE_HMAC_KEY is set"),
    # ---- runs and iterations
    ("conflicting config", ["train", "run_name=good", "store.root={store}", "actor.optim.lr=0.5"], {}, r"run 'good' exists with another config \(actor\.optim\.lr: stored 0\.0001, given 0\.5\)"),
    ("replay run missing", ["replay", "nope", "1", "reward", "--store", "{store}"], {}, r"run 'nope' does not exist under"),
    ("replay iteration missing", ["replay", "good", "5", "reward", "--store", "{store}"], {}, r"run 'good' has no committed reward at iteration 5"),
    ("replay stage unknown", ["replay", "good", "1", "rolout", "--store", "{store}"], {}, r"stage 'rolout' cannot be replayed; valid: rollout, reward"),
    ("replay moves the run", ["replay", "good", "1", "reward", "store.root=/x", "--store", "{store}"], {}, r"config error: store\.root: a replay cannot change it"),
    ("replay bad override", ["replay", "good", "1", "reward", "reward.timeout_s=0", "--store", "{store}"], {}, r"config error: reward\.timeout_s: Input should be greater than 0"),
    ("eval run missing", ["eval", "nope", "--store", "{store}"], {}, r"run 'nope' does not exist under"),
    ("eval iteration missing", ["eval", "good", "-i", "3", "--store", "{store}"], {}, r"iteration: run 'good' has policies for 0\.\.0, got 3"),
    ("nightly run missing", ["nightly", "nope", "--store", "{store}"], {}, r"run 'nope' does not exist under"),
    ("nightly zero iterations", ["nightly", "good", "-k", "0", "--store", "{store}"], {}, r"--iterations: must be >= 1, got 0"),
    ("nightly past a decaying run's length", ["nightly", "done", "--store", "{store}"], {}, r"run 'done' has run all its trainer\.iterations=1, over which its lr decays"),
    ("run.json not JSON", ["eval", "broken", "--store", "{store}"], {}, r"broken/run\.json is not valid JSON"),
    # ---- stored bytes or a stored config naming code (the attacks): refused, and the marker never appears
    ("stored reward fn: replay", ["replay", "evil", "1", "reward", "--store", "{store}"], {}, r"reward\.function: '.*evil_reward\.py:score' comes from the stored config .*RLSTAGE_ALLOWED_CALLABLES"),
    ("stored reward fn: eval", ["eval", "evil", "--store", "{store}"], {}, r"reward\.function: '.*evil_reward\.py:score' comes from the stored config"),
    ("stored reward fn: nightly", ["nightly", "evil", "--store", "{store}"], {}, r"reward\.function: '.*evil_reward\.py:score' comes from the stored config"),
    ("pickle in a resumed checkpoint", ["train", "run_name=pickled", "store.root={store}", "trainer.iterations=2"], {}, r"checkpoint .*/pickled/iter-0+1/update holds a pickled actor_state\.pt \(an earlier format, unsafe to load\)"),
    ("pickle in a nightly's checkpoint", ["nightly", "pickled", "--store", "{store}"], {}, r"checkpoint .*/pickled/iter-0+1/update holds a pickled actor_state\.pt"),
    ("pickle in an evaluated checkpoint", ["eval", "pickled", "-i", "1", "--store", "{store}"], {}, r"checkpoint .*/pickled/iter-0+1/update holds a pickled actor_state\.pt"),
    ("pickle in the shared SFT kit", ["train", "run_name=fresh", "store.root={store}"], {}, r"checkpoint .*/kit-\w+/.*sft holds model/pytorch_model\.bin, a file type that is never loaded"),
    ("pickle in a resumed run's reference", ["train", "run_name=resumed", "store.root={store}", "trainer.iterations=2"], {}, r"checkpoint .*/kit-\w+/.*sft holds model/pytorch_model\.bin"),
    # ---- registries and plugins (a plugin's import must not write its bytecode into the checked folder)
    ("unknown policy loss", ["train", "actor.policy_loss=gspoo"], {}, r"config error: actor\.policy_loss: unknown policy loss 'gspoo'; registered: vanilla, "),
    ("plugin fails to import", ["train", "plugins=[broken_plugin]"], NOPYC, r"config error: plugins\.0: plugin 'broken_plugin' failed to import: RuntimeError: this plugin is broken \(see https://rlstage\.readthedocs\.io/en/latest/reference/config/#plugins\)$"),
    ("two plugins, one name", ["train", "plugins=[twin_a, twin_b]"], NOPYC, r"config error: plugins\.1: plugin 'twin_b': policy loss 'twin' is registered twice: by twin_a and by twin_b \(see https://rlstage\.readthedocs\.io/en/latest/reference/config/#plugins\)$"),
    ("plugin settings refused", ["train", "plugins=[strict_plugin]", "actor.policy_loss={{name: strict, beta: -1}}"], NOPYC, r"config error: actor\.policy_loss\.beta: Input should be greater than 0"),
    ("plugin setting unknown", ["train", "plugins=[strict_plugin]", "actor.policy_loss={{name: strict, gamma: 1}}"], NOPYC, r"config error: actor\.policy_loss\.gamma: strict takes no gamma \(its settings: beta\)"),
    ("stored run's plugin missing", ["nightly", "plugged", "--store", "{store}"], {}, r"config error: run 'plugged' was run with plugin rlstage-no-such-plugin==0\.1\.0, which is not installed here"),
    ("stored run's plugin missing: resume", ["train", "run_name=plugged", "store.root={store}"], {}, r"run 'plugged' was run with plugin rlstage-no-such-plugin==0\.1\.0"),
    ("stored reward function changed: resume", ["train", "run_name=scored", "store.root={store}", "reward.function=scorer:score"], NOPYC, r"config error: run 'scored' was run with scorer sha256:000000000000 \(its reward function or tools\), this environment has sha256:\w{12}: its committed stages would be reused"),
    ("stored reward function changed: eval", ["eval", "scored", "reward.function=scorer:score", "--store", "{store}"], NOPYC, r"config error: run 'scored' was run with scorer sha256:000000000000 \(its reward function or tools\)"),
    ("stored tool: replay", ["replay", "eviltool", "1", "rollout", "--store", "{store}"], {}, r"agent\.tools\.0\.callable: 'evil_tool:score' comes from the stored config"),
]  # fmt: skip


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


# The CLI's main() in a child forked, per case, from one process that imported what loading a config imports (the
# registries' torch, Ray, MLflow: ~1.5 s of each fresh command): each case gets its own environment, working folder
# and bytecode setting as a new process would, and ends with os._exit of main()'s code. Prefect is not imported
# beforehand (it reads its settings from the environment at import).
FORKS = r"""
import json, os, sys, traceback
import rlstage.flows.cli as cli
import rlstage.engines.preflight, rlstage.schemas.config
# what a train command's checks import lazily (the registries and torch): otherwise ~1.3 s in each of ~60 children
import rlstage.engines.algorithms, rlstage.engines.rollout, rlstage.infra.explore, rlstage.schemas.settings_help
cli._user_errors()
for line in sys.stdin:
    case = json.loads(line)
    pid = os.fork()
    if pid == 0:
        os.chdir(case["cwd"])
        os.environ.clear()
        os.environ.update(case["env"])
        sys.dont_write_bytecode = bool(case["env"].get("PYTHONDONTWRITEBYTECODE"))
        for fd, path in ((1, case["out"]), (2, case["err"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        try:
            code = cli.main(case["argv"])
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(json.dumps(os.waitstatus_to_exitcode(status)), flush=True)
"""


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict:
    w = tmp_path_factory.mktemp("bad-input")
    paths = _world(w)
    cwd = w / "cwd"
    cwd.mkdir()
    out = tmp_path_factory.mktemp("bad-input-output")  # outside w, where nothing may appear
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RLSTAGE_", "PREFECT_API", "MLFLOW_TRACKING"))}
    # Our modules from this tree; evil_tool importable if the check failed to stop it; an empty allow-list.
    env.update(PYTHONPATH=os.pathsep.join([source_path(), str(w)]), XDG_CONFIG_HOME=str(w / "xdg"))
    before = _files(w)
    forks = subprocess.Popen([sys.executable, "-c", FORKS], cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    results = {}
    try:
        for i, (name, argv, extra, _) in enumerate(CASES):
            case = {"argv": [a.format(**paths) for a in argv], "env": {**env, **extra}, "cwd": str(cwd)}
            case.update(out=str(out / f"{i}.out"), err=str(out / f"{i}.err"))
            forks.stdin.write(json.dumps(case) + "\n")
            forks.stdin.flush()
            code = json.loads(forks.stdout.readline())
            results[name] = subprocess.CompletedProcess(argv, code, Path(case["out"]).read_text(), Path(case["err"]).read_text())
    finally:
        forks.stdin.close()
        forks.wait(60)
    return {"results": results, "new_files": _files(w) - before, "marker": Path(paths["marker"])}


@pytest.mark.parametrize(("name", "argv", "env", "pattern"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line(outcomes, name, argv, env, pattern) -> None:
    proc = outcomes["results"][name]
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1, proc.stderr
    assert re.search(pattern, lines[0]), lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert lines[0].startswith("rlstage")
    assert "starting a local Prefect server" not in proc.stderr + proc.stdout


def test_nothing_written_and_no_stored_code_ran(outcomes) -> None:
    assert len(CASES) >= 40
    assert outcomes["new_files"] == set()
    assert not outcomes["marker"].exists()


def test_verbose_prints_the_traceback(tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "RLSTAGE_DEBUG": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "rlstage.flows.cli", "replay", "nope", "1", "reward", "--store", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "Traceback" in proc.stderr and proc.stderr.strip().splitlines()[-1].startswith("rlstage: run 'nope' does not exist")
