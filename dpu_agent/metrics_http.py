"""The /metrics HTTP endpoint: one thread, a bounded number of connections, every wait timed.

prometheus_client's own server is a ThreadingHTTPServer: a thread per connection,
waiting for the request with no timeout, so 1,000 connections that send half a
request held 1,000 threads for ever. This one runs an asyncio loop on one daemon
thread, apart from the agent's event loop:

- at most `max_connections` connections at once. One more closes the oldest
  connection still waiting for its request (a scraper sends its request as soon as
  it connects, so a client that holds connections half-sent loses them, not the
  scraper); if every connection is already being answered, the new one is closed;
- the request head must arrive within `read_timeout` seconds and fit in
  `MAX_REQUEST_BYTES`; the answer must be taken within `WRITE_TIMEOUT` seconds;
- one request per connection (`Connection: close`), HTTP/1.0 and 1.1.

`GET /metrics` (or `/`) answers the registry in the format the Accept header asks
for (Prometheus text, or OpenMetrics); HEAD the same without a body; another path is
404, another method 405, a head that does not parse 400.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ipaddress
import socket
import threading
from typing import TYPE_CHECKING, Final

from prometheus_client.exposition import choose_encoder

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

MAX_CONNECTIONS: Final = 32
READ_TIMEOUT: Final = 5.0  # seconds for the request head to arrive
WRITE_TIMEOUT: Final = 10.0  # seconds for the client to take the answer
MAX_REQUEST_BYTES: Final = 8192  # the request line and headers
PATHS: Final = ("/metrics", "/")
_REASONS: Final = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}


def split_listen(listen: str) -> tuple[str, int]:
    """("host", port) of "host:port" or "[v6]:port"."""
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)


def url_host(host: str) -> str:
    """The host as a URL writes it ("[::1]" for an IPv6 address)."""
    try:
        return f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    except ValueError:
        return host


class MetricsServer:
    """The HTTP endpoint (`GET /metrics`) of a registry, on its own daemon thread."""

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        max_connections: int = MAX_CONNECTIONS,
        read_timeout: float = READ_TIMEOUT,
    ) -> None:
        self._registry = registry
        self.max_connections = max_connections
        self.read_timeout = read_timeout
        self.address = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        # every open connection, oldest first; True once its request has arrived
        self._open: collections.OrderedDict[asyncio.StreamWriter, bool] = collections.OrderedDict()

    @property
    def url(self) -> str:
        """http://host:port/metrics (after start)."""
        host, port = split_listen(self.address)
        return f"http://{url_host(host)}:{port}/metrics"

    def start(self, listen: str) -> str:
        """Listen on host:port (port 0: any free port); return the bound host:port.

        Raises OSError when the address cannot be bound.
        """
        if self._thread is not None:
            raise RuntimeError("MetricsServer.start() called twice")
        host, port = split_listen(listen)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host, port), family=family, backlog=128)
        self.address = f"{url_host(host)}:{sock.getsockname()[1]}"
        loop = asyncio.new_event_loop()
        started = threading.Event()
        self._loop = loop
        self._thread = threading.Thread(
            target=self._run, args=(loop, sock, started), name="metrics-http", daemon=True
        )
        self._thread.start()
        started.wait()
        return self.address

    def stop(self) -> None:
        """Stop serving, close the socket and every connection. Idempotent."""
        loop, thread, self._loop = self._loop, self._thread, None
        if loop is None or thread is None:
            return
        stop = self._stop
        if stop is not None:
            loop.call_soon_threadsafe(stop.set)
        thread.join()

    # ------------------------------------------------------------------ the loop thread
    def _run(
        self, loop: asyncio.AbstractEventLoop, sock: socket.socket, started: threading.Event
    ) -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._serve(sock, started))
        finally:
            started.set()  # also if serving failed before it was ready
            loop.close()

    async def _serve(self, sock: socket.socket, started: threading.Event) -> None:
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._connection, sock=sock, limit=MAX_REQUEST_BYTES)
        started.set()
        try:
            await self._stop.wait()
        finally:
            server.close()
            for writer in list(self._open):
                writer.transport.abort()
            if self._tasks:  # each sees the end of its stream and returns
                await asyncio.wait(self._tasks, timeout=1.0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(server.wait_closed(), 1.0)

    def _admit(self, writer: asyncio.StreamWriter) -> bool:
        """Make room for a new connection; False if there is none (it is closed)."""
        if len(self._open) >= self.max_connections:
            waiting = next((w for w, answering in self._open.items() if not answering), None)
            if waiting is None:
                writer.transport.abort()
                return False
            waiting.transport.abort()  # its handler sees the end of the stream and leaves
            del self._open[waiting]
        self._open[writer] = False
        return True

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._admit(writer):
            return
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.read_timeout)
            except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                return
            if writer in self._open:
                self._open[writer] = True
            writer.write(self._answer(head))
            await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT)
        except (TimeoutError, ConnectionError):
            pass
        finally:
            self._open.pop(writer, None)
            writer.close()

    def _answer(self, head: bytes) -> bytes:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            return _response(400, b"bad request\n")
        method, target, _ = parts
        if method not in ("GET", "HEAD"):
            return _response(405, b"only GET and HEAD\n")
        if target.partition("?")[0] not in PATHS:
            return _response(404, b"try /metrics\n")
        accept = ""
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "accept":
                accept = value.strip()
        encoder, content_type = choose_encoder(accept)
        body = encoder(self._registry)
        return _response(200, body, content_type, with_body=method == "GET")


def _response(
    status: int,
    body: bytes,
    content_type: str = "text/plain; charset=utf-8",
    *,
    with_body: bool = True,
) -> bytes:
    head = (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\n"
        f"Content-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode("latin-1") + (body if with_body else b"")
