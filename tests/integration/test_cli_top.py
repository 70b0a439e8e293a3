"""`dpuctl top` against a real agent under load: --once --json, and the live screen in tmux."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

import host_client

ROOT = Path(__file__).parents[2]
DPUCTL = [sys.executable, "-m", "host_client.cli"]


@pytest.fixture
def load(agent):
    """crc32c and copy jobs in a loop on one session, until the test ends."""
    stop = threading.Event()
    ready = threading.Event()
    errors: list[BaseException] = []

    def work() -> None:
        try:
            with (
                host_client.SyncClient(agent.address) as client,
                client.open_session(transport="tcp", label="load") as session,
            ):
                src = session.alloc(64 << 10, readable=True)
                dst = session.alloc(64 << 10, writable=True)
                while not stop.is_set():
                    session.crc32c(src)
                    session.copy(src, dst)
                    ready.set()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
            ready.set()

    thread = threading.Thread(target=work)
    thread.start()
    assert ready.wait(30)
    yield
    stop.set()
    thread.join(30)
    assert errors == []


def test_once_json_shows_the_load(agent, load):  # noqa: ARG001 - load runs meanwhile
    run = subprocess.run(
        [*DPUCTL, "--target", agent.address, "top", "--metrics", agent.metrics_url(), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    view = json.loads(run.stdout)
    assert view["sessions_open"] == 1
    assert view["job_slots"] >= 1
    assert view["kinds"]["crc32c"]["jobs_per_s"] > 0
    assert view["kinds"]["copy"]["jobs_per_s"] > 0
    assert view["kinds"]["copy"]["p50"] is not None
    assert view["bytes_read_per_s"] > 0
    assert view["kinds"]["copy"]["bytes_per_s"] > 0
    assert view["kinds"]["crc32c"]["bytes_per_s"] > 0
    assert view["failed_jobs_per_s"] == 0
    assert view["mqtt_connected"] is None  # no broker configured


def test_a_bad_metrics_url_is_one_line(agent):
    run = subprocess.run(
        [*DPUCTL, "--target", agent.address, "top", "--once", "--metrics", "http://127.0.0.1:1/"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 1
    assert run.stderr.count("\n") == 1
    assert "cannot read the agent's metrics at http://127.0.0.1:1/" in run.stderr


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (deploy/apt-packages.txt)")
def test_the_live_view_in_a_real_terminal(agent, load):  # noqa: ARG001 - load runs meanwhile
    session = f"dpuctl-top-{uuid.uuid4().hex[:8]}"
    command = " ".join(
        [
            *DPUCTL,
            "--target",
            agent.address,
            "top",
            "--metrics",
            agent.metrics_url(),
            "--interval",
            "0.5",
        ]
    )
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", str(ROOT))}
    tmux = ["tmux", "-L", session]
    subprocess.run(
        [*tmux, "new-session", "-d", "-s", session, "-x", "100", "-y", "30", command],
        check=True,
        env=env,
        cwd=ROOT,
    )
    try:
        screens = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            time.sleep(0.5)
            shown = subprocess.run(
                [*tmux, "capture-pane", "-p", "-t", session],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            screens.append(shown)
            rows = {line.split()[0]: line.split() for line in shown.splitlines() if line.strip()}
            clocks = {s.splitlines()[0] for s in screens if s.strip()}
            if "crc32c" in rows and "copy" in rows and len(clocks) >= 2:
                break
        shown = screens[-1]
        assert shown.startswith("dpuctl top  http://127.0.0.1:"), shown
        assert "sessions 1 " in shown
        assert "KIND" in shown
        rows = {line.split()[0]: line.split() for line in shown.splitlines() if line.strip()}
        assert float(rows["crc32c"][1]) > 0, shown
        assert float(rows["copy"][1]) > 0, shown
        assert float(rows["copy"][2]) > 0, shown  # MiB/s of the copies
        assert rows["copy"][3].startswith("<="), shown
        # it redraws: the clock in the first line moves on
        assert len({s.splitlines()[0] for s in screens if s.strip()}) > 1
    finally:
        subprocess.run([*tmux, "kill-server"], check=False)
