"""The worked examples and the C structs of docs/data-plane.md are true.

Every hex dump in the spec is made again by the real encoder (`dpu_wire.capsule`,
`dpu_wire.transport.tcp`) and must match the page line for line (offsets, bytes, the
ASCII column); every Python snippet must evaluate to the dump that follows it; and the
conformance suite's own codec (`tests.conformance.wire`, written from the page) must
produce the same bytes. Appendix A is compiled with gcc and must fill a SUBMIT and a
HELLO byte-identical to the encoder's.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Final

import pytest

from dpu_wire.capsule import FLAG_INLINE, Cancel, Completion, JobKind, Span, State, Submit
from dpu_wire.transport import tcp
from tests.conformance import wire

SPEC: Final = Path(__file__).resolve().parents[2] / "docs" / "data-plane.md"
_DUMP_LINE: Final = re.compile(r"^[0-9a-f]{4}  ")
TOKEN: Final = bytes(range(32))

EXAMPLES: Final[dict[str, bytes]] = {
    "SUBMIT 80 bytes": Submit(
        job_id=7,
        kind=JobKind.COPY,
        source=Span(0x7F3A12340000, 4096, 0x1234),
        destination=Span(0x7F3A12350000, 4096, 0x5678),
        deadline_ms=5000,
    ).encode(),
    "COMPLETION 80 bytes": Completion(
        job_id=7,
        state=State.SUCCEEDED,
        bytes_read=4096,
        bytes_written=4096,
        submit_ns=1700000000000000000,
        start_ns=1700000000000050000,
        end_ns=1700000000000250000,
    ).encode(),
    "COMPLETION (FAILED) 99 bytes": Completion(
        job_id=8,
        state=State.FAILED,
        status=3,
        message="source: length is 0",
        submit_ns=1700000000000000000,
        end_ns=1700000000000010000,
    ).encode(),
    "CANCEL 16 bytes": Cancel(7).encode(),
    "INLINE SUBMIT 89 bytes": Submit(
        job_id=9,
        kind=JobKind.CRC32C,
        source=Span(0, 9, 0),
        flags=FLAG_INLINE,
        inline=b"123456789",
    ).encode(),
    "HELLO frame": tcp.pack(tcp.FrameType.HELLO, length=32) + TOKEN,
    "CAPSULE frame header": tcp.pack(tcp.FrameType.CAPSULE, length=80),
    "READ frame": tcp.pack(tcp.FrameType.READ, 0, 1, 0x7F3A12340000, 0x1234, 4096),
    "READ_RESP frame header": tcp.pack(tcp.FrameType.READ_RESP, 0, 1, length=4096),
    "WRITE_ACK refused": tcp.pack(tcp.FrameType.WRITE_ACK, tcp.STATUS_ACCESS, 2),
}


def dump_lines(data: bytes) -> list[str]:
    """The page's hex dump format: offset, 8 + 8 bytes, the ASCII column."""
    lines = []
    for offset in range(0, len(data), 16):
        row = data[offset : offset + 16]
        hexes = " ".join(f"{b:02x}" for b in row[:8])
        if len(row) > 8:
            hexes += "  " + " ".join(f"{b:02x}" for b in row[8:])
        text = "".join(chr(b) if 0x20 <= b < 0x7F else "." for b in row)
        lines.append(f"{offset:04x}  {hexes:<48}  {text}")
    return lines


def blocks(text: str) -> list[tuple[str, list[str]]]:
    """(language, lines) of every fenced code block of the page."""
    found: list[tuple[str, list[str]]] = []
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("```"):
            if current is None:
                current = []
                found.append((line[3:].strip(), current))
            else:
                current = None
        elif current is not None:
            current.append(line)
    return found


def dumps_in(lines: list[str]) -> list[tuple[str, list[str]]]:
    """(title, dump lines) of the dumps in a code block: a title line, then the rows."""
    found: list[tuple[str, list[str]]] = []
    for line in lines:
        if _DUMP_LINE.match(line):
            found[-1][1].append(line)
        else:
            found.append((line.strip(), []))
    return found


def page_dumps() -> list[tuple[str, list[str], bytes | None]]:
    """(title, dump lines, the value of the Python snippet before it, if any)."""
    found = []
    snippet: bytes | None = None
    names = {
        "Submit": Submit,
        "Completion": Completion,
        "Span": Span,
        "JobKind": JobKind,
        "State": State,
    }
    for language, lines in blocks(SPEC.read_text(encoding="utf-8")):
        if language == "python":
            snippet = eval("\n".join(lines), {"__builtins__": {}}, names)  # noqa: S307 - our own page
            continue
        if language or not any(_DUMP_LINE.match(line) for line in lines):
            continue  # not a hex dump (the sequence diagram)
        for title, rows in dumps_in(lines):
            found.append((title, rows, snippet))
            snippet = None
    return found


