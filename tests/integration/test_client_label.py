"""OpenSession's client_label is shown to people: short, printable, and never a log line.

A label with a line break once forged a line in the agent's text-format log; now it is
refused with INVALID_ARGUMENT, and a printable label that looks like fields
("x tenant=admin") is written quoted.
"""

import pytest

import host_client
from tests.integration.conftest import start_agent

pytestmark = pytest.mark.asyncio
FORGED = "app\n2026-01-01 00:00:00,000 INFO    dpu_agent.auth: tenant=admin granted"


@pytest.fixture(scope="module")
def text_agent(tmp_path_factory):
    agent = start_agent(
        tmp_path_factory.mktemp("label-agent"),
        "--log-format",
        "text",
        env={"DPU_AGENT_TRANSPORTS": "tcp"},
    )
    yield agent
    assert agent.terminate() == 0, agent.log_path.read_text()


@pytest.mark.parametrize(
    ("label", "fragment"),
    [
        (FORGED, "only printable characters"),
        ("tab\there", "only printable characters"),
        ("ansi\x1b[2Jclear", "only printable characters"),
        ("line\u2028separator", "only printable characters"),
        ("x" * 129, "129 characters long (at most 128)"),
    ],
)
async def test_a_label_that_is_not_short_and_printable_is_refused(text_agent, label, fragment):
    async with host_client.Client(text_agent.address) as client:
        with pytest.raises(host_client.InvalidArgumentError, match="client_label") as refused:
            await client.open_session(transport="tcp", label=label)
        assert fragment in refused.value.message
        assert await client.list_sessions() == []
    assert "granted" not in text_agent.log_path.read_text()


async def test_a_printable_label_that_looks_like_fields_is_logged_quoted(text_agent):
    label = "app 1 tenant=admin"
    async with host_client.Client(text_agent.address) as client:
        async with await client.open_session(transport="tcp", label=label) as session:
            assert (await client.get_session(session.name)).client_label == label
        long_enough = "y" * 128
        async with await client.open_session(transport="tcp", label=long_enough):
            pass
    lines = [
        line for line in text_agent.log_path.read_text().splitlines() if "session opened" in line
    ]
    assert any(' label="app 1 tenant=admin"' in line for line in lines), lines
    assert all(" tenant=default " in line for line in lines), lines
