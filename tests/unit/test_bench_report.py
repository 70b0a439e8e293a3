"""bench/report.py on small synthetic result files: parsing, ratios, comparison, output."""

from __future__ import annotations

import json
import platform
import struct
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from bench import common, machine, plots, report
from bench.common import NOISE, TAIL, Result

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def row(name: str, ours: float, reference: float, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "ours": ours,
        "reference": reference,
        "unit": extra.pop("unit", "MB/s"),
        "reference_name": extra.pop("reference_name", "the reference"),
        "higher_is_better": extra.pop("higher_is_better", True),
        **extra,
    }


def bench_doc(bench: str, rows: list[dict[str, Any]], time: str = "2026-01-01T00:00:00Z"):
    return {
        "bench": bench,
        "machine": {"where": "host", "kernel": "6.1.0-test", "cpus": 2, "cpu_model": "Test CPU"},
        "time": time,
        "results": rows,
    }


def write(path: Path, doc: object) -> Path:
    path.write_text(json.dumps(doc))
    return path


def figure(name: str, ratio: float | None, tolerance: float | None = NOISE) -> report.Figure:
    return report.Figure(
        bench="b",
        name=name,
        ours=1.0,
        reference=1.0,
        unit="MB/s",
        reference_name="ref",
        higher_is_better=True,
        ratio=ratio,
        tolerance=tolerance,
    )


