"""The verbs transport alone vs perftest, on the same rxe port in the same run.

Needs an RDMA device, so it runs in the soft-RoCE test VM:

    python3 deploy/testvm/testvm.py run -- .venv/bin/python -m bench.verbs_write

Started on a machine without RDMA (`python -m bench.verbs_write`, `make bench`), it runs
itself in the VM that way. The VM's checkout is read-only, so the guest writes the
results under .testvm/out/ and the host side copies them to bench/results/.

The transport is driven as the agent drives it (bench.linkbench): the host side is a
`VerbsHostLink` in its own process, the agent side a `VerbsAgentLink` on a real reactor
thread, whose operations are posted from the previous one's completion callback. In
each of the agent's polling modes (`adaptive`, the default, unsuffixed in the figure
names; `busy`; `event`):

1. `transport RDMA WRITE <size> x16`: 16 WRITEs in flight, BW_BYTES in all, at 64 KiB
   and 1 MiB, against `ib_write_bw -t 16` moving as many bytes;
2. `transport 4 KiB WRITE p50` / `p99`: one WRITE in flight, post to completion (a
   full round trip: the responder's ACK included), against `ib_write_lat -s 4096`
   typical and p99 (half a ping-pong round trip);
3. `transport capsule echo p50`: the host sends a 64-byte capsule, the agent SENDs it
   back from its receive callback; the host's round trip, against `ib_send_lat -s 64`
   typical (half a round trip). This is where the modes differ: between two capsules
   the agent has nothing in flight, and in event mode it sleeps on its completion
   channel, where adaptive mode keeps polling for `poll_spin` (2 ms).

While operations are in flight the reactor polls a verbs link in every mode, so the
WRITE figures of the three modes differ only by noise (the old per-mode difference,
an event-channel wake-up per WRITE, no longer exists). And the floor for any Python
caller of this queue pair: `transport 4 KiB WRITE p50` against the same WRITE posted
and polled from plain Python on the link's queue pair, without the reactor, and
`transport RDMA WRITE 64 KiB x16` against the same stream on the bare queue pair.
"""

from __future__ import annotations

import statistics

from bench import common, perftest
from bench.common import TAIL, Result, quick
from bench.linkbench import SPIN, LinkPair

NAME = "verbs_write"
SIZES = (64 << 10, 1 << 20)
STREAM_SIZE = 64 << 10  # the stream also measured against its queue pair alone
IN_FLIGHT = 16
BW_BYTES = quick(
    128 << 20, 16 << 20
)  # per bandwidth measurement: ~3 s at the ~45 MiB/s of rxe under TCG
LAT_SIZE = 4096
LAT_OPS = quick(2000, 200)
ECHO_OPS = quick(1000, 100)
MODES = ("adaptive", "busy", "event")
MIB = float(1 << 20)


def _suffix(mode: str) -> str:
    return "" if mode == "adaptive" else f" ({mode})"


