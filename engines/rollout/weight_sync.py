"""A policy's weights from one process to another in memory: buckets of packed tensors, whole or as deltas.

The trainer's ``WeightSender`` packs its model's checkpoint-named tensors into buckets of about ``bucket_bytes``
(each tensor's bytes as a view, which Ray's object store copies once); a rollout role's ``WeightReceiver`` holds
them aside and writes them into its own model only once the last one arrived, so a push
that stops half-way (the receiver killed mid-bucket, the sender gone) never leaves a model with half-updated
weights. With ``delta`` the sender remembers what it sent last, and a receiver that holds that version gets only
the elements whose bits changed in the model's dtype (indices and values, where that is smaller than the tensor):
what an update moved below the dtype's resolution never travels.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from rlstage.engines.models.lora import is_peft, merged_state_dict

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # a dtype's bits, compared as integers


@dataclass(frozen=True)
class Piece:
    """One tensor of a bucket; ``changed`` >= 0: a delta of that many elements (their flat indices as int64, then
    their values), -1: the whole tensor."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    changed: int = -1


@dataclass(frozen=True)
class Bucket:
    pieces: list[Piece]
    # each piece's bytes (uint8; a whole tensor's is a view of the sender's weights): Ray's object store copies each
    # once, and a receiver reads them where they arrived
    data: list[np.ndarray]
    last: bool  # the push's final bucket

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.data)


@dataclass(frozen=True)
class PushPlan:
    """What a push carries: a ``delta`` against the version its receivers hold, or whole weights; a receiver holding
    no model yet builds one from ``config`` and ``tokenizer`` (sent only then)."""

    version: str
    delta: bool
    config: object | None = None
    tokenizer: object | None = None


def named_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The checkpoint-named tensors a receiver loads (a LoRA policy's merged into its base's names); a tied copy
    (an output layer sharing the embedding) once, under the first name, as ``save_pretrained`` writes it."""
    state = merged_state_dict(model) if is_peft(model) else model.state_dict()
    seen: set = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        key = (tensor.data_ptr(), tuple(tensor.shape)) if tensor.numel() else id(tensor)
        if key in seen:
            continue
        seen.add(key)
        out[name] = tensor.detach()
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(_BITS[t.element_size()])


class WeightSender:
    """The trainer's side: ``start`` a push of ``model`` as ``version``, then ``next_bucket`` until one is ``last``."""

    def __init__(self, delta: bool, bucket_bytes: int) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.delta, self.bucket_bytes = delta, bucket_bytes
        self.sent: dict[str, torch.Tensor] = {}  # delta: the weights as last sent (CPU), for the next diff
        self.sent_version: str | None = None
        self._items: Iterator[tuple[str, torch.Tensor]] | None = None
        self._pending: tuple[str, torch.Tensor] | None = None  # the tensor that did not fit the last bucket
        self._plan: PushPlan | None = None
        self.bytes = 0  # what the current (or last) push carried

    def start(self, model: torch.nn.Module, version: str, have: str | None, tokenizer=None) -> PushPlan:
        """Begin a push; a delta when the receivers hold ``have`` == the version this sender sent last."""
        delta = self.delta and have is not None and have == self.sent_version and bool(self.sent)
        fresh = have is None
        config = (model.get_base_model() if is_peft(model) else model).config
        self._plan = PushPlan(version, delta, config if fresh else None, tokenizer if fresh else None)
        self.sent_version = None  # until this push's last bucket: what ``sent`` holds is mid-way
        self._items, self._pending = iter(named_weights(model).items()), None
        self.bytes = 0
        return self._plan

    def next_bucket(self) -> Bucket:
        if self._items is None or self._plan is None:
            raise RuntimeError("no weight push started")
        pieces: list[Piece] = []
        chunks: list[np.ndarray] = []
        size = 0
        while True:
            item = self._pending or next(self._items, None)
            self._pending = None
            if item is None:
                break
            name, tensor = item
            payload, changed = self._payload(name, tensor)
            if payload is None:  # a delta with nothing changed
                continue
            if pieces and size + payload.nbytes > self.bucket_bytes:
                self._pending = item  # computed again in the next bucket (its diff is cheap beside the copy)
                break
            pieces.append(Piece(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), changed))
            chunks.append(payload)
            size += payload.nbytes
            if self.delta:
                self._remember(name, tensor)
        last = self._pending is None
        if last:
            self._items, self.sent_version = None, self._plan.version
        bucket = Bucket(pieces, chunks, last)
        self.bytes += bucket.nbytes
        return bucket

    def _payload(self, name: str, tensor: torch.Tensor) -> tuple[np.ndarray | None, int]:
        cpu = tensor.to("cpu").contiguous()
        if self._plan.delta and name in self.sent:
            moved = _bits(cpu) != _bits(self.sent[name])
            changed = int(moved.sum())
            if changed == 0:
                return None, 0
            if changed * (8 + cpu.element_size()) < cpu.numel() * cpu.element_size():  # else whole is smaller
                idx = moved.nonzero().reshape(-1)
                return np.concatenate([_bytes(idx), _bytes(cpu.reshape(-1)[idx])]), changed
        return _bytes(cpu), -1

    def _remember(self, name: str, tensor: torch.Tensor) -> None:
        held = self.sent.get(name)
        if held is None or held.shape != tensor.shape or held.dtype != tensor.dtype:
            self.sent[name] = tensor.to("cpu", copy=True).contiguous()
        else:
            held.copy_(tensor)


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


