"""Trainer state (optimizer, scheduler, engine bookkeeping) stored without pickle.

A checkpoint read from a bucket must not be able to run code in its reader, so ``torch.load`` of
stored bytes is out. The state dict is split into ``trainer_state.safetensors`` (every tensor, in
its own dtype, no larger than the tensors themselves) and ``trainer_state.json`` (the nesting and
every plain value). Objects that are neither are encoded through an explicit table of named
types (``register_type``): loading looks a name up in that table and never imports anything the
file names, so an unknown name is refused, not resolved.
"""

from __future__ import annotations

import json
import math
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load_file, save_file

STATE_TENSORS = "trainer_state.safetensors"
STATE_JSON = "trainer_state.json"
FORMAT = "rlstage-trainer-state/1"


class UnsafeStateError(ValueError):
    """A trainer state that cannot be stored or loaded without executing code."""


@dataclass(frozen=True)
class _Codec:
    cls: type
    encode: Callable[[Any], Any]  # object -> a value this module can store
    decode: Callable[[Any], Any]  # that value -> object


_CODECS: dict[str, _Codec] = {}


def register_type(name: str, cls: type, encode: Callable[[Any], Any], decode: Callable[[Any], Any]) -> None:
    """Allow ``cls`` in a trainer state under ``name`` (e.g. an engine's enum or small record)."""
    _CODECS[name] = _Codec(cls, encode, decode)


def _codec_for(obj: Any) -> tuple[str, _Codec] | None:
    for name, codec in _CODECS.items():
        if type(obj) is codec.cls:
            return name, codec
    return None


def _float(x: float) -> Any:
    # JSON has no inf/nan: spelled out so the file stays standard JSON.
    return x if math.isfinite(x) else {"f": repr(x)}


def _encode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        t = obj.detach().to("cpu").contiguous()
        # safetensors refuses tensors sharing storage: copy only those (optimizer states never do).
        if any(o.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for o in tensors.values()):
            t = t.clone()
        tensors[key] = t
        return {"t": key}
    if obj is None or isinstance(obj, bool | str):
        return obj
    if isinstance(obj, int) and type(obj) is int:
        return obj
    if isinstance(obj, float) and type(obj) is float:
        return _float(obj)
    if type(obj) in (dict, OrderedDict):
        items = []
        for k, v in obj.items():
            if type(k) not in (str, int):
                raise UnsafeStateError(f"trainer state key {k!r} is a {type(k).__name__}, not str or int")
            items.append([k, _encode(v, tensors)])
        return {"d" if type(obj) is dict else "od": items}
    if type(obj) in (list, tuple):
        return {"l" if type(obj) is list else "u": [_encode(v, tensors) for v in obj]}
    found = _codec_for(obj)
    if found is None:
        raise UnsafeStateError(
            f"trainer state holds a {type(obj).__module__}.{type(obj).__qualname__}, which has no registered "
            "safe encoding (engines.training.checkpoint.register_type)"
        )
    name, codec = found
    return {"o": name, "v": _encode(codec.encode(obj), tensors)}


def _decode(node: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if node is None or isinstance(node, bool | str | int | float):
        return node
    if not isinstance(node, dict) or len(node) not in (1, 2):
        raise UnsafeStateError(f"trainer state: unexpected node {str(node)[:80]}")
    if "t" in node:
        try:
            return tensors[node["t"]]
        except KeyError:
            raise UnsafeStateError(f"trainer state names tensor {node['t']!r}, which the tensor file lacks") from None
    if "f" in node:
        value = float(node["f"])  # float() parses only numbers, inf and nan
        if math.isfinite(value):
            raise UnsafeStateError(f"trainer state: {node['f']!r} spelled out but finite")
        return value
    if "d" in node or "od" in node:
        out = {} if "d" in node else OrderedDict()
        for k, v in node.get("d", node.get("od")):
            if type(k) not in (str, int):
                raise UnsafeStateError(f"trainer state key {k!r} is not str or int")
            out[k] = _decode(v, tensors)
        return out
    if "l" in node:
        return [_decode(v, tensors) for v in node["l"]]
    if "u" in node:
        return tuple(_decode(v, tensors) for v in node["u"])
    if "o" in node:
        codec = _CODECS.get(node["o"])
        if codec is None:
            raise UnsafeStateError(f"trainer state names type {node['o']!r}, which is not registered; refused")
        return codec.decode(_decode(node["v"], tensors))
    raise UnsafeStateError(f"trainer state: unexpected node {str(node)[:80]}")


def save_trainer_state(state: dict, folder: str | os.PathLike) -> list[str]:
    """Write ``state`` as safetensors + JSON under ``folder``; returns the file names written."""
    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(state, tensors)
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, STATE_TENSORS), metadata={"format": FORMAT})
    with open(os.path.join(folder, STATE_JSON), "w") as f:
        json.dump({"format": FORMAT, "state": tree}, f, sort_keys=True, allow_nan=False)
    return [STATE_TENSORS, STATE_JSON]


def load_trainer_state(folder: str | os.PathLike) -> dict:
    """Read what ``save_trainer_state`` wrote; nothing in the files can name code to run."""
    with open(os.path.join(folder, STATE_JSON)) as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise UnsafeStateError(f"{folder}/{STATE_JSON}: not a {FORMAT} file")
    tensors = load_file(os.path.join(folder, STATE_TENSORS))
    state = _decode(doc["state"], tensors)
    if not isinstance(state, dict):
        raise UnsafeStateError(f"{folder}/{STATE_JSON}: the state is not a mapping")
    return state