def measure() -> list[Result]:
    """Every figure, each reference measured right before ours."""
    port, client = common.find_port(), common.host_port()
    print(f"agent {port[0]} (GID {port[2]}), host {client[0]} (GID {client[2]}); x{IN_FLIGHT}")
    results: list[Result] = []
    with LinkPair("verbs", IN_FLIGHT, max(SIZES), queue_depth=IN_FLIGHT) as pair:
        for size in SIZES:
            reference = perftest.write_bw(port, size, IN_FLIGHT, BW_BYTES, client=client)
            for mode in MODES:
                pair.reactor.spin = SPIN[mode]
                pair.run([("write", size)], IN_FLIGHT, 4 * IN_FLIGHT)  # warm-up
                run = pair.run([("write", size)], IN_FLIGHT, BW_BYTES // size)
                ours = BW_BYTES / run.elapsed_s / MIB
                print(
                    f"  write {size >> 10} KiB x{IN_FLIGHT}, {mode}: {ours:.1f} MiB/s "
                    f"(ib_write_bw {reference:.1f}), process CPU {run.cpu_s / run.elapsed_s:.2f}"
                )
                results.append(
                    Result(
                        f"transport RDMA WRITE {size >> 10} KiB x{IN_FLIGHT}{_suffix(mode)}",
                        ours,
                        reference,
                        "MiB/s",
                        "ib_write_bw",
                        size=size,
                        series=f"transport RDMA WRITE x{IN_FLIGHT}{_suffix(mode)}",
                    )
                )
        typical, p99 = perftest.write_lat(port, LAT_SIZE, client=client)
        send_typical, _ = perftest.send_lat(port, 64, client=client)
        print(f"  ib_write_lat 4 KiB typical {typical:.1f} us, p99 {p99:.1f} us")
        print(f"  ib_send_lat 64 B typical {send_typical:.1f} us")
        for mode in MODES:
            pair.reactor.spin = SPIN[mode]
            pair.run([("write", LAT_SIZE)], 1, 100)  # warm-up
            run = pair.run([("write", LAT_SIZE)], 1, LAT_OPS)
            pair.echo(50)
            echo = pair.echo(ECHO_OPS)
            echo_p50 = statistics.median(echo) / 1000
            print(
                f"  4 KiB write, {mode}: p50 {run.p(0.5):.0f} us, p99 {run.p(0.99):.0f} us; "
                f"capsule echo p50 {echo_p50:.0f} us"
            )
            results += [
                Result(
                    f"transport 4 KiB WRITE p50{_suffix(mode)}",
                    run.p(0.5),
                    typical,
                    "us",
                    "ib_write_lat typ",
                    higher_is_better=False,
                ),
                Result(
                    f"transport 4 KiB WRITE p99{_suffix(mode)}",
                    run.p(0.99),
                    p99,
                    "us",
                    "ib_write_lat p99",
                    higher_is_better=False,
                    tolerance=TAIL,
                ),
                Result(
                    f"transport capsule echo p50{_suffix(mode)}",
                    echo_p50,
                    send_typical,
                    "us",
                    "ib_send_lat 64 B typ",
                    higher_is_better=False,
                ),
            ]
        pair.reactor.spin = SPIN["adaptive"]
        ours_p50 = pair.run([("write", LAT_SIZE)], 1, LAT_OPS).p(0.5)
        stream = STREAM_SIZE
        ours_stream = pair.run([("write", stream)], IN_FLIGHT, BW_BYTES // stream).elapsed_s
        pair.detach()
        raw = pair.raw_write_floor(LAT_SIZE, LAT_OPS)
        raw_p50 = statistics.median(raw) / 1000
        raw_stream = pair.raw_write_stream(stream, BW_BYTES // stream, IN_FLIGHT)
        print(f"  4 KiB write p50 {ours_p50:.0f} us; its QP alone {raw_p50:.0f} us")
        print(
            f"  write {stream >> 10} KiB x{IN_FLIGHT} {BW_BYTES / ours_stream / MIB:.1f} MiB/s; "
            f"its QP alone {BW_BYTES / raw_stream / MIB:.1f} MiB/s"
        )
        results += [
            Result(
                "transport 4 KiB WRITE p50, vs its queue pair alone",
                ours_p50,
                raw_p50,
                "us",
                "the link's QP posted and polled from plain Python",
                higher_is_better=False,
            ),
            Result(
                f"transport RDMA WRITE {stream >> 10} KiB x{IN_FLIGHT}, vs its queue pair alone",
                BW_BYTES / ours_stream / MIB,
                BW_BYTES / raw_stream / MIB,
                "MiB/s",
                "the link's QP posted and polled from plain Python",
            ),
        ]
    return results


def main() -> list[Result]:
    """Measure here when there is an RDMA device, else in the soft-RoCE test VM."""
    return common.run_rdma_bench(NAME, measure)


if __name__ == "__main__":
    common.command_line(__doc__)
    main()
