"""DeepSpeedActor against TorchActor on the tiny kit: ZeRO 0-3 parity, data parallelism, state, export."""

from __future__ import annotations

import io
import json
import os
import queue
import random

import pytest
import torch

from rlstage.engines.models.tinykit import build_char_tokenizer, build_tiny_llama
from rlstage.engines.training.actor import DataParallelTorchActor, TorchActor
from rlstage.schemas.config import ActorConfig, KitConfig, OptimConfig

deepspeed = pytest.importorskip("deepspeed")
from rlstage.engines.training.actor_deepspeed import DeepSpeedActor  # noqa: E402
from rlstage.infra.env import free_port  # noqa: E402

KIT = KitConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
TOL = 1e-5


@pytest.fixture(scope="module")
def tok():
    torch.set_num_threads(1)
    deepspeed.utils.logger.setLevel("WARNING")  # its INFO lines drown the test output
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def weights(tok):
    return {k: v.clone() for k, v in build_tiny_llama(KIT, tok).state_dict().items()}


@pytest.fixture(autouse=True)
def fresh_process_group():
    """Each test starts without a process group and leaves none behind (DeepSpeed keeps its own)."""
    yield
    if torch.distributed.is_initialized():
        deepspeed.comm.destroy_process_group()


def new_model(tok, weights):
    model = build_tiny_llama(KIT, tok)
    model.load_state_dict(weights)
    return model


def make_batch(tok, n: int, seed: int = 0) -> dict[str, list]:
    """A ragged batch: prompts and responses of varied lengths, masked tokens, off-policy old log-probs."""
    rng = random.Random(seed)
    vocab = len(tok)
    batch: dict[str, list] = {k: [] for k in ("prompt_ids", "response_ids", "response_mask")}
    batch.update(old_log_probs=[], advantages=[], ref_log_probs=[])
    for i in range(n):
        p = [rng.randrange(4, vocab) for _ in range(rng.randint(3, 9))]
        r = [rng.randrange(4, vocab) for _ in range(rng.randint(1, 7))]
        mask = [1] * len(r)
        if i % 3 == 1 and len(r) > 1:
            mask[-1] = 0  # e.g. a tool-output token the policy did not produce
        adv = rng.uniform(-1.5, 1.5)
        batch["prompt_ids"].append(p)
        batch["response_ids"].append(r)
        batch["response_mask"].append(mask)
        batch["advantages"].append([adv] * len(r))
        # Uniform-ish log-probs off the current policy so ratios leave the clip range in both directions.
        batch["old_log_probs"].append([-4.6 + rng.uniform(-0.6, 0.6) for _ in r])
        batch["ref_log_probs"].append([-4.6 + rng.uniform(-0.3, 0.3) for _ in r])
    return batch


def actor_cfg(stage: int, **kw) -> ActorConfig:
    base = dict(
        zero_stage=stage,
        ppo_mini_batch_size=4,
        micro_batch_size=3,  # mini-batches of 4 then 3: micro-batches 3+1 and 3, all ragged
        ppo_epochs=2,
        entropy_coeff=0.01,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        optim=OptimConfig(lr=5e-3, weight_decay=0.01, warmup_steps=2, lr_schedule="cosine", grad_clip=0.3),
    )
    base.update(kw)
    return ActorConfig(**base)


def assert_close_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for k in want:
        diff = (got[k].float() - want[k].float()).abs().max().item()
        assert diff <= TOL, f"{k}: max abs diff {diff}"


def assert_close_metrics(got: dict[str, float], want: dict[str, float]) -> None:
    assert set(got) == set(want)
    for k in want:
        assert abs(got[k] - want[k]) <= TOL * max(1.0, abs(want[k])), f"{k}: {got[k]} vs {want[k]}"


