"""The benchmark report: every bench/results/*.json in one JSON, a Markdown table and plots.

    python -m bench.report                      # after the benches (`make bench` runs it)
    python -m bench.report --compare OLD NEW    # is NEW a rerun of OLD within noise?

Generic over the result files that `bench.common.write_results` writes (any
`{"bench", "machine", "time", "results": [...]}` document in bench/results/, so a new
bench module needs nothing here). It writes

- bench/results/report.json: every figure with its ratio (ours / reference, inverted
  for latencies so that > 1 is always better than the reference), each bench's machine
  and time, the host and test-VM machines, the git commit, the date;
- bench/REPORT.md: per bench a table (figure, ours, reference, ratio, units, previous
  run, notes) and the bench's own tables (measurements without a reference, such as a
  job's per-hop timeline), the machines (with the speed of Python during each bench:
  its 10**7-step loop), and the plots;
- bench/results/plots/*.png: the ratio of every figure (with the previous run's), and for
  each bench with a size sweep (results with `size` and `series`), ours and the
  reference against the message size.

A regenerated report keeps the one before it as bench/results/report.previous.json when
the bench results differ (their times), and compares with it.

"Within noise": two runs' ratios of a figure differ by at most a factor 1 + tolerance
either way, the tolerance being the figure's own (bench.common.NOISE unless the bench
says otherwise; TAIL, i.e. None, for p99 latencies, which are not compared: see there).
The ratio is what is compared, not the absolute figures: both sides of a ratio see
roughly the same machine load, which is the point of a same-run reference on shared
cores. Roughly: they are measured one after the other, so a bench whose 5-minute load
average exceeded its CPUs (recorded by bench.machine, for a VM bench also the host's)
is marked overloaded in REPORT.md and by --compare, and its figures are not expected to
match a rerun.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench import machine, plots
from bench.common import NOISE

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

BENCH_DIR = Path(__file__).resolve().parent
CHECKOUT = BENCH_DIR.parent
RESULTS = BENCH_DIR / "results"
REPORT_JSON = "report.json"
PREVIOUS_JSON = "report.previous.json"
REPORT_MD = BENCH_DIR / "REPORT.md"
SCHEMA = 1

MACHINE_LABELS = {"host": "host", "test_vm": "test VM"}

WITHIN = "within noise"
OUTSIDE = "OUTSIDE noise"
UNCHECKED = "not compared"
NEW = "new"
GONE = "gone"


@dataclasses.dataclass(frozen=True)
class Figure:
    """One headline figure of one bench, as the report reads it from a result file."""

    bench: str
    name: str
    ours: float
    reference: float
    unit: str
    reference_name: str
    higher_is_better: bool
    ratio: float | None
    tolerance: float | None
    size: int | None = None
    series: str | None = None
    note: str | None = None

    @property
    def key(self) -> tuple[str, str]:
        """What identifies the figure across runs."""
        return self.bench, self.name

    @property
    def label(self) -> str:
        """`bench: name`."""
        return f"{self.bench}: {self.name}"


@dataclasses.dataclass(frozen=True)
class Change:
    """A figure's ratio in two runs, and whether the difference is noise."""

    key: tuple[str, str]
    old: float | None
    new: float | None
    tolerance: float | None
    verdict: str

    @property
    def relative(self) -> float | None:
        """The relative change new / old - 1, or None when one side is missing."""
        if self.old is None or self.new is None or self.old == 0:
            return None
        return self.new / self.old - 1


# ---------------------------------------------------------------- reading


def ratio_of(ours: float, reference: float, *, higher_is_better: bool) -> float | None:
    """The ratio ours / reference, inverted when lower is better (None: not positive)."""
    if ours <= 0 or reference <= 0 or not math.isfinite(ours) or not math.isfinite(reference):
        return None
    return ours / reference if higher_is_better else reference / ours


