"""SyncClient offers every public call of Client, blocking, by one generated mechanism."""

import inspect

import pytest

import host_client
from host_client import _sync


def _public(kind: type) -> dict[str, object]:
    return {name: m for name, m in inspect.getmembers(kind) if not name.startswith("_")}


def test_every_public_call_of_client_is_offered():
    missing = [
        name
        for name, member in _public(host_client.Client).items()
        if name not in _sync.NOT_WRAPPED and name not in _public(host_client.SyncClient)
    ]
    assert missing == [], f"Client calls SyncClient lacks: {missing}"


@pytest.mark.parametrize(
    "name",
    [
        n
        for n, m in _public(host_client.Client).items()
        if inspect.iscoroutinefunction(m) or inspect.isasyncgenfunction(m)
    ],
)
def test_each_call_is_blocking_with_the_same_signature(name):
    async_call = getattr(host_client.Client, name)
    sync_call = getattr(host_client.SyncClient, name)
    assert not inspect.iscoroutinefunction(sync_call)
    assert not inspect.isasyncgenfunction(sync_call)
    assert inspect.signature(sync_call) == inspect.signature(async_call)
    assert f"Client.{name}" in (sync_call.__doc__ or "")


def test_the_calls_not_offered_say_why():
    for name, reason in _sync.NOT_WRAPPED.items():
        assert name in _public(host_client.Client)
        assert reason
        with pytest.raises(AttributeError, match=reason):
            getattr(host_client.SyncClient(), name)


def test_a_new_kind_of_member_is_refused_not_dropped(monkeypatch):
    class Grown(host_client.Client):
        def a_plain_method(self) -> None:
            """Neither a coroutine, an async iterator nor a property."""

    monkeypatch.setattr(_sync, "Client", Grown)
    with pytest.raises(TypeError, match=r"Client\.a_plain_method"):
        _sync._generate()


def test_calls_need_the_client_open():
    client = host_client.SyncClient("127.0.0.1:1")
    with pytest.raises(RuntimeError, match="not open"):
        client.list_volumes()
    assert client.target == "127.0.0.1:1"
    assert client.timeout == 10.0


@pytest.mark.asyncio
async def test_refused_inside_an_event_loop():
    with (
        pytest.raises(RuntimeError, match="inside an event loop use Client"),
        host_client.SyncClient("127.0.0.1:1"),
    ):
        pass


@pytest.mark.parametrize(
    ("kind", "wrapped"),
    [
        (host_client.Session, True),  # coroutine methods, async with
        (host_client.Job, True),  # awaitable: .wait()
        (host_client.Subscription, True),  # async with, async for
        (host_client.EventSubscriber, True),
        (host_client.Buffer, False),  # plain memory: given back as it is
        (host_client.Completion, False),
    ],
)
def test_what_comes_back_wrapped(kind, wrapped):
    assert _sync._is_async_type(kind) is wrapped
