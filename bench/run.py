"""`make bench` (`python -m bench.run`): run every benchmark into bench/results/<name>.json."""

from __future__ import annotations

from bench import (
    compute_jobs,
    grpc_unary,
    storage_io,
    tc_rules,
    tcp_dataplane,
    verbs_jobs,
    verbs_write,
)

BENCHES = (grpc_unary, tcp_dataplane, storage_io, compute_jobs, verbs_write, verbs_jobs, tc_rules)


def main() -> int:
    """Run the benchmarks in order."""
    for bench in BENCHES:
        print(f"== {bench.__name__}: {(bench.__doc__ or '').splitlines()[0]}")
        bench.main()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
