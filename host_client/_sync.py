"""The blocking SDK: `SyncClient`, every call of `Client` made on a private event loop.

One mechanism, not a copy per call: the class is generated from `Client`'s public
members (each coroutine method becomes a blocking method with the same signature and
docstring, each async iterator a plain iterator), and whatever a call returns that is
itself asynchronous (a `Session`, a `Job`, an event `Subscription`, ...) comes back
wrapped by `Blocking`, which does the same for that object's members. The event loop
runs on a daemon thread of its own, so a session's background work (its data-plane
reader, its watch stream) goes on between the caller's calls.
"""

# ruff: noqa: ANN401 - a dynamic proxy: its values are whatever Client's calls return
from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import threading
from typing import TYPE_CHECKING, Any, Final, Literal, Self, TypeVar

from host_client._client import Client
from host_client._events import EventSubscriber

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
    from types import TracebackType

    from host_client._tls import TlsConfig

_T = TypeVar("_T")

# Public members of `Client` that `SyncClient` does not offer, and why. Every other
# public member must be wrapped (tests/unit/test_sync_parity.py checks it).
NOT_WRAPPED: Final = {
    "rpc": "the async call machinery itself; use Client",
    "stubs": "raw grpc.aio stubs; use Client",
}


class EventLoopThread:
    """An asyncio event loop running on a daemon thread; `run` blocks for one coroutine."""

    def __init__(self, name: str = "host-client-sync") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Run `coro` on the loop and wait for its result (Ctrl-C cancels it)."""
        if not self._thread.is_alive():
            coro.close()
            raise RuntimeError("SyncClient is closed")
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass  # no loop runs in this thread: blocking is fine
        else:
            coro.close()
            raise RuntimeError("SyncClient blocks: inside an event loop use Client")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def close(self) -> None:
        """Cancel what still runs on the loop, stop it and join its thread. Idempotent."""
        if not self._thread.is_alive():
            return
        with contextlib.suppress(Exception):
            self.run(_cancel_others())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


async def _cancel_others() -> None:
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.get_running_loop().shutdown_asyncgens()


def _is_async(value: Any) -> bool:
    """Whether `value` needs the loop: awaitable, async iterable or async context manager."""
    if isinstance(value, type):
        return False
    kind = type(value)
    known = _ASYNC_TYPES.get(kind)
    if known is None:
        known = _ASYNC_TYPES[kind] = _is_async_type(kind)
    return known


_ASYNC_TYPES: dict[type[Any], bool] = {}


def _is_async_type(kind: type[Any]) -> bool:
    if any(hasattr(kind, m) for m in ("__await__", "__aiter__", "__aenter__")):
        return True
    return any(
        inspect.iscoroutinefunction(member) or inspect.isasyncgenfunction(member)
        for name, member in inspect.getmembers(kind)
        if not name.startswith("_")
    )


def _wrap(value: Any, loop: EventLoopThread) -> Any:
    """`value`, or a blocking view of it if it is asynchronous (lists element-wise)."""
    if isinstance(value, list):
        return [_wrap(v, loop) for v in value]
    if _is_async(value):
        return Blocking(value, loop)
    return value


def _unwrap(value: Any) -> Any:
    if isinstance(value, Blocking):
        return value.async_object
    if isinstance(value, list | tuple):
        return type(value)(_unwrap(v) for v in value)
    return value


async def _call(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Call `function` on the loop's thread and await what it returns if it is a coroutine."""
    result = function(*args, **kwargs)
    if inspect.iscoroutine(result):
        return await result
    return result


def _blocking_call(
    loop: EventLoopThread, function: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    args = tuple(_unwrap(a) for a in args)
    kwargs = {k: _unwrap(v) for k, v in kwargs.items()}
    return _wrap(loop.run(_call(function, args, kwargs)), loop)


class Blocking:
    """A blocking view of an asynchronous SDK object (a Session, Job, Subscription, ...).

    Its methods are the object's, made blocking; `with` enters the object's `async
    with`; iterating it iterates its `async for`; `wait()` awaits it (a `Job` gives its
    `Completion`). Arguments that are `Blocking` views are passed on unwrapped.
    """

    def __init__(self, async_object: Any, loop: EventLoopThread) -> None:
        self.async_object = async_object
        self._loop = loop

    def __repr__(self) -> str:
        return f"Blocking({self.async_object!r})"

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.async_object, name)
        if callable(value) and not isinstance(value, type):
            method = functools.partial(_blocking_call, self._loop, value)
            return functools.update_wrapper(method, value)
        return value

    def __dir__(self) -> list[str]:
        return sorted({*dir(self.async_object), "wait"})

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("async_object", "_loop"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.async_object, name, value)

    def wait(self) -> Any:
        """Await the object (e.g. a `Job`: its `Completion`)."""

        async def awaited() -> Any:
            return await self.async_object

        return _wrap(self._loop.run(awaited()), self._loop)

    def __enter__(self) -> Self:
        entered = self._loop.run(_call(self.async_object.__aenter__, (), {}))
        if entered is not self.async_object:
            return Blocking(entered, self._loop)  # type: ignore[return-value]
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        return self._loop.run(_call(self.async_object.__aexit__, (exc_type, exc, tb), {}))  # type: ignore[no-any-return]

    def __iter__(self) -> Iterator[Any]:
        return _iterate(aiter(self.async_object), self._loop)


