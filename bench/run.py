"""`make bench` (`python -m bench.run`): every benchmark, then the report.

Each bench writes bench/results/<name>.json; bench.report then gathers them into
bench/results/report.json, bench/REPORT.md and bench/results/plots/*.png.
"""

from __future__ import annotations

import argparse
import time

from bench import (
    compute_jobs,
    grpc_unary,
    report,
    storage_io,
    tc_rules,
    tcp_dataplane,
    verbs_jobs,
    verbs_write,
)

BENCHES = (grpc_unary, tcp_dataplane, storage_io, compute_jobs, verbs_write, verbs_jobs, tc_rules)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks in order (all, or those named), then write the report."""
    names = {bench.__name__.removeprefix("bench."): bench for bench in BENCHES}
    parser = argparse.ArgumentParser(
        prog="python -m bench.run",
        description=__doc__.splitlines()[0] if __doc__ else None,
        epilog="DPU_BENCH_QUICK=1 makes a smoke run with short durations (marked as such).",
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=sorted(names),
        metavar="NAME",
        help=f"run only this bench (repeatable): {', '.join(names)}; the report still "
        "gathers every result file",
    )
    args = parser.parse_args(argv)
    chosen = [names[name] for name in args.only] if args.only else list(BENCHES)
    started = time.monotonic()
    for bench in chosen:
        print(f"== {bench.__name__}: {(bench.__doc__ or '').splitlines()[0]}")
        start = time.monotonic()
        bench.main()
        print(f"== {bench.__name__}: {time.monotonic() - start:.0f} s")
    print(f"== report (benches took {time.monotonic() - started:.0f} s)")
    report.generate()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
