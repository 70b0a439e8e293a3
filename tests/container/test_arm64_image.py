"""The arm64 image (BlueField's Arm cores), its agent started once under qemu-user.

Built by `make test-container` with `deploy/container/build.sh --arch arm64`; the same
Containerfile, an arm64 base from mmdebstrap and the arm64 wheels.
"""

from __future__ import annotations

import pytest

import host_client


@pytest.mark.asyncio
async def test_the_arm64_agent_serves_and_runs_jobs(arm64_container):
    tls = arm64_container.pki.client("acme")
    async with host_client.Client(arm64_container.address, tls=tls, timeout=60) as client:
        info = await client.agent_info()
        assert info.machine == "aarch64"
        async with await client.open_session(transport="tcp") as session:
            src = await session.alloc(4096, readable=True)
            src.view[:] = bytes(range(256)) * 16
            completion = await (await session.submit_crc32c(src))
            assert completion.ok
    assert arm64_container.stop_and_wait() == 0, arm64_container.logs()
