"""`make demo`'s script runs its whole story and exits 0 (real agent, real mosquitto)."""

import os
import subprocess
from pathlib import Path

import pytest

from tests.integration.mqtt_broker import mosquitto_binary

ROOT = Path(__file__).parents[2]
STEPS = [
    "a lab PKI in",
    "a mosquitto broker on 127.0.0.1:",
    "dpu-agent with mTLS on a free loopback port",
    "connect as tenant demo over mTLS",
    "open a data-plane session",
    "a volume with CRC32C + zstd compression + AES-XTS-256 encryption",
    "write a 16 MiB host file to it, read it back into another",
    "a compute job: zstd-compress 1 MiB of the file on the DPU",
    "the completion events: on MQTT and on the gRPC stream",
    "the metrics that counted them",
    "a second tenant (other) is refused",
    "dpuctl --target 127.0.0.1:",
    "grpcurl (mTLS) 127.0.0.1:",
    "a plaintext call to the mTLS agent",
    "SIGTERM: the agent drains and exits",
]


@pytest.mark.skipif(mosquitto_binary() is None, reason="needs mosquitto (deploy/apt-packages.txt)")
def test_the_demo_tells_the_whole_story(tmp_path):
    run = subprocess.run(
        [str(ROOT / "scripts" / "demo.sh")],
        env={**os.environ, "DPU_DEMO_DIR": str(tmp_path / "demo")},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    titles = [line[3:] for line in run.stdout.splitlines() if line.startswith("== ")]
    assert len(titles) == len(STEPS), titles
    for title, expected in zip(titles, STEPS, strict=True):
        assert title.startswith(expected), (title, expected)
    out = run.stdout
    assert "is byte for byte" in out
    assert "the library gets the input back" in out
    assert "34 jobs: 34 on MQTT, 34 on gRPC" in out
    assert "as other: get_volume('volumes/demo-vol') -> NOT_FOUND" in out
    assert "serves mTLS and this client spoke plaintext" in out
    assert "TLS handshake failed: a client connected without TLS" in out
    assert out.rstrip().splitlines()[-1].startswith("demo: every step passed in ")
    assert (tmp_path / "demo" / "output.bin").read_bytes() == (
        tmp_path / "demo" / "input.bin"
    ).read_bytes()