def assert_valid_png(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 100
    assert height > 100
    with Image.open(path) as image:
        image.verify()  # raises on a truncated or corrupt file
    return width, height


@pytest.fixture
def sweep_results(tmp_path: Path) -> Path:
    results = tmp_path / "results"
    results.mkdir()
    sweep = [
        row(f"write {label}", ours, ref, size=size, series="write")
        for label, size, ours, ref in (("4 KiB", 4096, 100.0, 400.0), ("1 MiB", 1 << 20, 900, 1000))
    ]
    latency = row("4 KiB p99", 2000.0, 100.0, unit="us", higher_is_better=False, tolerance=None)
    write(results / "alpha.json", bench_doc("alpha", [*sweep, latency]))
    write(results / "beta.json", bench_doc("beta", [row("calls", 50.0, 100.0, unit="calls/s")]))
    write(results / "notes.json", {"something": "else"})  # not a bench result: skipped
    (results / "broken.json").write_text("{")  # unreadable: skipped with a message
    return results


# ---------------------------------------------------------------- reading


def test_ratio_is_ours_over_reference_and_inverted_for_latencies():
    assert report.ratio_of(50, 100, higher_is_better=True) == 0.5
    assert report.ratio_of(2000, 100, higher_is_better=False) == 0.05
    assert report.ratio_of(0, 100, higher_is_better=True) is None
    assert report.ratio_of(10, 0, higher_is_better=False) is None


def test_figures_from_rows_fill_the_defaults():
    plain = report.figure_from_row("b", {"name": "x", "ours": 3, "reference": 4, "unit": "IOPS"})
    assert plain.ratio == 0.75
    assert plain.higher_is_better
    assert plain.tolerance == NOISE
    assert plain.size is None
    assert plain.series is None
    tail = report.figure_from_row("b", row("p99", 10, 5, higher_is_better=False, tolerance=None))
    assert tail.ratio == 0.5
    assert tail.tolerance is None
    swept = report.figure_from_row("b", row("w 64 KiB", 1, 2, size=65536, series="w"))
    assert (swept.size, swept.series) == (65536, "w")


def test_a_stored_ratio_is_used_only_when_it_cannot_be_computed():
    assert report.figure_from_row("b", row("x", 0, 5, ratio=0.25)).ratio == 0.25
    assert report.figure_from_row("b", row("x", 1, 4, ratio=9.0)).ratio == 0.25


def test_only_bench_result_files_are_read(sweep_results: Path, capsys):
    docs = report.read_bench_results(sweep_results)
    assert [d["bench"] for d in docs] == ["alpha", "beta"]
    assert "broken.json" in capsys.readouterr().err


def test_write_results_round_trips_through_the_report(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.delenv("DPU_TESTVM", raising=False)
    results = [
        Result("w 64 KiB", 10, 20, "MiB/s", "ib_write_bw", size=65536, series="w"),
        Result("p99", 40, 10, "us", "ib_write_lat p99", higher_is_better=False, tolerance=TAIL),
    ]
    path = common.write_results("synthetic", results)
    doc = json.loads(path.read_text())
    assert doc["machine"]["where"] == "host"
    assert doc["machine"]["kernel"] == platform.release()
    assert "grpcio" in doc["machine"]["versions"]
    assert len(doc["machine"]["load_average"]) == 3
    figures = report.load_figures(path)
    assert [(f.name, f.ratio, f.size, f.series, f.tolerance) for f in figures] == [
        ("w 64 KiB", 0.5, 65536, "w", NOISE),
        ("p99", 0.25, None, None, None),
    ]


def test_the_machine_says_when_it_is_the_test_vm(monkeypatch):
    monkeypatch.setenv("DPU_TESTVM", "1")
    assert "VM" in str(machine.describe()["where"])


# ---------------------------------------------------------------- comparing


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [(1.0, 1.5, True), (1.5, 1.0, True), (1.0, 1.51, False), (0.2, 0.1, False), (0.3, 0.3, True)],
)
def test_within_is_a_factor_either_way(old, new, expected):
    assert report.within(old, new, 0.5) is expected


def test_compare_gives_each_figure_a_verdict():
    old = [figure("same", 0.5), figure("moved", 0.5), figure("tail", 0.1, None), figure("gone", 1)]
    new = [figure("same", 0.6), figure("moved", 0.2), figure("tail", 0.9, None), figure("new", 1)]
    changes = {c.key[1]: c for c in report.compare(old, new)}
    assert changes["same"].verdict == report.WITHIN
    assert changes["same"].relative == pytest.approx(0.2)
    assert changes["moved"].verdict == report.OUTSIDE
    assert changes["moved"].relative == pytest.approx(-0.6)
    assert changes["tail"].verdict == report.UNCHECKED
    assert changes["new"].verdict == report.NEW
    assert changes["new"].relative is None
    assert changes["gone"].verdict == report.GONE
    assert list(changes) == ["same", "moved", "tail", "new", "gone"]


def test_compare_cli_fails_only_when_a_figure_is_outside_its_tolerance(tmp_path: Path, capsys):
    old = write(tmp_path / "old.json", bench_doc("b", [row("x", 50, 100), row("y", 10, 100)]))
    close = write(tmp_path / "close.json", bench_doc("b", [row("x", 60, 100), row("y", 10, 100)]))
    far = write(tmp_path / "far.json", bench_doc("b", [row("x", 50, 100), row("y", 40, 100)]))
    assert report.main(["--compare", str(old), str(close)]) == 0
    out = capsys.readouterr().out
    assert "b: x" in out
    assert "+20%" in out
    assert "2 within noise, 0 OUTSIDE noise" in out
    assert report.main(["--compare", str(old), str(far)]) == 1
    out = capsys.readouterr().out
    assert "+300%" in out
    assert "1 OUTSIDE noise" in out


# ---------------------------------------------------------------- the report


def test_generate_writes_json_markdown_and_plots(sweep_results: Path, tmp_path: Path):
    md = tmp_path / "REPORT.md"
    report.generate(sweep_results, md, checkout=tmp_path)
    doc = json.loads((sweep_results / "report.json").read_text())
    assert doc["git"] == {"commit": None, "dirty": None}  # tmp_path is no git checkout
    assert doc["machine"]["host"]["cpu_model"] == "Test CPU"
    assert [(f["bench"], f["name"], f["ratio"]) for f in doc["figures"]] == [
        ("alpha", "write 4 KiB", 0.25),
        ("alpha", "write 1 MiB", 0.9),
        ("alpha", "4 KiB p99", 0.05),
        ("beta", "calls", 0.5),
    ]
    assert doc["plots"] == ["plots/ratios.png", "plots/sweep-alpha.png"]  # beta has no sweep
    for plot in doc["plots"]:
        assert_valid_png(sweep_results / plot)
    text = md.read_text()
    assert "| write 4 KiB | 100 | 400 | 0.25x | MB/s |  | vs the reference; higher" in text
    assert "| 4 KiB p99 | 2,000 | 100 | 0.05x | us |" in text
    assert "not compared between runs" in text
    assert "kernel 6.1.0-test" in text
    assert "![sweep-alpha](results/plots/sweep-alpha.png)" in text
    assert not (sweep_results / "report.previous.json").exists()


def test_a_new_run_keeps_the_previous_report_and_shows_the_change(
    sweep_results: Path, tmp_path: Path
):
    md = tmp_path / "REPORT.md"
    report.generate(sweep_results, md, checkout=tmp_path)
    first = json.loads((sweep_results / "report.json").read_text())
    report.generate(sweep_results, md, checkout=tmp_path)  # same results: nothing to keep
    assert not (sweep_results / "report.previous.json").exists()

    rerun = bench_doc("beta", [row("calls", 20.0, 100.0, unit="calls/s")], "2026-01-02T00:00:00Z")
    write(sweep_results / "beta.json", rerun)
    (sweep_results / "plots" / "sweep-gone.png").write_bytes(PNG_SIGNATURE)
    report.generate(sweep_results, md, checkout=tmp_path)

    previous = json.loads((sweep_results / "report.previous.json").read_text())
    assert (previous["benches"], previous["figures"]) == (first["benches"], first["figures"])
    assert not (sweep_results / "plots" / "sweep-gone.png").exists()  # stale plots go
    text = md.read_text()
    assert "| calls | 20.0 | 100 | 0.2x | calls/s | 0.5x (-60%) **outside noise** |" in text
    assert "| write 1 MiB | 900 | 1,000 | 0.9x | MB/s | 0.9x (+0.0%) |" in text
    assert "2 within noise, 1 OUTSIDE noise, 1 not compared (of 4 figures)" in text
    assert_valid_png(sweep_results / "plots" / "ratios.png")


def test_no_results_is_an_error(tmp_path: Path):
    with pytest.raises(SystemExit, match="no bench results"):
        report.generate(tmp_path, tmp_path / "REPORT.md", checkout=tmp_path)


@pytest.mark.parametrize(
    ("size", "label"), [(512, "512 B"), (4096, "4 KiB"), (1 << 20, "1 MiB"), (3 << 29, "1.5 GiB")]
)
def test_size_labels(size, label):
    assert plots.size_label(size) == label


def test_a_run_under_load_is_marked_not_comparable(tmp_path: Path, capsys):
    results = tmp_path / "results"
    results.mkdir()
    quiet = bench_doc("quiet", [row("x", 1, 2)])
    quiet["machine"] |= {"load_average": [0.4, 0.5, 0.6]}
    busy = bench_doc("busy", [row("y", 1, 2)])
    busy["machine"] |= {"load_average": [9.0, 8.0, 3.0]}
    in_vm = bench_doc("in_vm", [row("z", 1, 2)])
    in_vm["machine"] |= {
        "where": "test VM (QEMU TCG)",
        "load_average": [1.0, 1.0, 1.0],
        "host": {"load_average": [6.0, 5.5, 2.0], "cpus": 2},
    }
    for doc in (quiet, busy, in_vm):
        write(results / f"{doc['bench']}.json", doc)
    md = tmp_path / "REPORT.md"
    report.generate(results, md, checkout=tmp_path)
    text = md.read_text()
    assert "kernel 6.1.0-test, 5-min load 0.5." in text
    assert "**Overloaded** (5-min load 8.0 on 2 CPUs)" in text
    assert "**Overloaded** (host 5-min load 5.5 on 2 CPUs)" in text
    assert "- **overloaded**: busy: 5-min load 8.0 on 2 CPUs" in text
    doc = json.loads((results / "report.json").read_text())
    assert doc["machine"]["test_vm"]["where"] == "test VM (QEMU TCG)"
    capsys.readouterr()

    path = str(results / "report.json")
    assert report.main(["--compare", path, path]) == 0
    out = capsys.readouterr().out
    assert "note: NEW ran overloaded, busy: 5-min load 8.0 on 2 CPUs" in out
    assert "note: OLD ran overloaded, in_vm: host 5-min load 5.5 on 2 CPUs" in out
    assert "quiet" not in out.split("of 3 figures")[1]


def test_tables_notes_python_speed_and_smoke_runs_reach_the_report(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(common, "QUICK", True)
    monkeypatch.delenv("DPU_TESTVM", raising=False)
    results = [Result("jobs", 10, 40, "MiB/s", "the lower limit", note="library 40, wire 90")]
    hops = common.Table("Hops of a job", ["side", "hop", "p50 us"], [["host", "submit", 12.5]])
    path = common.write_results("gamma", results, [hops])
    doc = json.loads(path.read_text())
    assert doc["quick"] is True
    assert doc["machine"]["python_loop_s"] > 0
    assert doc["tables"] == [
        {
            "title": "Hops of a job",
            "columns": ["side", "hop", "p50 us"],
            "rows": [["host", "submit", 12.5]],
        }
    ]
    plain = bench_doc("delta", [row("x", 1, 2)])
    write(tmp_path / "delta.json", plain)
    md = tmp_path / "REPORT.md"
    report.generate(tmp_path, md, checkout=tmp_path)
    text = md.read_text()
    assert "| jobs | 10.0 | 40.0 | 0.25x | MiB/s |  | vs the lower limit; higher is better;" in text
    assert "noise x1.5; library 40, wire 90 |" in text
    assert (
        "Hops of a job\n\n| side | hop | p50 us |\n|---|---|---|\n| host | submit | 12.5 |" in text
    )
    assert "10^7-step Python loop" in text
    assert "- **smoke run** (DPU_BENCH_QUICK=1, short, not official): gamma\n" in text
    assert text.count("**Smoke run**") == 1  # gamma's section only, not delta's
    figures = report.load_figures(tmp_path / "report.json")
    assert [(f.bench, f.note) for f in figures] == [
        ("delta", None),
        ("gamma", "library 40, wire 90"),
    ]


def test_quick_picks_the_short_value_only_in_a_smoke_run(monkeypatch):
    monkeypatch.setattr(common, "QUICK", False)
    assert common.quick(2000, 200) == 2000
    monkeypatch.setattr(common, "QUICK", True)
    assert common.quick(2000, 200) == 200


def test_bench_run_help_runs_nothing_and_an_unknown_bench_is_refused(monkeypatch, capsys):
    from bench import run  # noqa: PLC0415 - the command line under test

    ran: list[str] = []
    for bench in run.BENCHES:
        monkeypatch.setattr(bench, "main", lambda name=bench.__name__: ran.append(name))
    monkeypatch.setattr(report, "generate", lambda: ran.append("report"))
    with pytest.raises(SystemExit) as exited:
        run.main(["--help"])
    assert exited.value.code == 0
    assert "--only" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exited:
        run.main(["--only", "no_such_bench"])
    assert exited.value.code == 2
    assert ran == []
    assert run.main(["--only", "tc_rules", "--only", "grpc_unary"]) == 0
    assert ran == ["bench.tc_rules", "bench.grpc_unary", "report"]


BENCHES_WITHOUT_OPTIONS = (
    "compute_jobs",
    "grpc_unary",
    "storage_design",
    "storage_io",
    "tc_layouts",
    "tc_rules",
    "tcp_dataplane",
    "verbs_jobs",
    "verbs_write",
)


@pytest.mark.parametrize("name", BENCHES_WITHOUT_OPTIONS)
def test_a_bench_asked_for_help_prints_it_and_runs_nothing(name: str, monkeypatch, capsys):
    """`python -m bench.<name> --help` describes the bench and exits before it runs
    (it used to run the whole bench and overwrite its results file)."""
    module = __import__(f"bench.{name}", fromlist=["main"])
    ran: list[bool] = []
    monkeypatch.setattr(module, "main", lambda: ran.append(True))
    monkeypatch.setattr("sys.argv", [f"{name}.py", "--help"])
    path, doc = str(module.__file__), str(module.__doc__)
    source = Path(path).read_text()
    main_block = source[source.index('if __name__ == "__main__":') :]
    with pytest.raises(SystemExit) as exit_:
        exec(compile(main_block, path, "exec"), {**vars(module), "__name__": "__main__"})  # noqa: S102
    assert exit_.value.code == 0
    assert not ran
    assert doc.splitlines()[0] in capsys.readouterr().out
