"""MLflow tracking: one MLflow run per training run, resumed by later continuations."""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import pyarrow as pa

from rlstage.infra.db_templates import seed_mlflow_uri
from rlstage.infra.env import apply_defaults
from rlstage.infra.home import mlflow_uri
from rlstage.infra.store import ArtifactStore, store_identity
from rlstage.schemas.artifacts import PROMPTS
from rlstage.schemas.config import RunConfig, flat_form, plain_entry_names
from rlstage.schemas.manifest import Manifest

# A new SQLite store announces its table creation at INFO on every first run: noise in the command's output.
logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)

MAX_PARAM_CHARS = 500  # MLflow rejects longer parameter values
RUN_NAME_TAG = "rlstage.run_name"
STORE_TAG = "rlstage.store"  # a run is (store, run name): the same name in another store is another run
RESULT_TAG = "rlstage.result"  # a replay's or an extra evaluation's nested run: which result it records
# MLflow 3's UI opens an experiment by its kind; without the tag it infers GenAI (traces) for ours.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"  # shown as "Machine learning": the runs table
CONFIG_ARTIFACT = "config/resolved.yaml"
CHECKPOINT_TAG = "rlstage.checkpoint"  # a logged model's policy: the update artifact's id
PRUNED_TAG = "rlstage.pruned"  # set on a logged model whose checkpoint retention pruned (trainer.max_actor_ckpt_to_keep)
DIGEST_CHARS = 32  # MLflow's dataset digest column holds 36 characters: a sha256's first 32 hex digits
REPO_ROOT = Path(__file__).resolve().parent.parent
_BAD_METRIC_CHARS = re.compile(r"[^\w.\- :/]")


def tracking_uri_for(cfg: RunConfig) -> str:
    """``tracking.tracking_uri``, else ``MLFLOW_TRACKING_URI``, else the local home's SQLite store
    (``infra/home.py``: the one ``rlstage ui`` and the stack's MLflow server show)."""
    return cfg.tracking.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or mlflow_uri()


def _is_server(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


class TrackingUnavailable(RuntimeError):
    """The MLflow tracking server does not answer."""


def check_reachable(uri: str, timeout_s: float = 5.0) -> None:
    """Fail fast, with one line, when an HTTP tracking server does not answer (MLflow would retry for minutes)."""
    if not _is_server(uri):
        return
    import urllib.request

    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout_s):
            pass
    except OSError as err:
        raise TrackingUnavailable(f"MLflow tracking server {uri} is unreachable: {err}") from None


def flatten(tree: Any, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}{k}." if prefix or k else k))
        return out
    value = str(tree)
    out[prefix.rstrip(".")] = value if len(value) <= MAX_PARAM_CHARS else value[: MAX_PARAM_CHARS - 3] + "..."
    return out


def config_params(cfg: RunConfig) -> dict[str, str]:
    """The run's MLflow params: its config flattened, in the layout 0.1 logged (a policy loss by its name with its flat
    settings beside it, vLLM's settings as rollout.vllm_<name>, an estimator without settings by its name), the one
    its cache keys hash. MLflow's params are immutable and a continued run never logs them again, so a run started by
    0.1 keeps its params, and a run started now has the same keys and values for the same settings: the two compare
    side by side."""
    return flatten(plain_entry_names(flat_form(cfg.model_dump(mode="json"))))


def source_tags(root: Path = REPO_ROOT) -> dict[str, str]:
    """MLflow's standard source tags for the code a run executes: the git commit, branch and remote."""
    from mlflow.utils import git_utils
    from mlflow.utils.mlflow_tags import (
        MLFLOW_GIT_BRANCH,
        MLFLOW_GIT_COMMIT,
        MLFLOW_GIT_REPO_URL,
        MLFLOW_SOURCE_NAME,
        MLFLOW_SOURCE_TYPE,
    )

    tags = {MLFLOW_SOURCE_TYPE: "PROJECT", MLFLOW_SOURCE_NAME: "rlstage"}
    for tag, value in (
        (MLFLOW_GIT_COMMIT, git_utils.get_git_commit(str(root))),
        (MLFLOW_GIT_BRANCH, git_utils.get_git_branch(str(root))),
        (MLFLOW_GIT_REPO_URL, git_utils.get_git_repo_url(str(root))),
    ):
        if value:
            tags[tag] = value
    return tags