def torch_reference(tok, weights, cfg: ActorConfig, batch: dict, seeds: list[int]):
    model = new_model(tok, weights)
    actor = TorchActor(
        model, cfg.model_copy(update={"engine": "torch", "zero_stage": 0}), tok.pad_token_id, 20
    )
    metrics = [actor.update(batch, 0.9, s) for s in seeds]
    return metrics, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.invariant("DeepSpeed ZeRO 0-3 == the torch actor", "every metric and every weight within 1e-5")
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_update_matches_torch_actor(tok, weights, stage):
    batch = make_batch(tok, 7)
    cfg = actor_cfg(stage)
    ref_metrics, ref_params = torch_reference(tok, weights, cfg, batch, [11, 12])
    assert (
        0 < ref_metrics[0]["actor/pg_clipfrac"] < 1
        and ref_metrics[0]["actor/grad_norm"] > cfg.optim.grad_clip
    )

    actor = DeepSpeedActor(new_model(tok, weights), cfg, tok.pad_token_id, 20)
    try:
        for seed, want in zip([11, 12], ref_metrics, strict=True):
            assert_close_metrics(actor.update(batch, 0.9, seed), want)
        assert_close_state(actor.export_model(), ref_params)
        if stage == 3:  # really sharded: the module's own parameters are empty partitions
            assert all(p.numel() == 0 for p in actor.engine.module.parameters())
        # Log-probs go through the (ZeRO-3: gathering) forward too.
        ref = TorchActor(new_model(tok, ref_params), cfg, tok.pad_token_id, 20)
        got = actor.compute_log_probs(batch["prompt_ids"], batch["response_ids"], 0.9)
        want = ref.compute_log_probs(batch["prompt_ids"], batch["response_ids"], 0.9)
        assert (
            max(abs(a - b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True)) < 1e-4
        )
    finally:
        actor.close()


def test_shared_prompts_equal_the_padded_torch_update(tok, weights):
    """Two forwards per micro-batch (the prompts, then the responses on their cache) and one backward through
    both, under ZeRO-3's partitioned gradients and gathered parameters: the torch loop's padded update (ZeRO-2,
    which lost every gradient the same way before the prompt pass went through the bare module, passed too)."""
    stage = 3
    batch = make_batch(tok, 8)
    batch["prompt_ids"] = [batch["prompt_ids"][i - i % 4] for i in range(8)]  # two prompts, four samples each
    cfg = actor_cfg(stage, ppo_mini_batch_size=8, micro_batch_size=8, micro_batch_tokens=40)
    ref_metrics, ref_params = torch_reference(tok, weights, cfg, batch, [11])
    actor = DeepSpeedActor(new_model(tok, weights), cfg.model_copy(update={"share_prompts": True}), tok.pad_token_id, 20)
    try:
        assert_close_metrics(actor.update(batch, 0.9, 11), ref_metrics[0])
        assert_close_state(actor.export_model(), ref_params)
    finally:
        actor.close()

@pytest.mark.parametrize("stage", [0, 2])
def test_lora_update_matches_torch_actor(tok, weights, stage):
    """A peft LoRA policy under DeepSpeed: the adapters step as in the torch loop, the base stays put."""
    from rlstage.engines.models.lora import with_adapters
    from rlstage.schemas.config import ModelConfig

    lora = ModelConfig(lora_rank=4, lora_alpha=8)
    batch = make_batch(tok, 7, seed=4)
    cfg = actor_cfg(stage)
    torch.manual_seed(0)  # peft's A init: the same adapters on both sides
    ref_model = with_adapters(new_model(tok, weights), lora)
    torch.manual_seed(0)
    ds_model = with_adapters(new_model(tok, weights), lora)
    trainable = {n for n, p in ref_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    ref_actor = TorchActor(ref_model, cfg.model_copy(update={"engine": "torch", "zero_stage": 0}), tok.pad_token_id, 20)
    want = [ref_actor.update(batch, 0.9, s) for s in (21, 22)]
    actor = DeepSpeedActor(ds_model, cfg, tok.pad_token_id, 20)
    try:
        for seed, w in zip((21, 22), want, strict=True):
            assert_close_metrics(actor.update(batch, 0.9, seed), w)
        got = actor.export_model()
        assert_close_state(got, {k: v.detach() for k, v in ref_model.state_dict().items()})
        base = {k.removeprefix("base_model.model.").replace(".base_layer", ""): v for k, v in got.items() if "lora_" not in k}
        assert all(torch.equal(base[k], weights[k]) for k in weights)  # only adapters moved
        assert any(got[k].abs().max() > 0 for k in got if "lora_B" in k)  # B left zero: the policy moved
    finally:
        actor.close()


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_state_round_trip_resumes_exactly(tok, weights, stage):
    """Save after one update, resume in a new actor from the exported weights: the next update matches."""
    batch = make_batch(tok, 7, seed=1)
    cfg = actor_cfg(stage)
    ref_metrics, ref_params = torch_reference(tok, weights, cfg, batch, [3, 4])

    first = DeepSpeedActor(new_model(tok, weights), cfg, tok.pad_token_id, 20)
    first.update(batch, 0.9, 3)
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)  # what PolicyWorker stores next to the model
    exported = first.export_model()
    first.close()

    second = DeepSpeedActor(new_model(tok, exported), cfg, tok.pad_token_id, 20)
    try:
        second.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=False))
        assert second.scheduler.last_epoch == first.scheduler.last_epoch == 4
        assert_close_metrics(second.update(batch, 0.9, 4), ref_metrics[1])
        assert_close_state(second.export_model(), ref_params)
        with pytest.raises(ValueError, match="zero_stage"):
            second.load_state_dict({**second.state_dict(), "zero_stage": (stage + 1) % 4})
    finally:
        second.close()


