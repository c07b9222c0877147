"""The manifest: written last, it is what makes a stage's output visible."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from rlstage.schemas.artifacts import SCHEMA_VERSION


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


# A checkpoint artifact: a Hugging Face folder plus the trainer's state (engines/training/checkpoint.py's files).
MODEL_DIR = "model"
STATE_DIR = "trainer_state"
# ZeRO 1-3 over N > 1 ranks: each rank's optimizer partition under trainer_state/rank-<r>/, written by that rank.
SHARD_PREFIX = "rank-"
LEGACY_STATE = "actor_state.pt"  # the pickled format of earlier versions: never loaded
# What a checkpoint folder may hold: weights as safetensors, configs, tokenizers and templates as text.
# Anything else (pickled .bin/.pt, Python files a remote-code model would import) is refused unread.
SAFE_SUFFIXES = (".safetensors", ".json", ".txt", ".jinja", ".model", ".md")


def state_shard_dir(rank: int) -> str:
    return f"{STATE_DIR}/{SHARD_PREFIX}{rank}"


def state_shards(manifest: Manifest) -> int:
    """How many ranks' partitions a checkpoint's trainer state is split into (0: one whole state)."""
    prefix = f"{STATE_DIR}/{SHARD_PREFIX}"
    return len({name[len(prefix) :].split("/")[0] for name in manifest.files if name.startswith(prefix)})


def unsafe_checkpoint_file(manifest: Manifest, where: str) -> str | None:
    """Why loading this artifact's checkpoint could run code (one line naming the file), or None when it cannot."""
    for name in sorted(manifest.files):
        if name == LEGACY_STATE:
            return (
                f"checkpoint {where} holds a pickled {LEGACY_STATE} (an earlier format, unsafe to load); "
                "replay its update to store it anew"
            )
        if not name.endswith(SAFE_SUFFIXES) and name.startswith((MODEL_DIR + "/", STATE_DIR + "/")):
            return f"checkpoint {where} holds {name}, a file type that is never loaded (not safetensors/JSON/text)"
    return None


class PolicyRef(BaseModel):
    """Which policy a stage runs with: a committed checkpoint in the store or a local HF directory."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    version: str  # the checkpoint artifact's id, or "path:<dir>" for a local directory
    run: str | None = None
    iteration: int | None = None
    stage: str | None = None
    path: str | None = None
