"""A run's live progress across processes: a Ray actor that long work (SFT steps) posts to and the
command's terminal reads. Best effort: with no board (no terminal to show it), posting does nothing."""

from __future__ import annotations

import time

import ray

from rlstage.infra.ray_runtime import RAY_NAMESPACE

BOARD = "rlstage-progress"
POST_EVERY_S = 0.5  # a Ray call per SFT step would cost more than the display is worth


@ray.remote(num_cpus=0)
class ProgressBoard:
    def __init__(self) -> None:
        self.notes: dict[str, str] = {}

    def post(self, key: str, text: str) -> None:
        self.notes[key] = text

    def take(self, key: str) -> str | None:
        return self.notes.pop(key, None)


def open_board():
    """The board, held by the command that shows it (it lives as long as that handle)."""
    return ProgressBoard.options(name=BOARD, namespace=RAY_NAMESPACE, get_if_exists=True).remote()


class Poster:
    """Posts ``key``'s progress to the board, at most every ``POST_EVERY_S``."""

    def __init__(self, key: str) -> None:
        self.key, self.last = key, 0.0
        self.board = None
        if ray.is_initialized():
            try:
                self.board = ray.get_actor(BOARD, namespace=RAY_NAMESPACE)
            except ValueError:  # nobody shows progress
                pass

    def __call__(self, text: str) -> None:
        now = time.monotonic()
        if self.board is not None and now - self.last >= POST_EVERY_S:
            self.last = now
            self.board.post.remote(self.key, text)