def test_zero3_export_saves_a_loadable_hf_model(tok, weights, tmp_path):
    from transformers import AutoModelForCausalLM

    batch = make_batch(tok, 4, seed=2)
    cfg = actor_cfg(3, ppo_epochs=1)
    _, ref_params = torch_reference(tok, weights, cfg, batch, [5])
    actor = DeepSpeedActor(new_model(tok, weights), cfg, tok.pad_token_id, 20)
    try:
        actor.update(batch, 0.9, 5)
        actor.engine.module.save_pretrained(tmp_path / "m", state_dict=actor.export_model())
    finally:
        actor.close()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert_close_state(loaded.state_dict(), ref_params)


def test_bad_zero_stage_is_a_clear_error(tok, weights):
    cfg = ActorConfig.model_construct(zero_stage=4)  # bypasses the pydantic range check on purpose
    with pytest.raises(ValueError, match=r"actor\.zero_stage"):
        DeepSpeedActor(new_model(tok, weights), cfg, tok.pad_token_id, 20)
    assert not torch.distributed.is_initialized()  # rejected before any process group starts


DP_WORLD = 2  # the data-parallel cases' ranks


def _dp_case(rank: int, tok, weights: dict, batch: dict, cfg_json: dict, out: str) -> None:
    """One case on one rank of the group: an update of the whole batch, rank 0 saving the result."""
    cfg = ActorConfig.model_validate(cfg_json)
    engine = DeepSpeedActor if cfg.engine == "deepspeed" else DataParallelTorchActor
    actor = engine(new_model(tok, weights), cfg, tok.pad_token_id, 20)
    metrics = actor.update(batch, 0.9, 7)
    state = actor.export_model() if cfg.engine == "deepspeed" else {k: v.detach() for k, v in actor.model.state_dict().items()}
    # ZeRO-3: each rank holds only its half (padded) of every parameter.
    model = actor.engine.module if cfg.engine == "deepspeed" else actor.model
    owned = [p.ds_tensor.numel() for p in model.parameters() if hasattr(p, "ds_tensor")]
    if rank == 0:
        from safetensors.torch import save_file

        save_file({f"w/{k}": v.clone() for k, v in state.items()}, out)  # clone: tied weights share storage
        with open(out + ".json", "w") as f:
            json.dump({"metrics": metrics, "owned": sum(owned)}, f)
    # Both ranks end the case together: a rank that tore gloo down while its peer still wrote aborted (SIGABRT) in CI.
    torch.distributed.barrier()
    actor.close()  # the engine goes, the process group stays for the next case (as in a policy worker)


def _dp_rank(rank: int, port: int, jobs, done) -> None:
    """A rank of the two-process gloo group that serves every data-parallel case of the module in turn."""
    import traceback

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(DP_WORLD))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # two processes on two cores
    deepspeed.utils.logger.setLevel("WARNING")
    tok = build_char_tokenizer()
    while (job := jobs.get()) is not None:
        try:
            _dp_case(rank, tok, *job)
            done.put(None)
        except BaseException:
            done.put(traceback.format_exc())
            raise
    if torch.distributed.is_initialized():
        deepspeed.comm.destroy_process_group()


