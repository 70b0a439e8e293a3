"""The rtnetlink socket: requests, dumps and batches on one NETLINK_ROUTE socket.

Extended acks are on (the kernel's reason for a refusal ends up in the error) and
acks are capped (an error does not echo the whole request). Not thread-safe by
itself: the backend holds a lock around it.

A batch sends many requests back to back, packed into few datagrams, with only its
last request acknowledged: the kernel answers only the requests it refuses, and the
ack of the last one says every answer is in. That is one acknowledgement round for
the whole batch, where `request` is one round trip per request.
"""

from __future__ import annotations

import contextlib
import errno
import select
import socket
import threading
from typing import TYPE_CHECKING, Final

from pyroute2.netns import setns

from dpu_agent.errors import Unavailable
from dpu_agent.network import netlink as nl

if TYPE_CHECKING:
    from collections.abc import Sequence

RECV_SIZE: Final = 1 << 16
TIMEOUT_S: Final = 10.0
DUMP_ATTEMPTS: Final = 3
BATCH_DATAGRAM: Final = 32 << 10  # bytes of requests per send (below every SO_SNDBUF)
RECV_BUFFER: Final = 4 << 20  # room for the refusals of a batch that fails everywhere
SO_RCVBUFFORCE: Final = 33


class DumpInterrupted(Exception):
    """The kernel's state changed during a dump (NLM_F_DUMP_INTR); dump again."""


def open_socket(netns: str | None) -> socket.socket:
    """A NETLINK_ROUTE socket, in the named network namespace when given."""
    if netns is None:
        return socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, nl.NETLINK_ROUTE)
    outcome: list[socket.socket | BaseException] = []

    def enter() -> None:  # setns() moves only this (short-lived) thread
        try:
            setns(netns, flags=0)
            outcome.append(socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, nl.NETLINK_ROUTE))
        except BaseException as exc:  # noqa: BLE001 - handed to the calling thread
            outcome.append(exc)

    thread = threading.Thread(target=enter, name=f"netns-{netns}")
    thread.start()
    thread.join()
    result = outcome[0]
    if isinstance(result, BaseException):
        raise Unavailable(f"cannot enter network namespace {netns!r}: {result}")
    return result


class Rtnl:
    """Requests and answers on one NETLINK_ROUTE socket (not thread-safe by itself)."""

    def __init__(self, netns: str | None) -> None:
        self._sock = open_socket(netns)
        try:
            self._sock.setsockopt(nl.SOL_NETLINK, nl.NETLINK_EXT_ACK, 1)
            self._sock.setsockopt(nl.SOL_NETLINK, nl.NETLINK_CAP_ACK, 1)
            try:  # CAP_NET_ADMIN (which tc needs anyway) may exceed rmem_max
                self._sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, RECV_BUFFER)
            except OSError:
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECV_BUFFER)
            self._sock.settimeout(TIMEOUT_S)
            self._sock.bind((0, 0))
        except OSError as exc:
            self._sock.close()
            raise Unavailable(f"rtnetlink socket: {exc}") from exc
        self._seq = 0

    def close(self) -> None:
        """Close the socket."""
        self._sock.close()

    def _next_seq(self) -> int:
        self._seq = (self._seq + 1) & nl.U32_MAX
        return self._seq

    def request(self, msg_type: int, flags: int, body: bytes) -> list[bytes]:
        """Send one request; its answers (whole messages), or nl.KernelError.

        A dump ends with NLMSG_DONE, an acked request with NLMSG_ERROR (0 = success),
        any other request with its one answer.
        """
        seq = self._next_seq()
        try:
            self._sock.send(nl.message(msg_type, flags, seq, body))
            return self._answers(seq, flags)
        except OSError as exc:  # includes the socket timeout
            raise Unavailable(f"rtnetlink: {exc}") from exc

    def dump(self, msg_type: int, body: bytes) -> list[bytes]:
        """A dump request, repeated when the kernel says it was interrupted."""
        for _ in range(DUMP_ATTEMPTS):
            with contextlib.suppress(DumpInterrupted):
                return self.request(msg_type, nl.NLM_F_REQUEST | nl.NLM_F_DUMP, body)
        raise Unavailable("rtnetlink dump interrupted repeatedly (the datapath keeps changing)")

    def batch(self, requests: Sequence[tuple[int, int, bytes]]) -> dict[int, nl.KernelError]:
        """Send (type, flags, body) requests in order; the refused ones by index.

        The kernel carries on after a refusal, so every request is tried. Flags
        should not ask for acks (NLM_F_ACK is set on the last request only). If the
        answers overflow the socket buffer, nl.KernelError(ENOBUFS) is raised: which
        requests took is then unknown (read the kernel's state back).
        """
        if not requests:
            return {}
        first = self._seq + 1
        datagram: list[bytes] = []  # joined once full: += would copy it for every request
        size = 0
        last = len(requests) - 1
        refused: dict[int, nl.KernelError] = {}
        try:
            for index, (msg_type, flags, body) in enumerate(requests):
                ack = nl.NLM_F_ACK if index == last else 0
                msg = nl.message(msg_type, flags | ack, self._next_seq(), body)
                if size and size + len(msg) > BATCH_DATAGRAM:
                    self._sock.send(b"".join(datagram))
                    self._drain(first, refused, block_until=None)
                    datagram, size = [], 0
                datagram.append(msg)
                size += len(msg)
            self._sock.send(b"".join(datagram))
            self._drain(first, refused, block_until=self._seq)
        except OSError as exc:
            if exc.errno == errno.ENOBUFS:
                raise nl.KernelError(errno.ENOBUFS, "answers to a batch were lost") from exc
            raise Unavailable(f"rtnetlink: {exc}") from exc
        return refused

    def _drain(
        self, first: int, refused: dict[int, nl.KernelError], block_until: int | None
    ) -> None:
        """Collect a batch's refusals; wait for the ack of `block_until` (None: no wait)."""
        while True:
            if block_until is None and not select.select([self._sock], [], [], 0)[0]:
                return
            data = self._sock.recv(RECV_SIZE)
            for kind, flags, seq, msg in nl.messages(data):
                if kind != nl.NLMSG_ERROR or not first <= seq <= self._seq:
                    continue  # a late answer to an earlier request that timed out
                code = nl.error_code(msg)
                if code:
                    refused[seq - first] = nl.KernelError(code, nl.extack(msg[16:], flags))
                if seq == block_until:
                    return

    def _answers(self, seq: int, flags: int) -> list[bytes]:
        answers: list[bytes] = []
        interrupted = False
        while True:
            data = self._sock.recv(RECV_SIZE)
            for kind, mflags, mseq, msg in nl.messages(data):
                if mseq != seq:
                    continue  # a late answer to an earlier request that timed out
                interrupted |= bool(mflags & nl.NLM_F_DUMP_INTR)
                if kind in (nl.NLMSG_ERROR, nl.NLMSG_DONE):
                    code = nl.error_code(msg)
                    if code and kind == nl.NLMSG_ERROR:
                        raise nl.KernelError(code, nl.extack(msg[16:], mflags))
                    if code:
                        raise nl.KernelError(code, "")
                    if interrupted:
                        raise DumpInterrupted
                    return answers
                answers.append(msg)
                if not flags & (nl.NLM_F_DUMP | nl.NLM_F_ACK):
                    return answers
