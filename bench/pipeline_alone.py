"""The agent's job pipeline alone: what one small capsule job costs in Python.

    python -m bench.pipeline_alone [--jobs N] [--kind crc32c|copy] [--no-inline] [--profile]

Feeds N SUBMIT capsules of 4 KiB jobs to a `Pipeline` over a stub link (no socket, no
device, no other process), 8 per pass with the pass's `end_pass`, and prints the
microseconds per job, best of three rounds: admission, staging, the runner, the
COMPLETION's packing and every pipeline step between. The link completes each send at
the end of its pass, as the tcp link does. What it leaves out (framing, system calls,
the reactor's pass, the SDK) is measured by `bench.hops`; this isolates the part that
is pure Python on one thread, so a change to it can be measured without the noise of
two processes sharing the machine. `--profile` adds cProfile's top functions.

A diagnostic, not a figure of `make bench`: it has no reference outside Python.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time
from typing import TYPE_CHECKING, Any

from dpu_agent.dataplane.pipeline import Pipeline, SessionHooks
from dpu_agent.dataplane.regions import AdvertisedRegion, RegionTable
from dpu_agent.dataplane.staging import Staging
from dpu_wire import capsule
from dpu_wire.capsule import Span
from dpu_wire.jobkinds import FLAG_INLINE, JobKind
from dpu_wire.transport.base import Access

if TYPE_CHECKING:
    from collections.abc import Callable

    from dpu_agent.dataplane.jobs import JobRecord

SIZE = 4096
PER_PASS = 8
HOST_RKEY = 7  # the one host region's rkey (the READ path and copy destinations)


class _Region:
    def __init__(self, size: int) -> None:
        self.view = memoryview(bytearray(size))
        self.addr = 0
        self.length = size
        self.rkey = 1
        self.access = Access.NONE


class _Link:
    """Sends complete at the end of the pass; READs and WRITEs at once."""

    inline_max = SIZE
    error = None
    outstanding = 0

    def __init__(self) -> None:
        self.sink: Pipeline | None = None
        self.sent = 0
        self._done: list[int] = []

    def staging(self, size: int) -> _Region:
        return _Region(size)

    def release(self, _region: object) -> None:
        pass

    def room(self) -> int:
        return 1 << 20

    def post_send(self, _message: bytes, token: int | None = None) -> None:
        self.sent += 1
        if token is not None:
            self._done.append(token)

    def post_read(self, *operands: Any) -> None:  # noqa: ANN401 - ignored
        self._done.append(operands[-1])

    def post_write(self, *operands: Any) -> None:  # noqa: ANN401 - ignored
        if operands[-1] is not None:
            self._done.append(operands[-1])

    def fast_regions(self, _regions: list[tuple[int, int, int]], _sink: object) -> bool:
        """No native core: the bench measures the pipeline's Python."""
        return False

    def flush(self) -> None:
        done, self._done = self._done, []
        assert self.sink is not None  # noqa: S101 - set before the first job
        for token in done:
            self.sink.on_done(token, None)


class _Timer:
    def cancel(self) -> None:
        pass


class _Reactor:
    def wake(self, _link: object) -> None:
        pass

    def call_later(self, _delay: float, _fn: Callable[[], None]) -> _Timer:
        return _Timer()


class _Hooks(SessionHooks):
    def check_accepting(self) -> None:
        pass

    def volume_of(self, _handle: int) -> str | None:
        return None

    def key_of(self, _handle: int) -> bytes | None:
        return None

    def finished(self, _jobs: list[JobRecord]) -> None:
        pass

    def rejected(self) -> None:
        pass


def _pipeline() -> tuple[Pipeline, _Link]:
    link = _Link()
    regions = RegionTable()
    access = Access.REMOTE_READ | Access.REMOTE_WRITE
    regions.add(AdvertisedRegion("host", 0x10000, 1 << 20, HOST_RKEY, access))
    staging = Staging(link, queue_depth=PER_PASS, chunk_size=1 << 20, large=2)  # type: ignore[arg-type]
    pipeline = Pipeline(
        hooks=_Hooks(),
        link=link,  # type: ignore[arg-type]
        reactor=_Reactor(),  # type: ignore[arg-type]
        staging=staging,
        regions=regions,
        storage=None,
        queue_depth=PER_PASS,
        default_deadline=30.0,
    )
    link.sink = pipeline
    return pipeline, link


def _capsules(first_id: int, count: int, kind: JobKind, *, inline: bool) -> list[memoryview]:
    data = os.urandom(SIZE)
    destination = Span(0x10000 + SIZE, SIZE, HOST_RKEY) if kind is JobKind.COPY else Span()
    out = []
    for job_id in range(first_id, first_id + count):
        if inline:
            submit = capsule.pack_submit(
                job_id, kind, Span(0, SIZE, 0), destination, flags=FLAG_INLINE
            )
            out.append(memoryview(submit + data))
        else:
            source = Span(0x10000, SIZE, HOST_RKEY)
            out.append(memoryview(capsule.pack_submit(job_id, kind, source, destination)))
    return out


def _run(pipeline: Pipeline, capsules: list[memoryview]) -> float:
    """Microseconds per job."""
    start = time.perf_counter()
    for at in range(0, len(capsules), PER_PASS):
        for data in capsules[at : at + PER_PASS]:
            pipeline.on_capsule(data)
        pipeline.end_pass()
    return (time.perf_counter() - start) / len(capsules) * 1e6


def main() -> None:
    """Parse the arguments, run three rounds, print the best."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--kind", choices=["crc32c", "copy"], default="crc32c")
    parser.add_argument("--no-inline", action="store_true", help="READ the source")
    parser.add_argument("--profile", action="store_true", help="cProfile a fourth round")
    args = parser.parse_args()
    kind = JobKind.CRC32C if args.kind == "crc32c" else JobKind.COPY
    inline = not args.no_inline
    pipeline, link = _pipeline()
    rounds = []
    for round_ in range(3):
        capsules = _capsules(1 + round_ * args.jobs, args.jobs, kind, inline=inline)
        rounds.append(_run(pipeline, capsules))
    if link.sent != 3 * args.jobs:
        raise SystemExit(f"{link.sent} COMPLETIONs for {3 * args.jobs} jobs")
    failed = pipeline.counters.jobs_failed
    if failed:
        raise SystemExit(f"{failed} jobs failed")
    shape = "inline" if inline else "READ"
    print(
        f"{args.kind} {SIZE} B, {shape} source: {min(rounds):.2f} us per job "
        f"(rounds: {', '.join(f'{r:.2f}' for r in rounds)})"
    )
    if args.profile:
        capsules = _capsules(1 + 3 * args.jobs, args.jobs, kind, inline=inline)
        profile = cProfile.Profile()
        profile.runcall(_run, pipeline, capsules)
        pstats.Stats(profile).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
