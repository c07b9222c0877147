"""What a command says when its Prefect server is lost or its Ray keeps dying in its start, without starting either."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rlstage.flows.cli import PrefectLost, _lost_if_down
from rlstage.infra.env import free_port


class _Health(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_a_failure_while_the_server_is_gone_is_said_as_that():
    url = f"http://127.0.0.1:{free_port()}/api"  # nothing listens there
    with pytest.raises(PrefectLost) as err, _lost_if_down(url):
        raise ConnectionError("[Errno 111] Connection refused")
    assert str(err.value) == f"the Prefect server {url} stopped answering during the run"
    assert isinstance(err.value.__cause__, ConnectionError)


def test_a_failure_while_the_server_answers_is_the_failure_itself():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with (
            pytest.raises(ValueError, match="a bug"),
            _lost_if_down(f"http://127.0.0.1:{server.server_port}/api"),
        ):
            raise ValueError("a bug")
    finally:
        server.shutdown()


def test_a_local_ray_that_keeps_dying_in_its_start_is_tried_three_times_then_one_line(monkeypatch, capsys):
    """``ray.init`` raising as it does when its raylet is killed during the start (after ~30 s): the start is tried
    again, three times in all, each said, then RayFailedToStart (the CLI's one line, exit 3: test_prefect_server)."""
    import ray

    from rlstage.infra import ray_runtime
    from rlstage.schemas.config import load_config

    timed_out = "The current node timed out during startup. This could happen because some of the raylet failed to startup"
    calls = []

    def init(**kwargs):
        calls.append(kwargs["address"])
        raise Exception(timed_out)  # what Ray raises (a plain Exception)

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    with pytest.raises(ray_runtime.RayFailedToStart) as err:
        ray_runtime.ensure_ray(load_config(None, []))
    assert str(err.value) == f"the local Ray this command starts died during its start, 3 times ({timed_out})"
    assert calls == ["local"] * 3
    assert capsys.readouterr().err.splitlines() == [
        f"rlstage: the local Ray this command starts died during its start ({timed_out}); starting it again (try {n} of 3)"
        for n in (2, 3)
    ]