@dataclass
class WeightReceiver:
    """The rollout role's side: ``stage`` each bucket as it arrived, ``apply`` once the last one did."""

    staged: list[Bucket] = field(default_factory=list)
    plan: PushPlan | None = None

    def begin(self, plan: PushPlan) -> None:
        self.plan, self.staged = plan, []

    def stage(self, bucket: Bucket) -> bool:
        """Hold ``bucket`` as it came (out of Ray's object store: its memory stays there, pinned, until ``apply``)."""
        if self.plan is None:
            raise RuntimeError("a weight bucket arrived before its push began")
        self.staged.append(bucket)
        return bucket.last

    def apply(self, model: torch.nn.Module) -> int:
        """Write the staged push into ``model`` (its checkpoint names); the bytes it carried. Nothing is written
        unless its last bucket arrived and every name, shape and dtype matches."""
        staged, plan, self.staged, self.plan = self.staged, self.plan, [], None
        if plan is None or not staged or not staged[-1].last:
            raise RuntimeError(f"weight push incomplete: {len(staged)} bucket(s) arrived, not its last; the old weights stay")
        params = named_weights(model)
        writes: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = []
        for bucket in staged:
            for p, array in zip(bucket.pieces, bucket.data, strict=True):
                target = params.get(p.name)
                dtype = getattr(torch, p.dtype)
                if target is None or tuple(target.shape) != p.shape or target.dtype != dtype:
                    raise RuntimeError(f"weight push does not fit this model: {p.name} {p.dtype}{list(p.shape)}")
                with warnings.catch_warnings():  # the object store's arrays are read-only; they are only read
                    warnings.simplefilter("ignore", UserWarning)
                    raw = torch.from_numpy(array)
                if p.changed < 0:
                    writes.append((target, None, raw.view(dtype).view(p.shape)))
                else:
                    idx = raw[: 8 * p.changed].view(torch.int64)
                    writes.append((target, idx, raw[8 * p.changed :].view(dtype)))
        with torch.no_grad():  # every check passed: now written, whole tensors and deltas alike
            for target, idx, values in writes:
                if idx is None:
                    target.copy_(values)
                else:
                    target.view(-1)[idx.to(target.device)] = values.to(target.device)
        return sum(b.nbytes for b in staged)
