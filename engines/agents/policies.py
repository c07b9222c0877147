"""What generates an assistant turn for the agent loop (engines/agents/loop.py): the ``AgentPolicy`` contract and
its engines.

``BatchingPolicy`` gathers concurrent requests into batched ``generate_ids`` calls of a rollout engine on one worker
thread (``HFRolloutEngine``, or ``VLLMRolloutEngine``'s offline ``LLM``). An engine with its own async interface
(vLLM's ``AsyncLLM``: ``AsyncVLLMPolicy``) needs only an ``async generate(prompt_ids, params, key) -> Generation``
per request, since it batches itself.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from rlstage.engines.rollout.base import RolloutEngine, SamplingParams


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]
    log_probs: list[float]  # sampling log-probs, one per token
    finish_reason: str  # "stop" (eos sampled) or "length"


class AgentPolicy(ABC):
    """What the loop needs from an engine: continue ``prompt_ids`` by one assistant turn.

    ``params.max_new_tokens`` is this turn's cap; ``key`` orders requests (batching engines use it
    to keep batch composition deterministic). ``open_request()`` / ``close_request()`` tell a batching
    engine how many requests are live (by default nothing listens).
    """

    @abstractmethod
    async def generate(self, prompt_ids: list[int], params: SamplingParams, key: int = 0) -> Generation: ...

    def open_request(self) -> None:  # noqa: B027  (a hook: only a batching policy counts the live requests)
        """A request starts: it will ask for turns until ``close_request``."""

    def close_request(self) -> None:  # noqa: B027
        """A request is done: it asks for no more turns."""


# ---------------------------------------------------------------- the HF policy


class BatchingPolicy(AgentPolicy):
    """Concurrent requests -> batched ``engine.generate_ids`` calls of a ``RolloutEngine`` on one worker thread.

    A batch starts when every live request is waiting on the model, the batch is full, or no
    request has arrived for ``window_s`` (so a request in a slow tool call delays the others by
    one quiet window). Requests in a batch are ordered by key and each
    batch has its own seed, so with tools that answer within the window the batches — and the
    samples — are the same on every run.
    """

    def __init__(self, engine: RolloutEngine, max_batch: int = 512, window_s: float = 0.05) -> None:
        self.engine, self.max_batch, self.window_s = engine, max_batch, window_s
        self._queue: list[tuple[int, list[int], SamplingParams, asyncio.Future]] = []
        self._active = 0
        self._wake: asyncio.Event | None = None
        self._server: asyncio.Task | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="rlstage-agent-gen")
        self.model_s = 0.0  # wall time of generate calls
        self.batch_sizes: list[int] = []

    def open_request(self) -> None:
        self._active += 1

    def close_request(self) -> None:
        self._active -= 1
        self._poke()

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def generate(self, prompt_ids: list[int], params: SamplingParams, key: int = 0) -> Generation:
        if self._server is None:
            self._wake = asyncio.Event()
            self._server = asyncio.create_task(self._serve())
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._queue.append((key, prompt_ids, params, fut))
        self._poke()
        return await fut

    async def _serve(self) -> None:
        try:
            await self._serve_forever()
        except BaseException as err:  # never leave a request waiting on a server that is gone
            for *_, fut in self._queue:
                if not fut.done():
                    fut.set_exception(err if isinstance(err, Exception) else RuntimeError("generation server stopped"))
            raise

    async def _serve_forever(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wake is not None
        while True:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            # The window restarts at each arrival: requests that trickle in (HTTP agents answer one by one) join one
            # batch, while a request in a slow tool call holds the others back by one quiet window at most.
            last, waiting = loop.time(), len(self._queue)
            while len(self._queue) < min(max(self._active, 1), self.max_batch):
                if len(self._queue) > waiting:
                    last, waiting = loop.time(), len(self._queue)
                left = self.window_s - (loop.time() - last)
                if left <= 0:
                    break
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), left)
                except TimeoutError:
                    break
            self._queue.sort(key=lambda item: item[0])
            batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch :]
            groups: dict[tuple, list] = {}
            for item in batch:
                p = item[2]
                groups.setdefault((p.temperature, p.top_p, p.top_k, p.seed), []).append(item)
            for items in groups.values():
                await self._run_batch(items)

    async def _run_batch(self, items: list) -> None:
        base = items[0][2]
        params = replace(base, n=1, max_new_tokens=max(it[2].max_new_tokens for it in items))
        params = replace(params, seed=base.seed * 1009 + len(self.batch_sizes))  # a fresh stream per batch
        self.batch_sizes.append(len(items))
        t0 = time.perf_counter()
        try:
            comps = await asyncio.get_running_loop().run_in_executor(
                self._thread, self.engine.generate_ids, [it[1] for it in items], params
            )
        except Exception as err:  # the engine failed: every request in the batch fails with it
            for it in items:
                if not it[3].done():
                    it[3].set_exception(err)
            return
        finally:
            self.model_s += time.perf_counter() - t0
        for it, c in zip(items, comps, strict=True):
            limit = it[2].max_new_tokens
            ids, lps, finish = c.response_ids, c.log_probs, c.finish_reason
            if len(ids) > limit:  # the batch ran to the longest cap; this request asked for fewer
                ids, lps, finish = ids[:limit], lps[:limit], "length"
            if not it[3].done():
                it[3].set_result(Generation(list(ids), list(lps), finish))

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.cancel()
            try:
                await self._server
            except asyncio.CancelledError:
                pass
            self._server = None
        self._thread.shutdown(wait=True)


# ---------------------------------------------------------------- vLLM's async interface


class AsyncVLLMPolicy(AgentPolicy):
    """One vLLM request per assistant turn on an ``AsyncLLM``: vLLM batches continuously, so no window.

    Sampling mirrors ``VLLMRolloutEngine``: sampled token log-probs (``processed_logprobs``, the
    engine's ``logprobs_mode``), eos as the stop token, one seed per request derived from
    ``params.seed`` and the request key.
    """

    def __init__(self, llm: Any, eos_token_id: int) -> None:
        self.llm, self.eos_token_id = llm, eos_token_id
        self._ids = itertools.count()
        self.model_s = 0.0  # summed over requests: they overlap, so this is not wall time

    def _sampling(self, params: SamplingParams, key: int) -> Any:
        from vllm import SamplingParams as VSamplingParams

        greedy = params.temperature == 0
        return VSamplingParams(
            n=1,
            temperature=params.temperature,
            top_p=1.0 if greedy else params.top_p,
            top_k=0 if greedy else params.top_k,
            max_tokens=params.max_new_tokens,
            stop_token_ids=[self.eos_token_id],
            logprobs=0,
            seed=params.seed * 1_000_003 + key,
            detokenize=False,
        )

    async def generate(self, prompt_ids: list[int], params: SamplingParams, key: int = 0) -> Generation:
        from vllm.inputs import TokensPrompt

        t0 = time.perf_counter()
        final = None
        request_id = f"rlstage-agent-{key}-{next(self._ids)}"
        async for out in self.llm.generate(TokensPrompt(prompt_token_ids=list(prompt_ids)), self._sampling(params, key), request_id):
            final = out
        self.model_s += time.perf_counter() - t0
        if final is None or not final.outputs:
            raise RuntimeError(f"vLLM returned no output for request {request_id}")
        seq = final.outputs[0]
        ids = list(seq.token_ids)
        lps = [step[t].logprob for step, t in zip(seq.logprobs, ids, strict=True)]
        return Generation(ids, lps, "stop" if seq.finish_reason == "stop" else "length")


def start_async_vllm(model_path: str, *, dtype: str = "float32", seed: int = 0, kv_cache_bytes: int = 256 << 20, max_num_seqs: int = 256) -> Any:
    """An ``AsyncLLM`` over a Hugging Face model directory, with ``VLLMRolloutEngine``'s engine settings."""
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(
        model=model_path,
        skip_tokenizer_init=True,  # prompts arrive as token ids; text is decoded by our tokenizer
        generation_config="vllm",
        dtype=dtype,
        seed=seed,
        enforce_eager=True,
        kv_cache_memory_bytes=kv_cache_bytes,
        max_num_seqs=max_num_seqs,
        logprobs_mode="processed_logprobs",
    )
    return AsyncLLM.from_engine_args(args)
