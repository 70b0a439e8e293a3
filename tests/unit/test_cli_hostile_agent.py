"""dpuctl against a hostile agent: its strings cannot drive the terminal.

The commands run through `cli.main` with the SDK client replaced by a fake that
answers what a compromised agent could: terminal escapes in every string.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Self

import pytest
from google.protobuf import timestamp_pb2

from dpu_wire.v1 import (
    agent_pb2,
    job_pb2,
    network_pb2,
    session_pb2,
    storage_pb2,
    virtualization_pb2,
)
from host_client import cli
from host_client._cli_top import Samples, View
from host_client._display import printable
from host_client._errors import FailedPreconditionError

if TYPE_CHECKING:
    from collections.abc import Callable

# set the window title, clear the screen, paint a fake message; then C1 CSI and a bidi override
ESC = "\x1b]0;PWNED\x07\x1b[2J\x1b[H\x1b[31mall good\x1b[0m\x9b2J\u202e"


class HostileClient:
    """The SDK client's calls dpuctl makes, answered with escapes in every string."""

    target = "127.0.0.1:50051"

    def __init__(self, *_args: object, **_kwargs: object) -> None:
        pass

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        pass

    async def list_functions(self) -> list[virtualization_pb2.Function]:
        return [await self.get_function("f")]

    async def get_function(self, _name: str) -> virtualization_pb2.Function:
        return virtualization_pb2.Function(
            name="functions/f" + ESC,
            type=virtualization_pb2.FUNCTION_TYPE_VF,
            state=virtualization_pb2.FUNCTION_STATE_READY,
            host_device=ESC,
            representor_port="ports/pf0vf0" + ESC,
            volume="volumes/v" + ESC,
            mac_address=ESC,
        )

    async def list_ports(self) -> list[network_pb2.Port]:
        return [
            network_pb2.Port(
                name="ports/p0" + ESC,
                kind=network_pb2.PORT_KIND_UPLINK,
                oper_state=network_pb2.OPER_STATE_UP,
                mac_address=ESC,
            )
        ]

    async def list_flow_rules(self, _port: str = "") -> list[network_pb2.FlowRule]:
        return [await self.get_flow_rule("r")]

    async def get_flow_rule(self, _name: str) -> network_pb2.FlowRule:
        return network_pb2.FlowRule(
            name="flowRules/r" + ESC,
            ingress_port="ports/x" + ESC,
            priority=1,
            match=network_pb2.FlowMatch(src_mac=ESC),
            actions=[network_pb2.FlowAction(drop=network_pb2.DropAction())],
            tenant=ESC,
        )

    async def delete_flow_rule(self, _name: str) -> None:
        raise FailedPreconditionError("FAILED_PRECONDITION", "denied" + ESC, "rid" + ESC)

    async def agent_info(self) -> agent_pb2.AgentInfo:
        device = agent_pb2.RdmaDevice(
            name="mlx5_0" + ESC,
            ports=[agent_pb2.RdmaPort(port_num=1, state=ESC, link_layer=ESC)],
        )
        return agent_pb2.AgentInfo(
            name="agents/a" + ESC,
            version=ESC,
            api_version=ESC,
            hostname=ESC,
            machine=ESC,
            kernel=ESC,
            platform=ESC,
            start_time=timestamp_pb2.Timestamp(seconds=1),
            rdma_devices=[device],
            capabilities=[agent_pb2.Capability(service="dpu.v1.X" + ESC, reason=ESC)],
        )

    async def health(self, _service: str = "") -> str:
        return "SERVING" + ESC

    async def list_sessions(self) -> list[session_pb2.Session]:
        return [session_pb2.Session(name="sessions/s" + ESC, client_label=ESC)]

    async def list_jobs(self, _session: str) -> list[job_pb2.Job]:
        completion = job_pb2.Completion()
        completion.status.code = 13
        completion.status.message = ESC
        return [job_pb2.Job(name="sessions/s/jobs/1" + ESC, completion=completion)]

    async def list_volumes(self) -> list[storage_pb2.Volume]:
        return [storage_pb2.Volume(name="volumes/v" + ESC, source_snapshot=ESC)]

    async def list_snapshots(self, _volume: str = "") -> list[storage_pb2.Snapshot]:
        return [storage_pb2.Snapshot(name="snapshots/s" + ESC, source_volume=ESC, clones=[ESC])]


