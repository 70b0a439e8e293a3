"""The blocking SDK against real agent processes: calls, sessions, jobs, volumes, events."""

import os
import subprocess
import sys
import threading
from pathlib import Path

import crc32c
import pytest
import zstandard

import host_client
from dpu_wire.v1 import agent_pb2, network_pb2, virtualization_pb2
from tests.integration.conftest import start_agent
from tests.integration.mqtt_broker import mosquitto_broker  # noqa: F401 - fixture

MiB = 1 << 20


def test_sync_client(agent):
    with host_client.SyncClient(agent.address) as client:
        client.wait_ready(5)
        assert client.health() == "SERVING"
        info = client.agent_info()
    assert isinstance(info, agent_pb2.AgentInfo)
    assert info.name.startswith("agents/")
    with pytest.raises(RuntimeError, match="not open"):
        client.agent_info()


def test_sync_client_maps_errors():
    with (
        host_client.SyncClient("127.0.0.1:1", timeout=5) as client,
        pytest.raises(host_client.UnavailableError),
    ):
        client.agent_info()


def test_session_jobs_and_a_volume_round_trip(agent):
    data = os.urandom(MiB // 2) + b"a compressible tail " * (MiB // 20)
    data = data[:MiB]
    with host_client.SyncClient(agent.address) as client:
        volume = client.create_volume(
            "sync-vol", 4 * MiB, crc32c=True, compression="zstd", encryption="aes-xts-256"
        )
        assert volume.name == "volumes/sync-vol"
        assert "volumes/sync-vol" in [v.name for v in client.list_volumes()]
        with client.open_session(transport="tcp", label="sync") as session:
            assert session.name.startswith("sessions/")
            assert [s.name for s in client.list_sessions()] == [session.name]
            src = session.alloc(MiB, readable=True)
            dst = session.alloc(MiB, writable=True)
            src.view[:] = data
            assert session.crc32c(src) == crc32c.crc32c(data)
            # a job object: submitted now, waited for later
            job = session.submit_compute("compress", src, dst, parameter="zstd")
            done = job.wait()
            assert done.ok
            assert job.done()
            assert zstandard.decompress(bytes(dst.view[: done.bytes_written])) == data
            assert [
                j.ok
                for j in (
                    j.wait()
                    for j in session.submit_many(
                        [session.crc32c_request(src), session.copy_request(src, dst)]
                    )
                )
            ] == [True, True]
            # the volume through the data plane, read back byte for byte
            session.write_volume("volumes/sync-vol", 0, src)
            dst.view[:] = bytes(MiB)
            session.read_volume("volumes/sync-vol", 0, dst)
            assert dst.view == data
        assert client.list_sessions() == []
        stats = client.get_volume("volumes/sync-vol").stats
        assert stats.write_ops >= 1
        assert stats.read_ops >= 1
        client.delete_volume("volumes/sync-vol")
        with pytest.raises(host_client.NotFoundError):
            client.get_volume("volumes/sync-vol")


def test_rules_and_functions(tmp_path):
    env = {
        "DPU_AGENT_NETWORK_BACKEND": "memory",
        "DPU_AGENT_VIRT_BACKEND": "memory",
        "DPU_AGENT_STORAGE_BACKEND": "memory",
    }
    agent = start_agent(tmp_path, env=env)
    try:
        with host_client.SyncClient(agent.address) as client:
            vf = virtualization_pb2.Function(type=virtualization_pb2.FUNCTION_TYPE_VF)
            a = client.create_function("sync-a", vf)
            b = client.create_function("sync-b", vf)
            assert {"functions/sync-a", "functions/sync-b"} <= {
                f.name for f in client.list_functions()
            }
            rule = network_pb2.FlowRule(
                priority=10,
                ingress_port=a.representor_port,
                actions=[
                    network_pb2.FlowAction(
                        forward=network_pb2.ForwardAction(port=b.representor_port)
                    )
                ],
            )
            made = client.create_flow_rule("sync-rule", rule)
            assert made.name == "flowRules/sync-rule"
            assert client.get_flow_rule("flowRules/sync-rule").ingress_port == a.representor_port
            assert [r.name for r in client.list_flow_rules()] == ["flowRules/sync-rule"]
            assert a.representor_port in {p.name for p in client.list_ports()}
            with pytest.raises(host_client.FailedPreconditionError, match="sync-rule"):
                client.delete_function("functions/sync-a")
            client.delete_flow_rule("flowRules/sync-rule")
            client.delete_function("functions/sync-a")
            with pytest.raises(host_client.NotFoundError):
                client.get_function("functions/sync-a")
    finally:
        assert agent.terminate() == 0


def test_completions_on_the_grpc_stream(agent):
    with host_client.SyncClient(agent.address) as client:
        with client.open_session(transport="tcp") as session:
            src = session.alloc(4096, readable=True)
            jobs = [session.submit_rpc("crc32c", src) for _ in range(3)]
            ids = {job.job_id for job in jobs}
            for job in jobs:
                assert job.wait().ok
            seen = set()
            for completion in client.watch_completions(session.name, include_retained=True):
                seen.add(completion.job_id)
                if seen >= ids:
                    break
        assert seen >= ids
        with pytest.raises(host_client.InvalidArgumentError, match="origin"):
            next(iter(client.watch_completions("sessions/x", origin="bogus")))


def test_threads_share_one_client(agent):
    errors: list[BaseException] = []
    with host_client.SyncClient(agent.address) as client:

        def work() -> None:
            try:
                for _ in range(5):
                    assert client.health() == "SERVING"
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=work) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert errors == []


def test_completion_events_on_mqtt(mosquitto_broker, tmp_path):  # noqa: F811
    agent = start_agent(
        tmp_path,
        env={
            "DPU_AGENT_MQTT_ENABLED": "true",
            "DPU_AGENT_MQTT_PORT": str(mosquitto_broker.port),
            "DPU_AGENT_ID": "sync-agent",
        },
    )
    try:
        with (
            host_client.SyncClient(agent.address) as client,
            client.events("127.0.0.1", mosquitto_broker.port) as events,
            client.open_session(transport="tcp") as session,
            events.completions(session=session.name) as stream,
        ):
            status = events.agent_status("sync-agent", wait=10)
            assert status is not None
            assert status.online
            src = session.alloc(4096, readable=True)
            job = session.submit_crc32c(src)
            assert job.wait().ok
            event = next(iter(stream))
            assert event.job_id == job.job_id
            assert f"sessions/{event.session_id}" == session.name
            assert event.completion.crc32c == job.wait().crc32c
    finally:
        assert agent.terminate() == 0


def test_the_readme_blocking_example_runs(agent):
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    block = readme.split("<!-- blocking-example -->\n```python\n", 1)[1].split("```", 1)[0]
    script = block.replace("127.0.0.1:50051", agent.address)
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == agent_platform(agent)
    assert lines[1].startswith("0x")
    assert lines[2].endswith(" OK")


def agent_platform(agent):
    with host_client.SyncClient(agent.address) as client:
        return str(client.agent_info().platform)
