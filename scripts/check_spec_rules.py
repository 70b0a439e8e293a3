"""Check that every requirement of the wire spec has a conformance row, and back.

docs/data-plane.md states its requirements with RFC 2119 key words, each MUST tagged
with an id in brackets, `[DP-2.5-3]`. tests/conformance/table.py lists one `Row` per
id. This script (run by `make lint`) fails when:

- a statement (a paragraph, a list item or a table row, outside code blocks) says
  MUST or MUST NOT and carries no id, or carries an id and says no MUST;
- an id appears twice in the spec, or twice in the table;
- an id of the spec has no row, or a row names an id the spec does not have.

The table is read with `ast`, without importing it (no test dependencies needed).

    check_spec_rules.py           check, print a one-line summary
    check_spec_rules.py --list    also print every id and where it is
"""

from __future__ import annotations

import argparse
import ast
import collections
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "docs" / "data-plane.md"
TABLE = ROOT / "tests" / "conformance" / "table.py"

TAG = re.compile(r"\[(DP-\d+(?:\.\d+)?-\d+)\]")
ID = re.compile(r"DP-\d+(?:\.\d+)?-\d+")
# MUST as a key word: capitals, not quoted (the conventions paragraph quotes them)
MUST = re.compile(r'(?<!")\bMUST\b')
_ITEM = re.compile(r"^\s*(?:[-*]|\d+\.)\s")


def statements(text: str) -> list[tuple[int, str]]:
    """(first line number, text) of each paragraph, list item and table row."""
    found: list[tuple[int, list[str]]] = []
    current: list[str] | None = None
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            current = None
            continue
        if fenced or not line.strip():
            current = None
            continue
        if line.lstrip().startswith("|") or _ITEM.match(line) or current is None:
            current = [line]
            found.append((number, current))
            if line.lstrip().startswith("|"):
                current = None  # a table row is one statement
        else:
            current.append(line)
    return [(number, " ".join(lines)) for number, lines in found]


def spec_ids(text: str) -> tuple[dict[str, int], list[str]]:
    """Requirement id -> line, and the errors found in the spec."""
    ids: dict[str, int] = {}
    errors = []
    for number, statement in statements(text):
        tags = TAG.findall(statement)
        says_must = bool(MUST.search(statement))
        if says_must and not tags:
            errors.append(f"{SPEC.name}:{number}: a MUST without a requirement id")
        if tags and not says_must:
            errors.append(f"{SPEC.name}:{number}: {', '.join(tags)} labels no MUST")
        for tag in tags:
            if tag in ids:
                errors.append(f"{SPEC.name}:{number}: {tag} is used again (first on {ids[tag]})")
            else:
                ids[tag] = number
    return ids, errors


def table_ids(source: str) -> tuple[dict[str, int], list[str]]:
    """Row id -> line in the table, and the errors found there.

    A row is a call `Row("DP-...", ...)` whose first argument is a string literal.
    """
    rows: dict[str, int] = {}
    errors = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Row"):
            continue
        first = node.args[0] if node.args else None
        if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
            errors.append(f"{TABLE.name}:{node.lineno}: a Row whose id is not a string literal")
            continue
        rule = first.value
        if not ID.fullmatch(rule):
            errors.append(f"{TABLE.name}:{node.lineno}: {rule!r} is not a requirement id")
        elif rule in rows:
            errors.append(
                f"{TABLE.name}:{node.lineno}: {rule} has a row already (line {rows[rule]})"
            )
        else:
            rows[rule] = node.lineno
    return rows, errors


def _key(rule: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", rule))


def main() -> int:
    """Check, print the result; 0 when spec and table agree."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--list", action="store_true", help="print every id and its line")
    args = parser.parse_args()
    ids, errors = spec_ids(SPEC.read_text(encoding="utf-8"))
    rows, table_errors = table_ids(TABLE.read_text(encoding="utf-8"))
    errors += table_errors
    for rule in sorted(set(ids) - set(rows), key=_key):
        errors.append(f"{SPEC.name}:{ids[rule]}: {rule} has no row in {TABLE.name}")
    for rule in sorted(set(rows) - set(ids), key=_key):
        errors.append(f"{TABLE.name}:{rows[rule]}: {rule} is not a requirement of {SPEC.name}")
    if args.list:
        for rule in sorted(ids, key=_key):
            print(f"{rule:10} spec line {ids[rule]:4}  row line {rows.get(rule, '-')}")
    for error in errors:
        print(error, file=sys.stderr)
    if errors:
        return 1
    by_section = collections.Counter(rule.split("-")[1].split(".")[0] for rule in ids)
    sections = ", ".join(
        f"§{s} {n}" for s, n in sorted(by_section.items(), key=lambda i: int(i[0]))
    )
    print(f"{SPEC.relative_to(ROOT)}: {len(ids)} requirements ({sections}), each with a row")
    return 0


if __name__ == "__main__":
    sys.exit(main())
