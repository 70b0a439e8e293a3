"""Where the agent dials a tcp data plane (DP-1.3-1): names resolved once, lookups bounded."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from dpu_agent import auth
from dpu_agent.dataplane import hostpolicy, transports
from dpu_agent.dataplane.hostpolicy import parse_allow, resolve_allowed
from dpu_agent.errors import PermissionDenied, Unavailable
from dpu_wire.transport import tcp
from dpu_wire.transport.base import TcpAddress, TransportError

PEER = "ipv4:127.0.0.1:40000"
ALLOW = parse_allow("peer")
real_getaddrinfo = socket.getaddrinfo


def _answer(ip: str, port: int) -> list[tuple[object, ...]]:
    return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port))]


@pytest.mark.asyncio
async def test_a_name_is_resolved_once_and_the_checked_address_is_dialled(monkeypatch):
    """DNS rebinding: the name answered the caller's own address to the check and
    another one to the connection, which the agent then dialled (an outside audit)."""
    answers = ["127.0.0.1", "127.0.0.2"]
    asked = []

    def rebinding(host, port, *args, **kwargs):
        if host != "rebind.test":
            return real_getaddrinfo(host, port, *args, **kwargs)
        asked.append(host)
        return _answer(answers.pop(0), port)

    dialled = []

    async def dial(_host, *, address=None, **_kwargs):
        dialled.append(address)
        raise TransportError("stop here")

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    monkeypatch.setattr(tcp, "dial", dial)
    factory = transports._tcp
    with pytest.raises(TransportError):
        await factory(ALLOW, 1.0, 0, TcpAddress("rebind.test", 4000, bytes(32)), 1, PEER)
    assert asked == ["rebind.test"]  # looked up once
    assert dialled == [(socket.AF_INET, socket.SOCK_STREAM, 6, ("127.0.0.1", 4000))]


@pytest.mark.asyncio
async def test_every_address_a_name_gives_is_checked(monkeypatch):
    def two(_host, port, *_args, **_kwargs):
        return _answer("127.0.0.1", port) + _answer("10.9.9.9", port)

    monkeypatch.setattr(socket, "getaddrinfo", two)
    with pytest.raises(PermissionDenied, match="must be the address this call comes from"):
        await resolve_allowed("two.test", 4000, PEER, ALLOW)


async def _as(tenant: str, host: str) -> object:
    """`resolve_allowed(host)` in a call of `tenant`'s (its own task, its own context)."""
    auth.principal.set(auth.Principal(tenant))
    return await resolve_allowed(host, 4000, PEER, ALLOW)


@pytest.mark.asyncio
async def test_a_name_whose_dns_hangs_cannot_hold_up_the_agents_other_threads(monkeypatch):
    """The lookups ran on asyncio's default executor without a timeout: a tenant naming
    hosts its DNS never answers took every thread that storage calls run on. Then one
    tenant could take every lookup place, and the others' names were refused."""
    monkeypatch.setattr(hostpolicy, "RESOLVE_TIMEOUT", 0.2)
    hang = threading.Event()
    finished = []

    def never(host, port, *args, **kwargs):
        if kwargs.get("flags", 0) & socket.AI_NUMERICHOST:
            return real_getaddrinfo(host, port, *args, **kwargs)
        if host == "back.test":
            return _answer("127.0.0.1", port)
        hang.wait(30)
        finished.append(host)
        raise socket.gaierror(socket.EAI_NONAME, "no such name")

    monkeypatch.setattr(socket, "getaddrinfo", never)
    per_tenant, total = hostpolicy.PER_TENANT, hostpolicy.RESOLVERS
    try:
        first = [_as("a", f"n{i}.slow.test") for i in range(per_tenant)]
        results = await asyncio.gather(*first, return_exceptions=True)
        assert all(isinstance(r, PermissionDenied) for r in results), results
        assert finished == []  # given up after RESOLVE_TIMEOUT, the lookups still hanging
        with pytest.raises(Unavailable, match=f"resolving {per_tenant} of this tenant's host"):
            await _as("a", "more.slow.test")  # the tenant's places are bounded
        # another tenant's name is looked up while tenant a's lookups hang
        address = await asyncio.create_task(_as("b", "back.test"))
        assert address[3] == ("127.0.0.1", 4000)  # type: ignore[index]
        others = [_as(f"t{i // per_tenant}", f"m{i}.slow.test") for i in range(total - per_tenant)]
        await asyncio.gather(*others, return_exceptions=True)
        with pytest.raises(Unavailable, match=f"resolving {total} host names already"):
            await _as("z", "more.slow.test")  # and so is the whole pool
        # the default executor (storage calls, ...) is free all the while
        assert await asyncio.wait_for(asyncio.to_thread(lambda: 42), 30) == 42
        # an address needs no lookup
        address = await resolve_allowed("127.0.0.1", 4000, PEER, ALLOW)
        assert address[3] == ("127.0.0.1", 4000)
    finally:
        hang.set()
    while hostpolicy._resolvers.taken:  # noqa: ASYNC110 - threads
        await asyncio.sleep(0.01)  # the hung lookups end and give their places back
    monkeypatch.setattr(hostpolicy, "RESOLVE_TIMEOUT", 30.0)  # slow under qemu-user (arm64)
    assert (await resolve_allowed("back.test", 4000, PEER, ALLOW))[3] == ("127.0.0.1", 4000)