@pytest.fixture(scope="module")
def dp_group():
    """Two spawned ranks, started once for the module's data-parallel cases (each process imports torch,
    DeepSpeed and transformers: ~6 s a process, which a pair per case paid nine times). Call it with a case;
    it returns when both ranks are done, or fails with a rank's traceback."""
    ctx = torch.multiprocessing.get_context("spawn")
    jobs, done = [ctx.Queue() for _ in range(DP_WORLD)], ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_dp_rank, args=(r, port, jobs[r], done)) for r in range(DP_WORLD)]
    for p in procs:
        p.start()
    broken: list[str] = []

    def run(*case) -> None:
        assert not broken, f"an earlier case left the group broken: {broken[0]}"
        for q in jobs:
            q.put(case)
        errors = []
        for _ in range(DP_WORLD):
            try:
                answer = done.get(timeout=180)
            except queue.Empty:  # a rank hangs (its peer failed inside a collective)
                errors.append(f"no answer from a rank in 180 s; exit codes {[p.exitcode for p in procs]}")
                break
            if answer is not None:
                errors.append(answer)
        if errors:
            broken.append(errors[0])
            pytest.fail(errors[0])

    yield run
    for q in jobs:
        q.put(None)
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    assert broken or [p.exitcode for p in procs] == [0, 0]


@pytest.mark.invariant("data-parallel world 2 == world 1", "every metric and every weight after two epochs within 1e-5 (ZeRO 0-3, torch; budgets, chunked log-probs)")
@pytest.mark.parametrize(
    "engine,stage,budget,mode,live,chunk",
    [
        ("deepspeed", 2, None, "token-mean", None, None), ("deepspeed", 3, None, "token-mean", None, None),
        ("deepspeed", 0, 24, "token-mean", None, None), ("deepspeed", 0, 24, "seq-mean-token-mean", None, None),
        ("torch", 0, None, "token-mean", None, None), ("torch", 0, 24, "seq-mean-token-mean", None, None),
        ("deepspeed", 2, 24, "seq-mean-token-mean", None, None), ("deepspeed", 3, 24, "token-mean", None, None),
        ("deepspeed", 3, 24, "seq-mean-token-mean", (2, 11), None),
        # chunked log-probs on the ranks (engines/training/lm_head.py) against the plain path in one process
        ("torch", 0, None, "token-mean", None, 5), ("deepspeed", 2, 24, "seq-mean-token-mean", None, 5),
        ("deepspeed", 0, None, "seq-mean-token-sum", None, 5),
    ],
)  # fmt: skip
def test_data_parallel_matches_single_process(tok, weights, dp_group, tmp_path, engine, stage, budget, mode, live, chunk):
    """Two gloo ranks, each given the whole batch, equal one TorchActor on it.

    Global mini-batch 8 = 2 ranks x 4, shuffled alike on every rank, 2 epochs. Fixed count (micro-batch 2):
    per rank, micro losses are scaled by 2/4 and DeepSpeed averages over the 2 ranks: 2/8 per micro-batch,
    TorchActor's scale. Token budgets: each rank plans its own micro-batches and weights them against the GLOBAL
    mini-batch's tokens or sequences times 2; every rank runs as many as the rank with the most (ZeRO 2-3's
    backward is a collective), halving some, or with filler passes when, as with ``live`` (the only samples
    with policy tokens), a rank has too few samples that count. AdamW and clipping hide a uniform gradient
    scale in the parameters, so the compared ``actor/grad_norm`` metric pins the scaling down.
    """
    n, mini = 16, 8
    batch = make_batch(tok, n, seed=3)
    if live:
        batch["response_mask"] = [m if i in live else [0] * len(m) for i, m in enumerate(batch["response_mask"])]
    kw = {"micro_batch_tokens": budget} if budget else {}
    cfg = actor_cfg(stage, ppo_mini_batch_size=mini, micro_batch_size=2, ppo_epochs=2, loss_agg_mode=mode, engine=engine, **kw)
    ref_metrics, ref_params = torch_reference(tok, weights, cfg.model_copy(update={"logits_chunk_tokens": None}), batch, [7])
    cfg = cfg.model_copy(update={"logits_chunk_tokens": chunk})  # None: the plain path on the ranks too
    out = str(tmp_path / "rank0.safetensors")
    dp_group(weights, batch, cfg.model_dump(), out)
    from safetensors.torch import load_file

    with open(out + ".json") as f:
        result = json.load(f)
    state = {k.removeprefix("w/"): v for k, v in load_file(out).items()}
    assert_close_metrics(result["metrics"], ref_metrics[0])
    assert_close_state(state, ref_params)
    if stage == 3:
        total = sum(p.numel() for p in new_model(tok, weights).parameters())
        assert 0 < result["owned"] <= total // DP_WORLD + 64