def figure_from_row(bench: str, row: dict[str, Any]) -> Figure:
    """A Figure from one entry of a result file's `results` (or a report's `figures`)."""
    ours, reference = float(row["ours"]), float(row["reference"])
    higher = bool(row.get("higher_is_better", True))
    ratio = ratio_of(ours, reference, higher_is_better=higher)
    if ratio is None and row.get("ratio") is not None:
        ratio = float(row["ratio"])
    tolerance = row.get("tolerance", NOISE)
    size = row.get("size")
    return Figure(
        bench=bench,
        name=str(row["name"]),
        ours=ours,
        reference=reference,
        unit=str(row.get("unit", "")),
        reference_name=str(row.get("reference_name", "")),
        higher_is_better=higher,
        ratio=ratio,
        tolerance=None if tolerance is None else float(tolerance),
        size=None if size is None else int(size),
        series=row.get("series"),
        note=row.get("note"),
    )


def is_bench_result(doc: object) -> bool:
    """Whether a JSON document is a bench result file."""
    return (
        isinstance(doc, dict)
        and isinstance(doc.get("bench"), str)
        and isinstance(doc.get("results"), list)
    )


def read_bench_results(results_dir: Path) -> list[dict[str, Any]]:
    """Every bench result document in `results_dir`, by bench name (others are skipped)."""
    docs = []
    for path in sorted(results_dir.glob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            print(f"report: skipping {path.name}: {exc}", file=sys.stderr)
            continue
        if is_bench_result(doc):
            docs.append(doc)
    return sorted(docs, key=lambda d: str(d["bench"]))


def figures_of(doc: dict[str, Any]) -> list[Figure]:
    """The figures of a report document or of one bench result document."""
    if "figures" in doc:
        return [figure_from_row(str(row["bench"]), row) for row in doc["figures"]]
    if is_bench_result(doc):
        return [figure_from_row(str(doc["bench"]), row) for row in doc["results"]]
    raise ValueError("neither a bench report nor a bench result file")


def load_figures(path: Path) -> list[Figure]:
    """The figures of a report.json or of one bench result file."""
    return figures_of(json.loads(path.read_text()))


# ---------------------------------------------------------------- comparing


def within(old: float, new: float, tolerance: float) -> bool:
    """Whether two positive ratios differ by at most a factor 1 + tolerance either way."""
    return max(old, new) / min(old, new) <= 1 + tolerance + 1e-9


def compare(old: Iterable[Figure], new: Iterable[Figure]) -> list[Change]:
    """Each figure's ratio in `old` and `new`, in the order of `new` (then gone ones).

    The tolerance is the new run's (the old one's for a figure that is gone).
    """
    before = {f.key: f for f in old}
    after = {f.key: f for f in new}
    changes = []
    for key, figure in after.items():
        prior = before.get(key)
        tolerance = figure.tolerance
        if prior is None:
            verdict = NEW
        elif tolerance is None or prior.ratio is None or figure.ratio is None:
            verdict = UNCHECKED
        else:
            verdict = WITHIN if within(prior.ratio, figure.ratio, tolerance) else OUTSIDE
        changes.append(
            Change(key, prior.ratio if prior else None, figure.ratio, tolerance, verdict)
        )
    changes += [
        Change(key, figure.ratio, None, figure.tolerance, GONE)
        for key, figure in before.items()
        if key not in after
    ]
    return changes


def format_ratio(value: float | None) -> str:
    """`0.467x`, three significant digits."""
    return "n/a" if value is None else f"{value:.3g}x"


def format_tolerance(tolerance: float | None) -> str:
    """`x1.5` (the factor either way), or `-` when not compared."""
    return "-" if tolerance is None else f"x{1 + tolerance:.3g}"


def format_change(change: Change) -> str:
    """`+12%` or `-5.3%`, or the verdict when there is no number."""
    relative = change.relative
    if relative is None:
        return change.verdict
    return f"{relative * 100:+.0f}%" if abs(relative) >= 0.1 else f"{relative * 100:+.1f}%"


def compare_table(changes: Sequence[Change]) -> str:
    """The comparison as aligned text, with a summary line."""
    rows = [("figure", "old ratio", "new ratio", "change", "tolerance", "verdict")]
    rows += [
        (
            f"{c.key[0]}: {c.key[1]}",
            format_ratio(c.old),
            format_ratio(c.new),
            format_change(c),
            format_tolerance(c.tolerance),
            c.verdict,
        )
        for c in changes
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(line.rstrip() for line in lines) + "\n" + summary(changes) + "\n"


def summary(changes: Sequence[Change]) -> str:
    """`N within noise, M OUTSIDE noise, ...` over the verdicts that occur."""
    counts = {v: sum(c.verdict == v for c in changes) for v in (WITHIN, OUTSIDE, UNCHECKED)}
    counts |= {v: sum(c.verdict == v for c in changes) for v in (NEW, GONE)}
    parts = [f"{n} {verdict}" for verdict, n in counts.items() if n or verdict == OUTSIDE]
    return ", ".join(parts) + f" (of {len(changes)} figures)"


# ---------------------------------------------------------------- building


def run_id(doc: dict[str, Any]) -> list[list[str]]:
    """What tells two runs apart: each bench and the time its results were written."""
    return sorted([str(b["bench"]), str(b.get("time"))] for b in doc.get("benches", []))


def build(bench_docs: Sequence[dict[str, Any]], checkout: Path) -> dict[str, Any]:
    """The report document over the bench result documents."""
    benches = []
    figures = []
    for doc in bench_docs:
        bench = str(doc["bench"])
        benches.append(
            {
                "bench": bench,
                "time": doc.get("time"),
                "machine": doc.get("machine", {}),
                "tables": doc.get("tables") or [],
                "quick": bool(doc.get("quick")),
            }
        )
        for row in doc["results"]:
            figure = figure_from_row(bench, row)
            extra = {k: v for k, v in row.items() if k not in _FIGURE_FIELDS}
            figures.append({**dataclasses.asdict(figure), **extra})
    return {
        "schema": SCHEMA,
        "generated": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "git": machine.git_state(checkout),
        "machine": machines(benches),
        "benches": benches,
        "figures": figures,
    }


_FIGURE_FIELDS = {field.name for field in dataclasses.fields(Figure)} | {"ratio"}


def machines(benches: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The machines the benches ran on, by where: `host` (this one when none ran here)."""
    found: dict[str, Any] = {}
    for bench in benches:
        described = bench["machine"]
        where = "test_vm" if "VM" in str(described.get("where", "")) else "host"
        if "where" in described:
            found.setdefault(where, described)
    found.setdefault("host", machine.describe())
    return found


# ---------------------------------------------------------------- Markdown


def format_value(value: float) -> str:
    """A measured value with as many digits as mean anything."""
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}"


def overload(described: dict[str, Any]) -> str | None:
    """Why a bench's figures are not comparable: its 5-minute load was above its CPUs.

    Checks the machine that measured and, for a bench run in the test VM, the host
    (`machine.host`, added when the host copied the guest's results).
    """
    for who, record in (("", described), ("host ", described.get("host") or {})):
        load, cpus = record.get("load_average"), record.get("cpus")
        if isinstance(load, list) and len(load) > 1 and isinstance(cpus, int) and load[1] > cpus:
            return f"{who}5-min load {load[1]:.1f} on {cpus} CPUs"
    return None


def overload_notes(doc: dict[str, Any]) -> list[str]:
    """`bench: 5-min load ...` for each bench of a report that ran overloaded."""
    benches = doc.get("benches") or ([doc] if is_bench_result(doc) else [])
    notes = []
    for bench in benches:
        why = overload(bench.get("machine") or {})
        if why:
            notes.append(f"{bench['bench']}: {why}")
    return notes


def describe_machine(described: dict[str, Any]) -> str:
    """One line: CPU, cores, memory, kernel, OS, Python, the RDMA topology, versions."""
    memory = described.get("memory_mib")
    versions = described.get("versions") or {}
    parts = [
        described.get("cpu_model"),
        f"{described['cpus']} CPUs" if described.get("cpus") else None,
        f"{memory / 1024:.1f} GiB" if isinstance(memory, int) else None,
        f"kernel {described['kernel']}" if described.get("kernel") else None,
        described.get("os"),
        f"Python {described['python']}" if described.get("python") else None,
        f"RDMA: {described['rdma_topology']}" if described.get("rdma_topology") else None,
        _loop_text(described),
        *(f"{name} {version}" for name, version in versions.items() if version),
    ]
    return "; ".join(str(part) for part in parts if part)


def _loop_text(described: dict[str, Any]) -> str | None:
    loop = described.get("python_loop_s")
    return f"10^7-step Python loop {loop:.2f} s" if isinstance(loop, int | float) else None


def notes(figure: Figure) -> str:
    """The reference, which way is better, the tolerance between runs, the figure's note."""
    better = "higher is better" if figure.higher_is_better else "lower is better"
    tolerance = (
        "not compared between runs (tail latency)"
        if figure.tolerance is None
        else f"noise x{1 + figure.tolerance:.3g}"
    )
    note = f"; {figure.note}" if figure.note else ""
    return f"vs {figure.reference_name}; {better}; {tolerance}{note}"


def table_markdown(table: dict[str, Any]) -> list[str]:
    """A bench's own table (title, columns, rows) as Markdown lines."""
    columns = [str(c) for c in table.get("columns") or []]
    if not columns:
        return []
    lines = ["", f"{table.get('title', '')}", "", "| " + " | ".join(columns) + " |"]
    lines.append("|" + "|".join("---" for _ in columns) + "|")
    for row in table.get("rows") or []:
        cells = [format_value(c) if isinstance(c, float) else str(c) for c in row]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def markdown(
    report: dict[str, Any],
    changes: dict[tuple[str, str], Change],
    plot_paths: Sequence[Path],
    md_dir: Path,
) -> str:
    """REPORT.md: machines, one table per bench, the plots."""
    git = report["git"]
    commit = git.get("commit") or "unknown"
    dirty = " (with uncommitted changes)" if git.get("dirty") else ""
    lines = [
        "# Benchmark report",
        "",
        "Written by `make bench` (`python -m bench.report`) from `bench/results/*.json`;",
        "the data is in `bench/results/report.json`. Each ratio is ours / reference,",
        "both measured in the same run (inverted for latencies: above 1 is better than",
        "the reference). *Previous run* is the ratio's change since",
        "`bench/results/report.previous.json`; `python -m bench.report --compare OLD NEW`",
        "checks two runs against each figure's tolerance.",
        "",
        f"- generated {report['generated']} at commit `{commit[:12]}`{dirty}",
    ]
    lines += [
        f"- {MACHINE_LABELS.get(where, where)}: {describe_machine(described)}"
        for where, described in report["machine"].items()
    ]
    if changes:
        values = list(changes.values())
        lines.append(f"- against the previous run: {summary(values)}")
    lines += [f"- **overloaded**: {note}" for note in overload_notes(report)]
    quick = [str(b["bench"]) for b in report["benches"] if b.get("quick")]
    if quick:
        lines.append(
            f"- **smoke run** (DPU_BENCH_QUICK=1, short, not official): {', '.join(quick)}"
        )
    for bench in report["benches"]:
        name = bench["bench"]
        where = bench["machine"].get("where", "where not recorded")
        lines += [
            "",
            f"## {name}",
            "",
            f"Run {bench['time']}, {where}, kernel {bench['machine'].get('kernel', '?')}"
            + _load_note(bench["machine"])
            + (" **Smoke run** (short durations)." if bench.get("quick") else ""),
            "",
            "| figure | ours | reference | ratio | units | previous run | notes |",
            "|---|---:|---:|---:|---|---|---|",
        ]
        for row in report["figures"]:
            if row["bench"] != name:
                continue
            figure = figure_from_row(name, row)
            change = changes.get(figure.key)
            previous = "" if change is None else _previous_cell(change)
            lines.append(
                f"| {figure.name} | {format_value(figure.ours)} | "
                f"{format_value(figure.reference)} | {format_ratio(figure.ratio)} | "
                f"{figure.unit} | {previous} | {notes(figure)} |"
            )
        for table in bench.get("tables") or []:
            lines += table_markdown(table)
    if plot_paths:
        lines += ["", "## Plots", ""]
        lines += [f"![{p.stem}]({os.path.relpath(p, md_dir)})" for p in plot_paths]
    return "\n".join(lines) + "\n"


def _load_note(described: dict[str, Any]) -> str:
    loop = _loop_text(described)
    speed = f", {loop}" if loop else ""
    why = overload(described)
    if why:
        return f"{speed}. **Overloaded** ({why}): other work shared the CPUs, not comparable."
    load = described.get("load_average")
    if isinstance(load, list) and len(load) > 1:
        return f", 5-min load {load[1]:.1f}{speed}."
    return f"{speed}."


def _previous_cell(change: Change) -> str:
    if change.verdict == NEW:
        return "new"
    mark = {WITHIN: "", OUTSIDE: " **outside noise**", UNCHECKED: ""}[change.verdict]
    return f"{format_ratio(change.old)} ({format_change(change)}){mark}"


# ---------------------------------------------------------------- the run


def generate(
    results_dir: Path = RESULTS, report_md: Path = REPORT_MD, checkout: Path = CHECKOUT
) -> dict[str, Any]:
    """Write report.json (keeping the previous one), REPORT.md and the plots."""
    docs = read_bench_results(results_dir)
    if not docs:
        raise SystemExit(f"report: no bench results in {results_dir}; run `make bench`")
    report = build(docs, checkout)
    current, previous = results_dir / REPORT_JSON, results_dir / PREVIOUS_JSON
    if current.exists():
        try:
            old = json.loads(current.read_text())
        except ValueError:
            old = None
        if isinstance(old, dict) and run_id(old) != run_id(report):
            current.replace(previous)
    prior = figures_of(json.loads(previous.read_text())) if previous.exists() else []
    new = figures_of(report)
    changes = {c.key: c for c in compare(prior, new) if c.verdict != GONE} if prior else {}

    plots_dir = results_dir / "plots"
    plots_dir.mkdir(exist_ok=True)
    previous_ratios = {k: c.old for k, c in changes.items() if c.old is not None}
    written = [plots.ratio_chart(new, previous_ratios, plots_dir / "ratios.png")]
    written += plots.sweep_charts(new, plots_dir)
    for stale in set(plots_dir.glob("*.png")) - set(written):
        stale.unlink()
    report["plots"] = [str(p.relative_to(results_dir)) for p in written]

    current.write_text(json.dumps(report, indent=2) + "\n")
    report_md.write_text(markdown(report, changes, written, report_md.parent))
    print(f"report: {current}, {report_md}, {len(written)} plots in {plots_dir}")
    if changes:
        print("against the previous run: " + summary(list(changes.values())))
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m bench.report [--compare OLD NEW]`."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.report",
        description="Gather bench/results/*.json into bench/results/report.json, "
        "bench/REPORT.md and PNG plots; or compare two runs.",
    )
    parser.add_argument(
        "--compare",
        nargs=2,
        metavar=("OLD", "NEW"),
        type=Path,
        help="compare two report.json (or bench result) files figure by figure: exit 1 "
        "if a ratio moved by more than its tolerance",
    )
    parser.add_argument("--results", type=Path, default=RESULTS, help="%(default)s")
    parser.add_argument("--markdown", type=Path, default=REPORT_MD, help="%(default)s")
    args = parser.parse_args(argv)
    if args.compare:
        old, new = args.compare
        old_doc, new_doc = json.loads(old.read_text()), json.loads(new.read_text())
        changes = compare(figures_of(old_doc), figures_of(new_doc))
        print(compare_table(changes), end="")
        for label, doc in (("OLD", old_doc), ("NEW", new_doc)):
            for note in overload_notes(doc):
                print(f"note: {label} ran overloaded, {note}: its figures are not comparable")
        return 1 if any(c.verdict == OUTSIDE for c in changes) else 0
    generate(args.results, args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
