"""A store that fills up mid-run: the command stops with one line naming the store, no stage is half
visible, and once there is room again the run continues to an uninterrupted run's artifacts."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlstage.schemas.config import load_config
from tests_support import (
    REPO,
    checksums,
    iteration_stages,
    moving_overrides,
    tiny_overrides,
    update_weights,
    weights_moved,
)

STAGES = iteration_stages()


@pytest.fixture
def small_disk(tmp_path):
    """A real tmpfs, resized as the test goes (needs the right to mount, as root in this sandbox and CI)."""
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _resize(mnt: Path, size: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", "tmpfs", str(mnt)], check=True)


def _used(mnt: Path) -> int:
    st = os.statvfs(mnt)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def test_a_full_store_stops_with_one_line_and_the_rerun_continues(prefect_api, tmp_path, small_disk):
    from rlstage.flows.training import train
    from rlstage.tasks.runtime import store_for

    common = [*tiny_overrides(), *moving_overrides(), "run_name=full", f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    reference = load_config(None, [*common, f"store.root={tmp_path / 'ref'}"])
    train(config=reference)

    root = small_disk / "store"
    args = [*common, f"store.root={root}"]
    train(config=load_config(None, [*args, "trainer.iterations=1"]))
    # Room for a few small files of iteration 2, not for its checkpoint.
    _resize(small_disk, _used(small_disk) + 64 * 1024)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cli = [sys.executable, "-m", "rlstage.flows.cli", "train", *args]
    full = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=600)
    lines = full.stderr.strip().splitlines()
    assert full.returncode == 2, full.stderr[-3000:]
    assert "No space left on device" in lines[-1] and str(root) in lines[-1], lines[-1]
    assert "Traceback" not in full.stderr

    store = store_for(load_config(None, args))
    committed = [s for s in STAGES if store.manifest("full", 2, s) is not None]
    assert committed != list(STAGES)  # the disk filled before iteration 2 was complete
    for stage in committed:  # whatever is visible is whole: every file there, every checksum right
        m = store.manifest("full", 2, stage)
        assert all(store.read_bytes(m, name) is not None for name in m.files)

    _resize(small_disk, 64 << 20)
    # The same run continued (in this process: the command's own start-up was exercised above)
    train(config=load_config(None, args))
    assert checksums(store, "full", 2) == checksums(store_for(reference), "full", 2)
    assert weights_moved(update_weights(store, "full", 1), update_weights(store, "full", 2))
