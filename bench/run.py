"""`make bench` (`python -m bench.run`): every benchmark, then the report.

Each bench writes bench/results/<name>.json; bench.report then gathers them into
bench/results/report.json, bench/REPORT.md and bench/results/plots/*.png.
"""

from __future__ import annotations

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


def main() -> int:
    """Run the benchmarks in order, then write the report."""
    started = time.monotonic()
    for bench in BENCHES:
        print(f"== {bench.__name__}: {(bench.__doc__ or '').splitlines()[0]}")
        start = time.monotonic()
        bench.main()
        print(f"== {bench.__name__}: {time.monotonic() - start:.0f} s")
    print(f"== report (benches took {time.monotonic() - started:.0f} s)")
    report.generate()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