def test_every_dump_of_the_page_is_an_example_we_make():
    titles = [title for title, _, _ in page_dumps()]
    assert sorted(titles) == sorted(EXAMPLES), (
        "a dump on the page is not made here, or one is missing"
    )


@pytest.mark.parametrize(
    ("title", "rows", "snippet"), page_dumps(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_dump_matches_the_encoder(title: str, rows: list[str], snippet: bytes | None):
    expected = dump_lines(EXAMPLES[title])
    assert len(rows) == len(expected), title
    for row, line in zip(rows, expected, strict=True):
        note = row[len(line) :]
        assert row.startswith(line), f"{title}:\n page: {row}\n made: {line}"
        assert not note or note.startswith("   "), f"{title}: no room before the note: {row!r}"
    if snippet is not None:
        assert snippet == EXAMPLES[title], f"the Python snippet before {title!r} makes other bytes"


def test_the_suites_own_codec_agrees_with_the_encoder():
    made = wire.submit(
        7,
        wire.Kind.COPY,
        wire.Span(0x7F3A12340000, 4096, 0x1234),
        wire.Span(0x7F3A12350000, 4096, 0x5678),
        deadline_ms=5000,
    )
    assert made == EXAMPLES["SUBMIT 80 bytes"]
    assert wire.cancel(7) == EXAMPLES["CANCEL 16 bytes"]
    assert (
        wire.submit_inline(9, wire.Kind.CRC32C, b"123456789") == EXAMPLES["INLINE SUBMIT 89 bytes"]
    )
    assert wire.hello(TOKEN) == EXAMPLES["HELLO frame"]
    assert wire.frame(wire.Ft.READ, 0, 1, 0x7F3A12340000, 0x1234, 4096) == EXAMPLES["READ frame"]
    for title in ("COMPLETION 80 bytes", "COMPLETION (FAILED) 99 bytes"):
        parsed = wire.parse_completion(EXAMPLES[title])
        assert parsed.job_id in (7, 8)


C_PROGRAM: Final = r"""
#include <stdio.h>
#include <string.h>
#include "dpu.h"

static void put(const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) printf("%02x", b[i]);
    printf("\n");
}

int main(void) {
    struct dpu_submit s;
    memset(&s, 0, sizeof s);
    s.hdr.magic[0] = DPU_CAPSULE_MAGIC0;
    s.hdr.magic[1] = DPU_CAPSULE_MAGIC1;
    s.hdr.version = DPU_CAPSULE_VERSION;
    s.hdr.opcode = DPU_OP_SUBMIT;
    s.hdr.length = sizeof s;
    s.hdr.job_id = 7;
    s.kind = DPU_JOB_COPY;
    s.deadline_ms = 5000;
    s.source.addr = UINT64_C(0x7f3a12340000);
    s.source.length = 4096;
    s.source.rkey = 0x1234;
    s.destination.addr = UINT64_C(0x7f3a12350000);
    s.destination.length = 4096;
    s.destination.rkey = 0x5678;
    put(&s, sizeof s);
    struct dpu_hello h;
    memset(&h, 0, sizeof h);
    h.hdr.type = DPU_FRAME_HELLO;
    h.hdr.length = DPU_TOKEN_BYTES;
    for (int i = 0; i < DPU_TOKEN_BYTES; i++) h.token[i] = (uint8_t)i;
    put(&h, sizeof h);
    return 0;
}
"""


def test_the_c_structs_compile_and_match_the_encoder(tmp_path: Path):
    gcc = shutil.which("gcc")
    assert gcc is not None, "gcc is in deploy/apt-packages.txt (make venv installs it)"
    (header,) = [
        lines for language, lines in blocks(SPEC.read_text(encoding="utf-8")) if language == "c"
    ]
    (tmp_path / "dpu.h").write_text("\n".join(header) + "\n")
    (tmp_path / "main.c").write_text(C_PROGRAM)
    program = tmp_path / "dpu"
    subprocess.run(
        [
            gcc,
            "-std=c11",
            "-Wall",
            "-Wextra",
            "-pedantic",
            "-Werror",
            "-o",
            str(program),
            str(tmp_path / "main.c"),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    out = subprocess.run(
        [str(program)], check=True, capture_output=True, text=True, timeout=10
    ).stdout.split()
    assert bytes.fromhex(out[0]) == EXAMPLES["SUBMIT 80 bytes"]
    assert bytes.fromhex(out[1]) == EXAMPLES["HELLO frame"]
