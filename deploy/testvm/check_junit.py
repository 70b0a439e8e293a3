#!/usr/bin/env python3
"""Fail unless a JUnit XML report shows tests that all ran and passed.

pytest exits 0 when every test is skipped, so a VM suite that silently found no RDMA
device would look green.  This check makes a missing report, an empty one, or any
skipped, failed or errored test an error:

    check_junit.py .testvm/out/junit-vm.xml --min-tests 2

Exit status: 0 all passed, 1 the report says otherwise (or is missing/unreadable).
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

PROG = "check_junit"
OUTCOMES = ("skipped", "failure", "error")
LABELS = {"skipped": "skipped", "failure": "failed", "error": "errors"}


@dataclass
class Report:
    """What a JUnit file says, test case by test case."""

    total: int = 0
    seconds: float = 0.0
    bad: dict[str, list[str]] = field(default_factory=lambda: {o: [] for o in OUTCOMES})

    @property
    def passed(self) -> int:
        """Test cases without a skipped, failure or error element."""
        return self.total - sum(len(names) for names in self.bad.values())


def case_name(case: ET.Element) -> str:
    """'file.Class::test' style name of a test case."""
    return f"{case.get('classname', '?')}::{case.get('name', '?')}"


def outcome_of(case: ET.Element) -> tuple[str, str] | None:
    """(outcome, first line of its message) for a test case that did not pass."""
    for outcome in OUTCOMES:
        element = case.find(outcome)
        if element is not None:
            text = element.get("message") or (element.text or "").strip()
            return outcome, (text.splitlines() or [""])[0][:200]
    return None


def read_report(path: Path) -> Report:
    """Parse a JUnit XML file (pytest's xunit1/xunit2, or any <testcase> list)."""
    root = ET.parse(path).getroot()  # noqa: S314 - our own report, not untrusted input
    report = Report()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    report.seconds = sum(float(s.get("time", "0") or 0) for s in suites)
    for case in root.iter("testcase"):
        report.total += 1
        result = outcome_of(case)
        if result is not None:
            outcome, message = result
            report.bad[outcome].append(f"{case_name(case)}: {message}")
    return report


def problems(report: Report, min_tests: int) -> list[str]:
    """Why the report is not acceptable (empty list if it is)."""
    found: list[str] = []
    if report.total < min_tests:
        found.append(f"{report.total} tests ran, at least {min_tests} expected")
    for outcome in OUTCOMES:
        found.extend(f"{LABELS[outcome]}: {entry}" for entry in report.bad[outcome])
    return found


def summary(path: Path, report: Report) -> str:
    """One line with the counts."""
    counts = ", ".join(f"{len(report.bad[o])} {LABELS[o]}" for o in OUTCOMES)
    return (
        f"{path}: {report.total} tests, {report.passed} passed, {counts} ({report.seconds:.1f} s)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point."""
    parser = argparse.ArgumentParser(
        prog="check_junit.py",
        description="Exit non-zero unless FILE (JUnit XML) holds at least N tests, "
        "none skipped, failed or errored.",
    )
    parser.add_argument("file", type=Path, metavar="FILE", help="the JUnit XML report")
    parser.add_argument(
        "--min-tests",
        type=int,
        default=1,
        metavar="N",
        help="fewest test cases the report must hold (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    path: Path = args.file
    if not path.is_file():
        print(
            f"{PROG}: error: {path}: no such report (did the test run start at all?)",
            file=sys.stderr,
        )
        return 1
    try:
        report = read_report(path)
    except (ET.ParseError, ValueError) as exc:
        print(f"{PROG}: error: {path}: not a readable JUnit report: {exc}", file=sys.stderr)
        return 1
    found = problems(report, args.min_tests)
    if found:
        print(f"{PROG}: FAILED {summary(path, report)}", file=sys.stderr)
        for line in found:
            print(f"{PROG}:   {line}", file=sys.stderr)
        return 1
    print(f"{PROG}: ok {summary(path, report)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