# ---------------------------------------------------------------- token budgets and packing on the engine
@pytest.mark.parametrize("stage", [2, 3])
def test_token_budget_and_packing_match_torch_actor(tok, weights, stage):
    """TorchActor's token-budget micro-batches, exact loss weights and packed rows, through the engine."""
    batch = make_batch(tok, 7, seed=4)
    cfg = actor_cfg(stage, micro_batch_tokens=24, packing=True)
    ref_metrics, ref_params = torch_reference(tok, weights, cfg, batch, [11, 12])
    actor = DeepSpeedActor(new_model(tok, weights), cfg, tok.pad_token_id, 20)
    try:
        for seed, want in zip([11, 12], ref_metrics, strict=True):
            assert_close_metrics(actor.update(batch, 0.9, seed), want)
        assert_close_state(actor.export_model(), ref_params)
    finally:
        actor.close()


# ---------------------------------------------------------------- the policy worker on DeepSpeed
def worker_cfg(tmp_path, engine: str, stage: int) -> dict:
    from rlstage.schemas.config import load_config

    overrides = [
        f"store.root={tmp_path / 'store'}",
        f"actor.engine={engine}",
        f"actor.zero_stage={stage}",
        "actor.ppo_mini_batch_size=4",
        "actor.micro_batch_size=2",
        "actor.ppo_epochs=2",
        "actor.optim.lr=5e-3",
        "actor.optim.grad_clip=0.3",
    ]
    return load_config(None, overrides).model_dump(mode="json")


def worker_weights(worker) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in worker.model.state_dict().items()}


def commit_experience(store, batch: dict, iteration: int):
    """The experience artifact an advantage stage would commit for ``batch`` (the worker reads it itself)."""
    import pyarrow as pa

    from rlstage.schemas import artifacts as A

    n = len(batch["prompt_ids"])
    table = pa.table(
        {
            "sample_id": [f"s{i}" for i in range(n)],
            "group_id": list(range(n)),
            **{c: batch[c] for c in ("prompt_ids", "response_ids", "response_mask", "old_log_probs", "advantages")},
            "score": [0.0] * n,
            "ref_log_probs": batch["ref_log_probs"],
            "values": [None] * n,
            "token_level_rewards": batch["advantages"],
            "returns": batch["advantages"],
            "rollout_log_probs": batch["old_log_probs"],
        }
    )
    return store.commit(
        "w", iteration, "advantage", key=f"k{iteration}", config_hash="c", code_version="t", inputs={},
        tables={"experience.parquet": A.conform(table, A.EXPERIENCE)},
    )  # fmt: skip