def _iterate(iterator: AsyncIterator[Any], loop: EventLoopThread) -> Iterator[Any]:
    async def step() -> tuple[bool, Any]:
        try:
            return True, await anext(iterator)
        except StopAsyncIteration:
            return False, None

    try:
        while True:
            more, item = loop.run(step())
            if not more:
                return
            yield _wrap(item, loop)
    finally:
        close = getattr(iterator, "aclose", None)
        if close is not None:
            with contextlib.suppress(Exception):
                loop.run(close())


def _blocking_method(name: str, member: Callable[..., Any]) -> Callable[..., Any]:
    """`SyncClient.<name>`: `Client.<name>` made blocking (same signature and docstring)."""
    if inspect.isasyncgenfunction(member):

        def iterating(self: SyncClient, *args: Any, **kwargs: Any) -> Iterator[Any]:
            bound = getattr(self._opened(), name)
            args = tuple(_unwrap(a) for a in args)
            kwargs = {k: _unwrap(v) for k, v in kwargs.items()}
            return _iterate(bound(*args, **kwargs), self._loop)

        wrapper = iterating
    else:

        def calling(self: SyncClient, *args: Any, **kwargs: Any) -> Any:
            return _blocking_call(self._loop, getattr(self._opened(), name), *args, **kwargs)

        wrapper = calling
    functools.update_wrapper(wrapper, member)
    wrapper.__doc__ = f"Blocking `Client.{name}`: {member.__doc__ or ''}"
    return wrapper


def _forwarded_property(name: str) -> property:
    return property(lambda self: getattr(self._client, name), doc=f"`Client.{name}`.")


class SyncClient:
    """Blocking client: every call of `Client`, for scripts, REPLs and threads.

        with SyncClient("127.0.0.1:50051") as client:
            print(client.agent_info().version)
            with client.open_session(transport="tcp") as session:
                buf = session.alloc(4096, readable=True)
                print(hex(session.crc32c(buf)))

    Each `Client` coroutine is a blocking method here with the same arguments; what is
    asynchronous in the answer (a `Session`, a `Job`) comes back as a `Blocking` view
    with blocking methods (`job.wait()` gives a `Completion`); `Client`'s async
    iterators are plain iterators. The calls run on a private event loop on a daemon
    thread, so this must not be used from inside a running event loop (use `Client`).
    """

    def __init__(
        self,
        target: str | None = None,
        *,
        timeout: float | None = 10.0,
        tls: TlsConfig | Literal[False] | None = None,
        token: str | None = None,
    ) -> None:
        """Create a client for the agent at `target`; see `Client` (tls, token too)."""
        self._client = Client(target, timeout=timeout, tls=tls, token=token)
        self._loop_thread: EventLoopThread | None = None

    @property
    def _loop(self) -> EventLoopThread:
        if self._loop_thread is None:
            raise RuntimeError("SyncClient is not open: use `with SyncClient(...)`")
        return self._loop_thread

    def _opened(self) -> Client:
        self._loop  # noqa: B018 - raises if not open
        return self._client

    def __enter__(self) -> Self:
        if self._loop_thread is not None:
            raise RuntimeError("SyncClient is already open (it is not re-entrant)")
        self._loop_thread = EventLoopThread()
        try:
            self._loop_thread.run(_call(self._client.__aenter__, (), {}))
        except BaseException:
            self._loop_thread.close()
            self._loop_thread = None
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        loop, self._loop_thread = self._loop_thread, None
        if loop is not None:
            try:
                loop.run(_call(self._client.__aexit__, (exc_type, exc, tb), {}))
            finally:
                loop.close()

    def events(self, *args: Any, **kwargs: Any) -> Blocking:
        """A blocking `EventSubscriber(*args, **kwargs)` (MQTT events) on this client's loop.

            with client.events("127.0.0.1", 1883) as events:
                with events.completions(session=session.name) as stream:
                    for event in stream: ...

        Enter it with `with` like the client; it needs the client open.
        """
        return Blocking(EventSubscriber(*args, **kwargs), self._loop)

    def __getattr__(self, name: str) -> Any:
        """The client's settings (`timeout`, `tls`, ...); the calls are generated below."""
        if name.startswith("_"):
            raise AttributeError(name)
        if name in NOT_WRAPPED:
            raise AttributeError(f"SyncClient has no {name}: {NOT_WRAPPED[name]}")
        value = getattr(self._client, name)
        if callable(value):
            raise AttributeError(f"SyncClient does not offer Client.{name}")  # noqa: TRY004 - attribute lookup
        return value


def _generate() -> None:
    """Give SyncClient a blocking counterpart of each public member of Client."""
    for name, member in inspect.getmembers(Client):
        if name.startswith("_") or name in NOT_WRAPPED or name in vars(SyncClient):
            continue
        if inspect.iscoroutinefunction(member) or inspect.isasyncgenfunction(member):
            setattr(SyncClient, name, _blocking_method(name, member))
        elif isinstance(member, property) or not callable(member):
            setattr(SyncClient, name, _forwarded_property(name))
        else:
            # a new kind of public member: decide how it is offered, do not drop it
            raise TypeError(f"SyncClient does not know how to offer Client.{name}")


_generate()

__all__ = ["NOT_WRAPPED", "Blocking", "EventLoopThread", "SyncClient"]
