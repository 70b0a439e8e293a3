"""Per-volume QoS: token buckets that delay I/O, never refuse it.

Each limit of a volume (read IOPS, write IOPS, read bytes/s, write bytes/s) is a
token bucket refilled at the limit's rate and holding at most `BURST_S` seconds of
it. `throttle(op, nbytes)` takes the tokens an I/O needs at once, going into debt if
there are not enough, and returns a `Reservation`: how long the caller must wait
before doing the I/O (the debt over the rate; the longest of the buckets involved).
A reservation is never refused: a throttled job waits its turn, in arrival order,
and the caller does the waiting (the data plane sleeps asynchronously, holding no
thread). An I/O larger than a whole burst simply waits longer.

An I/O that will not be done after all (its job was cancelled, passed its deadline
or lost its session while it waited) is given back (`Reservation.give_back`): the
tokens it had yet to wait for return to the buckets, so later I/O of the volume does
not wait for it. Without that, every job that ends while it waits would leave its
whole cost as debt, and a host whose throttled jobs keep passing their deadline
would push the debt, and every later job's wait, up without bound. What the I/O
already waited for, or took from the stored burst, stays spent. Tokens given back
go to whoever reserves next: with a bytes/s limit, a small job that arrives then
may run before a larger one still waiting behind the job given back (the waits
already handed out do not move). Giving back, rather than taking the tokens only
once a job may run, keeps a reservation one call under the volume's lock: no queue
of waiters, and each waiter sleeps on its own reactor thread.

The limits are checked where they are set (`check_qos`): 0 means no limit; a set
limit lies in the ranges below, so no single 1 MiB job can be made to wait for
hours and no rate overflows the arithmetic.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Final

from dpu_agent.errors import InvalidArgument
from dpu_agent.storage.types import NO_QOS, U64_MASK, QosLimits

if TYPE_CHECKING:
    from collections.abc import Callable

BURST_S: Final = 1.0
MIN_IOPS: Final = 1
MAX_IOPS: Final = 10_000_000
MIN_BYTES_PER_SECOND: Final = 64 << 10  # 64 KiB/s: a 1 MiB job waits 16 s at most
MAX_BYTES_PER_SECOND: Final = 1 << 40  # 1 TiB/s
OPS: Final = ("read", "write")

_RANGES: Final = {
    "read_iops": (MIN_IOPS, MAX_IOPS),
    "write_iops": (MIN_IOPS, MAX_IOPS),
    "read_bytes_per_second": (MIN_BYTES_PER_SECOND, MAX_BYTES_PER_SECOND),
    "write_bytes_per_second": (MIN_BYTES_PER_SECOND, MAX_BYTES_PER_SECOND),
}


def check_qos(qos: object) -> QosLimits:
    """QoS limits with every value 0 (no limit) or within its range."""
    if not isinstance(qos, QosLimits):
        raise InvalidArgument(f"qos must be QosLimits, not {type(qos).__name__}")
    for field, (low, high) in _RANGES.items():
        value = getattr(qos, field)
        if not isinstance(value, int) or isinstance(value, bool):
            raise InvalidArgument(f"qos.{field} must be an integer")
        if value and not low <= value <= high:
            raise InvalidArgument(
                f"qos.{field} {value} is out of range: 0 (no limit) or {low}..{high}"
            )
    return qos


class TokenBucket:
    """Tokens at `rate` per second, at most `rate * BURST_S` stored; may go into debt."""

    __slots__ = ("_rate", "_stamp", "_tokens", "burst")

    def __init__(self, rate: int, now: float) -> None:
        self._rate = float(rate)
        self.burst = self._rate * BURST_S
        self._tokens = self.burst
        self._stamp = now

    def reserve(self, cost: float, now: float) -> float:
        """Take `cost` tokens; returns the seconds to wait before using them."""
        tokens = min(self.burst, self._tokens + (now - self._stamp) * self._rate)
        self._stamp = now
        tokens -= cost
        self._tokens = tokens
        return -tokens / self._rate if tokens < 0 else 0.0

    def give_back(self, cost: float, until: float, now: float) -> None:
        """Return what is unpaid of `cost` tokens reserved to be used at `until`.

        That is the tokens still to come in for it: at most `(until - now) * rate`.
        """
        unpaid = min(cost, (until - now) * self._rate)
        if unpaid > 0:
            tokens = min(self.burst, self._tokens + (now - self._stamp) * self._rate)
            self._stamp = now
            self._tokens = min(self.burst, tokens + unpaid)


class Reservation:
    """The tokens one I/O took (`VolumeQos.throttle`): `wait` seconds before doing it.

    `give_back()` when the I/O will not be done (see the module docstring); once only,
    later calls do nothing.
    """

    __slots__ = ("_parts", "_qos", "wait")

    def __init__(
        self,
        wait: float,
        qos: VolumeQos | None = None,
        parts: tuple[tuple[TokenBucket, float, float], ...] = (),
    ) -> None:
        self.wait = wait
        self._qos = qos
        self._parts = parts  # (bucket, cost, when it is paid off), per bucket involved

    def give_back(self) -> None:
        """Return the tokens the I/O had yet to wait for."""
        parts, self._parts = self._parts, ()
        if parts and self._qos is not None:
            self._qos.give_back(parts)


NO_WAIT: Final = Reservation(0.0)
"""An I/O within its limits (or of a volume without any): nothing to wait or give back."""


class VolumeQos:
    """The buckets of one volume, and what they delayed. Thread-safe."""

    def __init__(
        self, limits: QosLimits = NO_QOS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self.limits = NO_QOS
        self._buckets: dict[str, tuple[TokenBucket | None, TokenBucket | None]] = {}
        self.throttled_ops = 0
        self.delay_us = 0
        self.set(limits)

    def set(self, limits: QosLimits) -> None:
        """New limits (buckets start full)."""
        now = self._clock()

        def bucket(rate: int) -> TokenBucket | None:
            return TokenBucket(rate, now) if rate else None

        with self._lock:
            self.limits = limits
            self._buckets = {
                "read": (bucket(limits.read_iops), bucket(limits.read_bytes_per_second)),
                "write": (bucket(limits.write_iops), bucket(limits.write_bytes_per_second)),
            }

    def throttle(self, op: str, nbytes: int) -> Reservation:
        """Reserve one `op` of `nbytes`: the seconds to wait before doing it, and its tokens."""
        ops, nbytes_bucket = self._buckets[op]
        if ops is None and nbytes_bucket is None:
            return NO_WAIT
        with self._lock:
            now = self._clock()
            wait = 0.0
            parts: list[tuple[TokenBucket, float, float]] = []
            for bucket, cost in ((ops, 1), (nbytes_bucket, nbytes)):
                if bucket is not None:
                    delay = bucket.reserve(cost, now)
                    wait = max(wait, delay)
                    parts.append((bucket, cost, now + delay))
            if wait <= 0:
                return NO_WAIT  # nothing unpaid to give back, ever
            self.throttled_ops = (self.throttled_ops + 1) & U64_MASK
            self.delay_us = (self.delay_us + int(wait * 1_000_000)) & U64_MASK
        return Reservation(wait, self, tuple(parts))

    def give_back(self, parts: tuple[tuple[TokenBucket, float, float], ...]) -> None:
        """`Reservation.give_back` (buckets since replaced by `set` take it to no effect)."""
        with self._lock:
            now = self._clock()
            for bucket, cost, until in parts:
                bucket.give_back(cost, until, now)