@pytest.mark.parametrize("stage", [2, 3])
def test_policy_worker_checkpoint_round_trip(tok, weights, tmp_path, stage):
    """PolicyWorker with actor.engine=deepspeed: update, commit its checkpoint to the store (safetensors + a
    pickle-free trainer state), a second worker acquires it from the store and updates again == torch."""
    from rlstage.engines.models.tinykit import save_model_dir
    from rlstage.schemas.manifest import PolicyRef
    from rlstage.tasks.runtime import policy_ref_from
    from rlstage.workers.policy import PolicyWorker

    start = save_model_dir(new_model(tok, weights), tok, tmp_path / "start")
    batch = make_batch(tok, 8, seed=5)
    runs = {}
    for engine in ("torch", "deepspeed"):
        cfg = worker_cfg(tmp_path / engine, engine, stage)
        first = PolicyWorker(cfg, 20)
        store = first.store
        exps = [commit_experience(store, batch, it) for it in (1, 2)]
        first.acquire(PolicyRef(version="v0", path=str(start)).model_dump(mode="json"))
        m1 = first.update("v0", exps[0].model_dump(mode="json"), 1, True)
        assert first.version() is None  # trained but not committed: no stage may use it yet
        commit = {"run": "w", "iteration": 1, "stage": "update", "key": "u1", "config_hash": "c", "code_version": "t", "inputs": {}}
        manifest = first.commit("policy", commit, {})
        assert not any(f.endswith(".pt") for f in manifest["files"])
        assert {"trainer_state/trainer_state.safetensors", "trainer_state/trainer_state.json"} <= set(manifest["files"])
        after_one = worker_weights(first)  # what rollout and eval use (ZeRO-3: gathered back after the update)
        second = PolicyWorker(cfg, 20)
        ref = policy_ref_from(store.manifest("w", 1, "update"))
        second.acquire(ref.model_dump(mode="json"))
        assert_close_state(worker_weights(second), after_one)
        m2 = second.update(ref.version, exps[1].model_dump(mode="json"), 2, False)
        runs[engine] = (m1, m2, worker_weights(second))
        for w in (first, second):
            if hasattr(w.actor, "close"):
                w.actor.close()
            w.close()
            assert not w.scratch.exists()  # fetched and staged checkpoints are removed with the worker
    (tm1, tm2, tw), (dm1, dm2, dw) = runs["torch"], runs["deepspeed"]
    assert_close_metrics(dm1, tm1)
    assert_close_metrics(dm2, tm2)  # the optimizer and schedule state came back from the checkpoint
    assert_close_state(dw, tw)
    assert tm1["actor/grad_norm"] > 0.3  # clipped: the gradient scale is pinned by the compared norm


def test_torch_engine_refuses_a_deepspeed_optimizer_state(tok, weights):
    actor = TorchActor(new_model(tok, weights), actor_cfg(0), tok.pad_token_id, 20)
    with pytest.raises(ValueError, match="saved by the deepspeed engine"):
        actor.load_state_dict({"optimizer": {}, "scheduler": {}, "zero_stage": 2, "world_size": 1})


def test_pipeline_runs_on_deepspeed_zero2_like_torch(prefect_api, tmp_path):
    """Two iterations through Prefect + Ray with actor.engine=deepspeed ZeRO-2 equal the torch engine's."""
    from rlstage.flows.training import train
    from rlstage.schemas.config import load_config
    from rlstage.tasks.runtime import store_for
    from tests_support import tiny_overrides

    results = {}
    for engine in ("torch", "deepspeed"):
        cfg = load_config(
            None,
            [
                f"store.root={tmp_path / engine}",
                f"run_name=ds-{engine}",
                *tiny_overrides(),
                f"actor.engine={engine}",
                "actor.zero_stage=2",
                # The 20-step SFT policy scores 0 on every sample (GRPO advantages all 0): the entropy bonus
                # gives every update a gradient, so the comparison is not vacuous.
                "actor.entropy_coeff=0.01",
                "actor.optim.lr=1e-3",
            ],
        )
        results[engine] = (cfg, train(config=cfg))
    hist = {e: {h["iteration"]: h for h in r["history"]} for e, (_, r) in results.items()}
    for it in (1, 2):
        want, got = hist["torch"][it], hist["deepspeed"][it]
        assert got["actor/grad_norm"] > 0
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/ppo_kl", "critic/score/mean"):
            assert key in got and torch.isfinite(torch.tensor(got[key])), key
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), (it, key)
    # The DeepSpeed run's policy changed, and its stored checkpoints equal the torch run's.
    stores = {e: store_for(cfg) for e, (cfg, _) in results.items()}
    states = {}
    for e, store in stores.items():
        from safetensors.torch import load as load_safetensors

        states[e] = [
            load_safetensors(store.read_bytes(store.manifest(f"ds-{e}", it, "update"), "model/model.safetensors"))
            for it in (1, 2)
        ]
    assert any((states["deepspeed"][1][k] - states["deepspeed"][0][k]).abs().max() > 0 for k in states["deepspeed"][0])
    for it in (0, 1):
        for k, v in states["torch"][it].items():
            assert (states["deepspeed"][it][k] - v).abs().max().item() < 1e-4, (it, k)