def mlflow_schema(schema: pa.Schema):
    """An Arrow schema as MLflow's (a dataset's schema in the UI)."""
    from mlflow.types.schema import Array, ColSpec, Object, Property, Schema

    def kind(t: pa.DataType):
        if pa.types.is_list(t) or pa.types.is_large_list(t):
            return Array(kind(t.value_type))
        if pa.types.is_struct(t):
            return Object([Property(f.name, kind(f.type)) for f in t])
        if pa.types.is_integer(t):
            return "long" if t.bit_width > 32 else "integer"
        if pa.types.is_floating(t):
            return "double" if t.bit_width > 32 else "float"
        return "boolean" if pa.types.is_boolean(t) else "binary" if pa.types.is_binary(t) else "string"

    return Schema([ColSpec(kind(f.type), f.name) for f in schema])


def _dataset_source(uri: str):
    """MLflow's dataset source for a store URI (a local path or s3://...)."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source

    with warnings.catch_warnings():  # the local source is registered twice: a warning on every resolve
        warnings.simplefilter("ignore")
        return resolve_dataset_source(uri)


def metric_name(name: str) -> str:
    """verl's metric names, made legal for MLflow ('@' is not allowed: mean@4 -> mean_at_4)."""
    return _BAD_METRIC_CHARS.sub("_", name.replace("@", "_at_"))


def _experiment_id(client, cfg: RunConfig) -> str:
    """The id of ``tracking.experiment``, created (as a training experiment) when missing."""
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    if exp is None:
        location = None
        # A tracking server's artifacts go to its own destination (--artifacts-destination); a local
        # store's beside the run's artifacts.
        if "://" not in cfg.store.root and not _is_server(client.tracking_uri):
            location = (Path(cfg.store.root).expanduser().resolve() / "mlflow-artifacts").as_uri()
        return client.create_experiment(
            cfg.tracking.experiment, artifact_location=location, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND}
        )
    if EXPERIMENT_KIND_TAG not in exp.tags:  # a kind chosen in the UI stays
        client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    return exp.experiment_id


def _training_run_id(client, experiment_id: str, cfg: RunConfig) -> str | None:
    """The MLflow run of ``cfg``'s training run: tagged with its name and store."""
    store = store_identity(cfg.store.root)
    named = client.search_runs([experiment_id], filter_string=f"tags.`{RUN_NAME_TAG}` = '{cfg.run_name}'")
    # Runs recorded before the store tag existed continue as before.
    found = [r for r in named if r.data.tags.get(STORE_TAG, store) == store]
    return found[0].info.run_id if found else None


def log_result(
    cfg: RunConfig, name: str, result: str, metrics: dict[str, float], step: int, tags: dict[str, str], params: dict[str, str]
) -> str:
    """Record a replay or an extra evaluation of ``cfg``'s run as an MLflow run named ``name``, nested in the
    training run's own (tag ``mlflow.parentRunId``), metrics at ``step`` (the iteration). ``result`` names
    what it records (a committed artifact version): a result recorded before is not logged twice.
    Returns the nested run's id."""
    apply_defaults()
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.tracking import MlflowClient
    from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

    uri = tracking_uri_for(cfg)
    check_reachable(uri)  # MLflow's client would retry a server that is down for minutes
    client = MlflowClient(uri)
    exp_id = _experiment_id(client, cfg)
    parent = _training_run_id(client, exp_id, cfg)
    recorded = client.search_runs([exp_id], filter_string=f"tags.`{RESULT_TAG}` = '{result}'")
    recorded = [r for r in recorded if r.data.tags.get(MLFLOW_PARENT_RUN_ID) == parent]
    if recorded:
        return recorded[0].info.run_id
    links = {MLFLOW_PARENT_RUN_ID: parent} if parent else {}
    run_id = client.create_run(exp_id, run_name=name, tags={RESULT_TAG: result, **links}).info.run_id
    now = int(time.time() * 1000)
    client.log_batch(
        run_id,
        metrics=[Metric(metric_name(k), float(v), now, step) for k, v in sorted(metrics.items())],
        params=[Param(k, str(v)[:MAX_PARAM_CHARS]) for k, v in sorted(params.items())],
        tags=[RunTag(k, v) for k, v in {**source_tags(), **tags}.items()],
    )
    client.set_terminated(run_id)
    return run_id


