"""infra/prefect_server.py's client-side settings, without a server."""

from __future__ import annotations

import prefect.client.base as base
import pytest


@pytest.fixture
def restore_backoff():
    """Prefect's own backoff during the test (a run earlier in this process may have made it quick), then as was."""
    before = base.clamped_poisson_interval
    base.clamped_poisson_interval = getattr(before, "__wrapped__", before)
    yield
    base.clamped_poisson_interval = before


def test_a_local_servers_503_is_retried_at_once_and_a_restart_still_waited_for(restore_backoff, monkeypatch) -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from rlstage.infra.prefect_server import quick_retries_on_a_local_server

    with temporary_settings(updates={PREFECT_API_URL: "https://prefect.example.com/api"}):
        monkeypatch.delenv("PREFECT_API_URL", raising=False)
        quick_retries_on_a_local_server()
        assert not getattr(base.clamped_poisson_interval, "_rlstage_local", False)  # another server: Prefect's waits
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:4200/api"}):
        quick_retries_on_a_local_server()
        quick_retries_on_a_local_server()  # once: not scaled twice
    waits = [base.clamped_poisson_interval(2.0**n, 0.01) for n in range(1, 6)]  # Prefect's 2**n s, retries 1..5
    assert waits == pytest.approx([0.125, 0.5, 2.0, 8.0, 32.0], rel=0.05)  # with Prefect's jitter of 1 %
    assert sum(waits) > 40  # a server the command restarts (~10 s) is still waited for


def test_a_server_killed_during_its_own_start_is_started_again_then_given_up_in_one_line() -> None:
    """``wait_up``: a server process that dies before it answers (SIGKILLed during its start) is spawned again on its
    port, twice at most; one that keeps dying is ServerFailedToStart, which the CLI prints as one line (exit 3)."""
    import signal
    import subprocess
    import sys

    from rlstage.infra.env import free_port
    from rlstage.infra.prefect_server import ServerFailedToStart, stop_process_group, wait_up

    port = free_port()
    spawned: list[subprocess.Popen] = []

    def spawn(p: int, die: int) -> subprocess.Popen:
        if len(spawned) < die:  # killed during its start
            proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
            proc.send_signal(signal.SIGKILL)
        else:
            proc = subprocess.Popen([sys.executable, "-m", "http.server", str(p), "--bind", "127.0.0.1"], start_new_session=True, stderr=subprocess.DEVNULL)
        spawned.append(proc)
        return proc

    proc, got = wait_up(lambda p: spawn(p, 2), port, lambda p: f"http://127.0.0.1:{p}/", 60)
    try:
        assert got == port and len(spawned) == 3 and proc is spawned[-1] and proc.poll() is None
    finally:
        stop_process_group(proc)
    spawned.clear()
    with pytest.raises(ServerFailedToStart, match=r"exited with code -9 during its start, three times$"):
        wait_up(lambda p: spawn(p, 99), free_port(), lambda p: f"http://127.0.0.1:{p}/", 60)
    assert len(spawned) == 3


def test_the_cli_says_a_server_or_a_ray_that_would_not_start_in_one_line(capsys, monkeypatch) -> None:
    from rlstage.flows import cli
    from rlstage.infra.prefect_server import ServerFailedToStart
    from rlstage.infra.ray_runtime import RayFailedToStart

    for err in (
        ServerFailedToStart("server for http://127.0.0.1:1/api/health exited with code -9 during its start, three times"),
        RayFailedToStart("the local Ray this command starts died during its start, 3 times (its raylet exited)"),
    ):

        def failing(args, err=err):
            raise err

        monkeypatch.setattr(cli, "cmd_train", failing)
        assert cli.main(["train"]) == 3
        assert capsys.readouterr().err.strip().splitlines() == [f"rlstage: {err}; nothing of the run started, rerun the command"]
