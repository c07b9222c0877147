"""The manifest: written last, it is what makes a stage's output visible."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from schemas.artifacts import SCHEMA_VERSION


class FileEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sha256: str
    bytes: int
    rows: int | None = None  # Parquet files only


class Manifest(BaseModel):
    """One committed artifact: where it is, what it holds and what it was made from."""

    model_config = ConfigDict(extra="forbid")
    schema_version: int = SCHEMA_VERSION
    artifact_id: str  # unique per commit: downstream stages record it as their input
    run: str
    iteration: int | None  # None for run-level artifacts (data prep)
    stage: str
    version: str = "main"  # "main" or a replay's sibling version
    key: str  # cache key: hash of (stage, input artifact ids, stage config)
    config_hash: str
    code_version: str
    created_at: str
    inputs: dict[str, str] = Field(default_factory=dict)  # input name -> artifact_id
    files: dict[str, FileEntry] = Field(default_factory=dict)
    meta: dict = Field(default_factory=dict)
    # HMAC-SHA256 over the rest of the manifest, present when the writer had a store key (infra/store.py).
    signature: str | None = None


class PolicyRef(BaseModel):
    """Which policy a stage runs with: a committed checkpoint in the store or a local HF directory."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    version: str  # the checkpoint artifact's id, or "path:<dir>" for a local directory
    run: str | None = None
    iteration: int | None = None
    stage: str | None = None
    path: str | None = None