class Tracker:
    def __init__(self, cfg: RunConfig, tags: dict[str, str] | None = None) -> None:
        apply_defaults()
        from mlflow.tracking import MlflowClient

        self.uri = tracking_uri_for(cfg)
        if self.uri.startswith("sqlite:///"):
            Path(self.uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
            seed_mlflow_uri(self.uri)  # a new store starts migrated (infra/db_templates.py)
        self.offline = False  # the server stopped answering mid-run
        self.unsent: dict[int, dict[str, float]] = {}  # step -> metrics not yet sent
        self.models: dict[int, str] = {}  # step -> the logged model its metrics describe
        # No mlflow.set_tracking_uri: it exports MLFLOW_TRACKING_URI, which later runs of this process (and
        # the processes it starts) would take for their own tracking URI.
        self.client = MlflowClient(self.uri)
        self.experiment_id = exp_id = _experiment_id(self.client, cfg)
        store = store_identity(cfg.store.root)
        found = _training_run_id(self.client, exp_id, cfg)
        if found:
            self.run_id = found
            self.client.update_run(self.run_id, status="RUNNING")
            self.client.set_tag(self.run_id, STORE_TAG, store)
        else:
            identity = {RUN_NAME_TAG: cfg.run_name, STORE_TAG: store}
            run = self.client.create_run(exp_id, run_name=cfg.run_name, tags=identity)
            self.run_id = run.info.run_id
            from mlflow.entities import Param

            params = [Param(k, v) for k, v in sorted(config_params(cfg).items())]
            for i in range(0, len(params), 100):
                self.client.log_batch(self.run_id, params=params[i : i + 100])
        # Each invocation (first or continuation) records the code it runs and its resolved config.
        for k, v in {**source_tags(), **(tags or {})}.items():
            self.client.set_tag(self.run_id, k, v)
        self.client.log_dict(self.run_id, cfg.model_dump(mode="json"), CONFIG_ARTIFACT)

    # ------------------------------------------------------------ a server that goes away mid-run
    # The run goes on: metrics that could not be sent are kept and sent, in step order, by the first call
    # that reaches the server again; those of a process that ended first are logged from the store by the
    # next invocation (flows/training.py). Tables and texts of the meantime are skipped.
    def _send(self, fn) -> bool:
        try:
            fn()
        except Exception as err:
            try:
                check_reachable(self.uri, timeout_s=2.0)
            except TrackingUnavailable as down:
                if not self.offline:
                    print(f"rlstage: warning: {down}; the run goes on, metrics are logged when it answers", file=sys.stderr)
                self.offline = True
                return False
            raise err
        if self.offline:
            print(f"rlstage: MLflow tracking server {self.uri} answers again", file=sys.stderr)
            self.offline = False
        return True

    def _log_batch(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        model = self.models.get(step)
        batch = [Metric(metric_name(k), float(v), now, step, model_id=model) for k, v in sorted(metrics.items())]
        for i in range(0, len(batch), 500):
            self.client.log_batch(self.run_id, metrics=batch[i : i + 500])

    def log_metrics(self, step: int, metrics: dict[str, float], model_id: str | None = None) -> None:
        """Metrics at ``step``; with ``model_id`` they are the logged model's as well (its page shows them)."""
        if model_id:
            self.models[step] = model_id
        self.unsent[step] = {**self.unsent.get(step, {}), **metrics}
        self._flush()

    def _flush(self) -> None:
        """Send the kept metrics in step order, up to the first that does not reach the server."""
        for s in sorted(self.unsent):
            if not self._send(lambda s=s: self._log_batch(s, self.unsent[s])):
                return
            del self.unsent[s]

    def logged_steps(self, *metrics: str) -> set[int]:
        """The steps at which the MLflow run holds any of ``metrics``."""
        return {m.step for name in metrics for m in self.client.get_metric_history(self.run_id, metric_name(name))}

    def log_table(self, rows: dict[str, list], artifact_file: str) -> None:
        self._send(lambda: self.client.log_table(self.run_id, data=rows, artifact_file=artifact_file))

    def log_text(self, text: str, artifact_file: str) -> None:
        self._send(lambda: self.client.log_text(self.run_id, text, artifact_file))

    # ------------------------------------------------------------ the run's inputs and its outcome
    def log_prompts(self, store: ArtifactStore, prompts: Manifest) -> None:
        """The run's prompts as MLflow dataset inputs: the committed train and test Parquet files, by
        reference (their store URI, checksum and schema). MLflow keeps one input per dataset and digest, so a
        continuation logs nothing new."""
        from mlflow.data.meta_dataset import MetaDataset
        from mlflow.entities import DatasetInput, InputTag
        from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

        inputs = []
        schema = mlflow_schema(PROMPTS)  # the prompts' contract: every committed prompts file has it
        for name, context in (("train.parquet", "training"), ("test.parquet", "evaluation")):
            dataset = MetaDataset(
                _dataset_source(store.uri(prompts, name)),
                name=f"{prompts.run}/{name.removesuffix('.parquet')}",
                digest=prompts.files[name].sha256[:DIGEST_CHARS],
                schema=schema,
            )
            inputs.append(DatasetInput(dataset._to_mlflow_entity(), tags=[InputTag(MLFLOW_DATASET_CONTEXT, context)]))
        self._send(lambda: self.client.log_inputs(self.run_id, datasets=inputs))

    def log_policy(self, store: ArtifactStore, update: Manifest, folder: str) -> str | None:
        """The policy committed by ``update`` (its Hugging Face ``folder``) as an MLflow logged model that points
        at the checkpoint in the store (a ``checkpoint.json`` of file URIs and checksums: no second copy of the
        weights). Logged once per checkpoint; returns the model's id, for its iteration's metrics (None for an
        update between checkpoints, or while the server is away)."""
        weights = {name: e for name, e in sorted(update.files.items()) if name.startswith(folder + "/")}
        ids: list[str] = []
        if weights:
            self._send(lambda: ids.append(self._policy_model(store, update, weights)))
        return ids[0] if ids else None

    def mark_pruned(self, update: Manifest) -> None:
        """Tag the logged model of a checkpoint that retention pruned (``rlstage.pruned``): its file URIs are gone."""

        def mark() -> None:
            tag = f"tags.`{CHECKPOINT_TAG}` = '{update.artifact_id}'"
            for model in self.client.search_logged_models([self.experiment_id], filter_string=tag):
                self.client.set_logged_model_tags(model.model_id, {PRUNED_TAG: "true"})

        self._send(mark)

    def _policy_model(self, store: ArtifactStore, update: Manifest, weights: dict) -> str:
        tag = f"tags.`{CHECKPOINT_TAG}` = '{update.artifact_id}'"
        found = self.client.search_logged_models([self.experiment_id], filter_string=tag)
        if found:
            return found[0].model_id
        pointer = {
            "artifact": store.artifact_dir(update.run, update.iteration, update.stage, update.version),
            "iteration": update.iteration,
            "files": {name: {"uri": store.uri(update, name), "sha256": e.sha256, "bytes": e.bytes} for name, e in weights.items()},
        }
        model = self.client.create_logged_model(
            self.experiment_id,
            name=f"{update.run}-policy",
            source_run_id=self.run_id,
            tags={CHECKPOINT_TAG: update.artifact_id},
            params={"iteration": str(update.iteration), "checkpoint": pointer["artifact"]},
            model_type="policy",
        )
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "checkpoint.json"
            path.write_text(json.dumps(pointer, indent=2))
            self.client.log_model_artifact(model.model_id, str(path))
        self.client.finalize_logged_model(model.model_id, "READY")
        return model.model_id

    def finish(self, status: str = "FINISHED") -> None:
        self._flush()
        self._send(lambda: self.client.set_terminated(self.run_id, status=status))

    @property
    def run_url(self) -> str:
        return f"{self.uri} (experiment {self.experiment_id}, run {self.run_id})"
