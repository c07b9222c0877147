"""Shared plumbing of the stage tasks: the store and cache keys (the policy worker is ``workers.group``)."""

from __future__ import annotations

import hashlib
import json
import subprocess
from functools import lru_cache
from pathlib import Path

from rlstage.engines import algorithms  # noqa: F401  (the built-in entries, whose needs shape the views)
from rlstage.engines.data import datasets  # noqa: F401  (the built-in data sources: the kit's needs "kit")
from rlstage.engines.plugins import plugins_used
from rlstage.engines.registry import NAMED_SETTINGS, needs_of
from rlstage.infra.store import ArtifactStore
from rlstage.schemas.config import RunConfig
from rlstage.schemas.manifest import Manifest, PolicyRef
from rlstage.schemas.stages import ConfigView, covers, view_hash, view_paths, whole_config


@lru_cache(maxsize=1)
def code_version() -> str:
    try:
        root = Path(__file__).resolve().parent.parent
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def store_for(cfg: RunConfig | ConfigView) -> ArtifactStore:
    return ArtifactStore(cfg.store.root, cfg.store.storage_options, retries=cfg.store.retries)


def stage_config_hash(cfg: RunConfig | ConfigView, stage: str) -> str:
    """What a stage's output depends on in the config (its view's hash) and, where its view names entries that
    plugins registered, those plugins' versions: another version of a plugin's loss is another stage. Without
    plugins it is the view's hash itself, so runs stored before plugins keep their keys."""
    paths = view_paths(cfg, stage, needs_of)
    used = plugins_used(whole_config(cfg), [s for s in NAMED_SETTINGS if covers(s, paths)])
    config_hash = view_hash(cfg, stage, needs_of)
    if not used:
        return config_hash
    blob = json.dumps({"config": config_hash, "plugins": used}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def stage_key(stage: str, inputs: dict[str, str], config_hash: str) -> str:
    blob = json.dumps({"stage": stage, "inputs": inputs, "config": config_hash}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def policy_ref_from(manifest: Manifest) -> PolicyRef:
    return PolicyRef(version=manifest.artifact_id, run=manifest.run, iteration=manifest.iteration, stage=manifest.stage)