@pytest.fixture
def dpuctl(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Callable[..., tuple[int, str, str]]:
    monkeypatch.setattr(cli, "Client", HostileClient)

    def run(*argv: str) -> tuple[int, str, str]:
        status = cli.main(["--plaintext", *argv])
        out, err = capsys.readouterr()
        return status, out, err

    return run


def _no_controls(text: str) -> None:
    """Only newlines of dpuctl's own lines: no escape, C1 control or bidi override."""
    assert text.strip()
    assert all(c.isprintable() for c in text.replace("\n", "")), repr(text)


@pytest.mark.parametrize(
    "argv",
    [
        ("function", "list"),
        ("function", "show", "f"),
        ("port", "list"),
        ("flow", "list"),
        ("flow", "stats", "r"),
        ("info",),
        ("health",),
        ("session", "list"),
        ("job", "list", "sessions/s"),
        ("volume", "list"),
        ("volume", "snapshot", "list"),
    ],
)
def test_agent_strings_are_printed_escaped(
    dpuctl: Callable[..., tuple[int, str, str]], argv: tuple[str, ...]
) -> None:
    _status, out, err = dpuctl(*argv)
    _no_controls(out)
    assert "\\x1b]0;PWNED\\x07" in out  # shown, not obeyed
    assert not err


def test_an_agent_error_message_is_printed_escaped(
    dpuctl: Callable[..., tuple[int, str, str]],
) -> None:
    status, out, err = dpuctl("flow", "del", "x")
    assert status == cli.EXIT_FAILED
    assert not out
    _no_controls(err)
    assert err.startswith("dpuctl: FAILED_PRECONDITION: denied\\x1b]0;PWNED\\x07")


def test_json_output_stays_json_escaped(dpuctl: Callable[..., tuple[int, str, str]]) -> None:
    _status, out, _err = dpuctl("function", "list", "--json")
    _no_controls(out)
    assert "\\u001b]0;PWNED\\u0007" in out


def test_top_shows_a_hostile_metrics_label_escaped() -> None:
    label = (("kind", "read" + ESC), ("status", "OK"))
    old: Samples = {}
    new: Samples = {("jobs_total", label): 5.0}
    text = View.between("http://127.0.0.1:9464/metrics", old, new, 1.0).text()
    _no_controls(text)
    assert "read\\x1b]0;PWNED" in text


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("functions/f", "functions/f"),
        ("été-日本", "été-日本"),
        ("a\x1b[2Jb", "a\\x1b[2Jb"),
        ("a\nb\r\t", "a\\nb\\r\\t"),
        ("\x7f\x9b", "\\x7f\\x9b"),
        ("x\u202ey\u2028", "x\\u202ey\\u2028"),
        ("\U000e0041", "\\U000e0041"),
        ("back\\slash", "back\\slash"),
    ],
)
def test_printable(raw: str, shown: str) -> None:
    assert printable(raw) == shown


class UnknownEnumClient(HostileClient):
    """Enum numbers this client's protos do not name (a newer or a hostile agent)."""

    async def get_function(self, _name: str) -> virtualization_pb2.Function:
        return virtualization_pb2.Function(name="functions/f", type=42, state=99)  # type: ignore[arg-type]

    async def list_ports(self) -> list[network_pb2.Port]:
        return [network_pb2.Port(name="ports/p0", kind=77, oper_state=55)]  # type: ignore[arg-type]

    async def list_sessions(self) -> list[session_pb2.Session]:
        return [session_pb2.Session(name="sessions/s", state=66, transport=9)]  # type: ignore[arg-type]

    async def list_jobs(self, _session: str) -> list[job_pb2.Job]:
        return [job_pb2.Job(name="sessions/s/jobs/1", state=88)]  # type: ignore[arg-type]

    async def list_volumes(self) -> list[storage_pb2.Volume]:
        services = storage_pb2.DataServices(compression=5, encryption=6)  # type: ignore[arg-type]
        return [storage_pb2.Volume(name="volumes/v", data_services=services)]


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        (("function", "list"), ("unknown(42)", "unknown(99)")),
        (("function", "show", "f"), ("unknown(42)", "unknown(99)")),
        (("port", "list"), ("unknown(77)", "unknown(55)")),
        (("session", "list"), ("unknown(9)", "UNKNOWN(66)")),
        (("job", "list", "sessions/s"), ("UNKNOWN(88)",)),
        (("volume", "list"), ("unknown(5)", "unknown(6)")),
    ],
)
def test_unknown_enum_values_are_shown_as_numbers(
    monkeypatch: pytest.MonkeyPatch,
    dpuctl: Callable[..., tuple[int, str, str]],
    argv: tuple[str, ...],
    shown: tuple[str, ...],
) -> None:
    monkeypatch.setattr(cli, "Client", UnknownEnumClient)
    status, out, err = dpuctl(*argv)
    assert (status, err) == (0, "")
    for text in shown:
        assert text in out
