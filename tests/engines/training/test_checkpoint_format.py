"""Trainer state without pickle: exact round trips, and stored bytes that never run code."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from rlstage.engines.models.tinykit import build_char_tokenizer, build_tiny_llama
from rlstage.engines.training.actor import TorchActor
from rlstage.engines.training.checkpoint import (
    STATE_JSON,
    UnsafeStateError,
    load_trainer_state,
    save_trainer_state,
)
from rlstage.schemas.config import ActorConfig, ConfigError, KitConfig, OptimConfig

KIT = KitConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)


def _batch(n: int = 6) -> dict[str, list]:
    g = torch.Generator().manual_seed(0)
    rows: dict[str, list] = {k: [] for k in ("prompt_ids", "response_ids", "response_mask", "old_log_probs", "advantages")}
    for i in range(n):
        r = torch.randint(4, 20, (3 + i % 3,), generator=g).tolist()
        rows["prompt_ids"].append(torch.randint(4, 20, (4,), generator=g).tolist())
        rows["response_ids"].append(r)
        rows["response_mask"].append([1] * len(r))
        rows["old_log_probs"].append([-3.0] * len(r))
        rows["advantages"].append([1.0 if i % 2 else -1.0] * len(r))
    return rows


def _actor(weights=None) -> TorchActor:
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    model = build_tiny_llama(KIT, tok)
    if weights is not None:
        model.load_state_dict(weights)
    cfg = ActorConfig(ppo_mini_batch_size=3, micro_batch_size=3, optim=OptimConfig(lr=1e-2, warmup_steps=2, lr_schedule="cosine"))
    return TorchActor(model, cfg, tok.pad_token_id, 20)


@pytest.mark.invariant("resumed == uninterrupted", "the weights after the next step bit for bit")
def test_resumed_optimizer_and_schedule_continue_bit_identically(tmp_path):
    batch = _batch()
    straight = _actor()
    straight.update(batch, 1.0, 1)
    weights = {k: v.clone() for k, v in straight.model.state_dict().items()}
    save_trainer_state(straight.state_dict(), tmp_path / "state")
    straight.update(batch, 1.0, 2)

    resumed = _actor(weights)
    resumed.load_state_dict(load_trainer_state(tmp_path / "state"))
    assert resumed.scheduler.last_epoch == 2 and resumed.optimizer.state  # the state really came back
    resumed.update(batch, 1.0, 2)
    for k, v in straight.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[k], v), k
    moved = any(not torch.equal(weights[k], v) for k, v in straight.model.state_dict().items())
    assert moved  # the weights really changed between the two updates


def test_values_keep_their_types(tmp_path):
    state = {"a": (0.9, 0.999), 3: [None, True, "x", float("inf")], "t": torch.arange(4, dtype=torch.int16)}
    save_trainer_state(state, tmp_path)
    back = load_trainer_state(tmp_path)
    assert back["a"] == (0.9, 0.999) and back[3][:3] == [None, True, "x"] and back[3][3] == float("inf")
    assert back["t"].dtype == torch.int16 and back["t"].tolist() == [0, 1, 2, 3]


def test_an_unregistered_object_is_refused_when_saving(tmp_path):
    with pytest.raises(UnsafeStateError, match="no registered safe encoding"):
        save_trainer_state({"x": object()}, tmp_path)


def test_a_state_file_naming_code_is_refused_not_resolved(tmp_path):
    save_trainer_state({"x": 1}, tmp_path)
    doc = json.loads((tmp_path / STATE_JSON).read_text())
    doc["state"] = {"o": "os.system", "v": "touch " + str(tmp_path / "owned")}
    (tmp_path / STATE_JSON).write_text(json.dumps(doc))
    with pytest.raises(UnsafeStateError, match="not registered"):
        load_trainer_state(tmp_path)
    assert not (tmp_path / "owned").exists()


class _Payload:
    """Unpickling this creates a marker file: what a crafted checkpoint would do."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_pickled_state_in_a_stored_checkpoint_is_refused_unread(tmp_path):
    from rlstage.engines.models.tinykit import save_model_dir
    from rlstage.schemas.config import load_config
    from rlstage.schemas.manifest import PolicyRef
    from rlstage.workers.policy import PolicyWorker

    tok = build_char_tokenizer()
    model_dir = save_model_dir(build_tiny_llama(KIT, tok), tok, tmp_path / "m")
    worker = PolicyWorker(load_config(None, [f"store.root={tmp_path / 'store'}"]).model_dump(mode="json"), 10)
    marker = tmp_path / "owned"
    blobs = {f"model/{p.name}": p.read_bytes() for p in model_dir.iterdir()}
    for name in ("actor_state.pt", "model/pytorch_model.bin"):
        m = worker.store.commit(
            "r", 1, "update", key="k", config_hash="c", code_version="x", inputs={},
            blobs={**blobs, name: pickle.dumps(_Payload(str(marker)))},
        )  # fmt: skip
        ref = PolicyRef(version=m.artifact_id, run="r", iteration=1, stage="update")
        with pytest.raises(ConfigError, match="never loaded|unsafe to load"):
            worker.acquire(ref.model_dump(mode="json"))
        assert not marker.exists() and worker.version() is None
    worker.close()
