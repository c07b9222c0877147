"""A verifiers taskset's side of ``data.source: verifiers``: a program run by the environment's own interpreter.

verifiers (PyPI ``verifiers``) pins versions that cannot share rlstage's environment (``mcp``, ``openai``), so it
runs in one of its own, behind a process boundary; this file imports nothing of rlstage and is run as
``<python> -P verifiers_sidecar.py tasks|serve '<json spec>'`` (``-P``: this folder is not put on ``sys.path``).

- ``tasks``: the taskset's first ``count`` tasks, one JSON line each: ``key``, ``prompt`` (text or messages),
  ``system_prompt``, and ``data`` (the task's data as verifiers serializes it).
- ``serve``: prints ``ready``, then plays one episode per JSON line read from stdin (``n``, ``data``,
  ``base_url``, ``headers``, ``model``) with the taskset's harness, its model calls sent to ``base_url`` with
  ``headers``; answers ``{"n", "reward", "error"}`` per episode, in any order. Ends when stdin closes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys

_out = sys.stdout  # the protocol's channel (main() keeps it for the protocol alone)


def _config(spec: dict, agent: bool):
    import verifiers.v1 as vf

    config = {"taskset": {"id": spec["taskset"], **spec.get("taskset_args", {})}}
    if agent:  # verifiers' local chat program, no sandbox or tunnel: the model endpoint is on this machine's loopback
        config["agent"] = {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}
    return vf.SingleAgentEnvConfig.model_validate(config)


def _tasks(spec: dict) -> None:
    from verifiers.v1.utils.loaders import load_taskset

    for i, task in enumerate(load_taskset(_config(spec, agent=False).taskset)):
        if i >= spec["count"]:
            break
        data = task.data
        out = {
            "key": task.key,
            "prompt": data.prompt,
            "system_prompt": data.system_prompt,
            "data": data.model_dump(mode="json"),
        }
        _out.write(json.dumps(out) + "\n")
    _out.flush()


async def _serve(spec: dict) -> None:
    import verifiers.v1 as vf
    from verifiers.v1.clients import ModelContext
    from verifiers.v1.configs.client import EvalClientConfig

    env = vf.SingleAgentEnv(_config(spec, agent=True))
    task_type = type(env.taskset).task_type()
    data_type = task_type.data_type()
    task_config = env.taskset.config.task
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    def reply(message: dict) -> None:
        _out.write(json.dumps(message) + "\n")
        _out.flush()

    async def episode(request: dict) -> None:
        try:
            task = task_type(data_type.model_validate(request["data"]), task_config)
            client = EvalClientConfig(
                base_url=request["base_url"],
                api_key_var="RLSTAGE_VERIFIERS_API_KEY",
                headers=request["headers"],
            )
            result = await env.run_episode(task, ModelContext(model=request["model"], client=client))
            errors = [f"{e.type}: {e.message}" for e in result.errors] + [
                f"{e.type}: {e.message}" for t in result.traces for e in t.errors
            ]
            if not result.ok or not result.traces:
                reply(
                    {
                        "n": request["n"],
                        "reward": None,
                        "error": "; ".join(errors) or "the episode did not end ok",
                    }
                )
            else:
                reply({"n": request["n"], "reward": sum(t.reward for t in result.traces), "error": None})
        except Exception as err:  # the episode's failure is that sample's, never the server's
            reply({"n": request.get("n"), "reward": None, "error": f"{type(err).__name__}: {err}"})

    running: set[asyncio.Task] = set()
    async with env.serving():
        reply({"ready": True})
        while line := await reader.readline():
            job = asyncio.create_task(episode(json.loads(line)))
            running.add(job)
            job.add_done_callback(running.discard)
        for job in list(running):
            job.cancel()


def main() -> None:
    command, spec = sys.argv[1], json.loads(sys.argv[2])
    # stdout carries the protocol alone: what a taskset or verifiers prints goes to stderr, the stage's log.
    global _out
    _out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    # The harness's chat program is set up with uv: the one installed beside this interpreter, if any.
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    os.environ.setdefault("RLSTAGE_VERIFIERS_API_KEY", "rlstage")
    if command == "tasks":
        _tasks(spec)
    elif command == "serve":
        asyncio.run(_serve(spec))
    else:
        raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main()
