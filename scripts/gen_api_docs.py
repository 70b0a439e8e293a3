"""Generate docs/api.md, the dpu.v1 API reference, from proto/dpu/v1 and its comments.

protoc (grpcio-tools) compiles the .proto files into a descriptor set with source
info, so the comments come along with the services, RPCs, messages, fields and enums;
the page is written from that descriptor set, file by file. Its status-code table is
written from the one place the agent maps errors to codes: `STATUS_FOR` and
`OTHER_CODES` in dpu_agent/status.py and the docstrings of dpu_agent/errors.py.

    gen_api_docs.py           rewrite docs/api.md
    gen_api_docs.py --check   exit 1 if docs/api.md differs from what would be generated
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import descriptor_pb2

from dpu_agent import status

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT = ROOT / "docs" / "api.md"
PACKAGE = "dpu.v1"

# Field numbers inside descriptor.proto: the paths of SourceCodeInfo.Location.
_FILE_MESSAGE, _FILE_ENUM, _FILE_SERVICE, _FILE_SYNTAX = 4, 5, 6, 12
_MSG_FIELD, _MSG_NESTED, _MSG_ENUM = 2, 3, 4
_ENUM_VALUE, _SERVICE_METHOD = 2, 2

_SCALARS = {
    getattr(descriptor_pb2.FieldDescriptorProto, name): name.removeprefix("TYPE_").lower()
    for name in descriptor_pb2.FieldDescriptorProto.Type.keys()  # noqa: SIM118 - enum wrapper
}


@dataclass
class Comments:
    """Comments of one file's elements, by descriptor path."""

    by_path: dict[tuple[int, ...], str] = field(default_factory=dict)
    header: str = ""

    @classmethod
    def of(cls, proto: descriptor_pb2.FileDescriptorProto) -> Comments:
        """Leading and trailing comments of every element (header: the file's first one)."""
        found = cls()
        for loc in proto.source_code_info.location:
            path = tuple(loc.path)
            if path == (_FILE_SYNTAX,):
                parts = [*loc.leading_detached_comments, loc.leading_comments]
                found.header = "\n\n".join(_clean(p) for p in parts if p.strip())
                continue
            text = "\n".join(_clean(p) for p in (loc.leading_comments, loc.trailing_comments))
            if text.strip():
                found.by_path[path] = text.strip()
        return found

    def get(self, *path: int) -> str:
        """The comment at `path` ("" when there is none)."""
        return self.by_path.get(path, "")


def _clean(comment: str) -> str:
    """A comment as Markdown text: no space after `//`, brackets escaped (not links)."""
    lines = [line.removeprefix(" ") for line in comment.rstrip("\n").split("\n")]
    text = "\n".join(lines).strip("\n")
    return text.replace("[", "\\[").replace("]", "\\]")


def _cell(text: str) -> str:
    """Text for one table cell: one line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _anchor(title: str) -> str:
    """The anchor GitHub gives a heading."""
    slug = re.sub(r"[^\w\- ]", "", title.lower())
    return slug.replace(" ", "-")


def _local(type_name: str) -> str:
    """`.dpu.v1.Foo.Bar` -> `Foo.Bar`; other packages keep their full name."""
    name = type_name.lstrip(".")
    return name.removeprefix(PACKAGE + ".")


@dataclass(frozen=True)
class StatusRow:
    """One status code the API answers."""

    name: str
    number: int
    meaning: str
    error: str  # the domain error mapped to it ("" for OTHER_CODES)


def status_rows() -> list[StatusRow]:
    """The codes of STATUS_FOR (meaning: the error's docstring) and OTHER_CODES, by number."""
    rows = []
    for error, code in status.STATUS_FOR.items():
        doc = error.__dict__.get("__doc__")  # its own, not a base class's
        if not doc:
            raise SystemExit(f"dpu_agent/errors.py: {error.__name__} has no docstring")
        rows.append(StatusRow(code.name, code.value[0], inspect.cleandoc(doc), error.__name__))
    rows += [
        StatusRow(code.name, code.value[0], meaning, "")
        for code, meaning in status.OTHER_CODES.items()
    ]
    return sorted(rows, key=lambda row: row.number)


class Writer:
    """Builds the page."""

    def __init__(
        self, files: list[descriptor_pb2.FileDescriptorProto], statuses: list[StatusRow]
    ) -> None:
        self.files = files
        self.statuses = statuses
        self.out: list[str] = []
        # every message and enum of the package: local name -> heading
        self.headings: dict[str, str] = {}
        self.map_entries: dict[str, descriptor_pb2.DescriptorProto] = {}
        for proto in files:
            for message in proto.message_type:
                self._index_message(message, "")
            for enum in proto.enum_type:
                self.headings[enum.name] = f"{enum.name} (enum)"

    def _index_message(self, message: descriptor_pb2.DescriptorProto, prefix: str) -> None:
        name = prefix + message.name
        if message.options.map_entry:
            self.map_entries[name] = message
            return
        self.headings[name] = f"{name} (message)"
        for nested in message.nested_type:
            self._index_message(nested, name + ".")
        for enum in message.enum_type:
            self.headings[f"{name}.{enum.name}"] = f"{name}.{enum.name} (enum)"

    def link(self, type_name: str) -> str:
        """A message or enum type as a link to its section (or plain for other packages)."""
        name = _local(type_name)
        heading = self.headings.get(name)
        return f"[`{name}`](#{_anchor(heading)})" if heading else f"`{name}`"

    def field_type(self, f: descriptor_pb2.FieldDescriptorProto) -> str:
        """The field's type as written in the .proto (map<k, v>, repeated, optional)."""
        FDP = descriptor_pb2.FieldDescriptorProto  # noqa: N806 - the proto's class
        if f.type in (FDP.TYPE_MESSAGE, FDP.TYPE_ENUM):
            entry = self.map_entries.get(_local(f.type_name))
            if entry is not None:
                key, value = entry.field
                return f"map&lt;{self.field_type(key)}, {self.field_type(value)}&gt;"
            base = self.link(f.type_name)
        else:
            base = f"`{_SCALARS[f.type]}`"
        if f.label == FDP.LABEL_REPEATED:
            return f"repeated {base}"
        if f.proto3_optional:
            return f"optional {base}"
        return base

    def write(self) -> str:
        """The whole page."""
        self.out = [
            "# dpu.v1 API reference",
            "",
            "<!-- Generated by scripts/gen_api_docs.py from proto/dpu/v1/*.proto. Do not edit:",
            "     change the .proto comments, then run `make docs` (`make lint` checks it). -->",
            "",
            "Generated from `proto/dpu/v1/*.proto` and their comments. The Python stubs are",
            "`dpu_wire.v1` (`make proto`); the servers are `dpu_agent/services/`. What travels",
            "on the data plane (capsules, the tcp frames, the handshake) is in",
            "[data-plane.md](data-plane.md); the MQTT event plane (job completions, agent",
            "status, telemetry: topics and JSON payloads) is in [events.md](events.md).",
            "",
            "In a resource name, `{session}`, `{job}`, `{region}` and the like stand for the bare",
            "id (`sessions/s-1a2b.../jobs/7`), as in Google's API design guide (AIP-122).",
            "Every call authenticates as the README's Security section says: mTLS with a",
            "client certificate (its subject CN is the tenant) on any address but loopback;",
            "on plaintext loopback, `authorization: Bearer <token>` metadata when",
            "`[auth] tokens_file` is set (its format: README, Security; `dpuctl certs token`",
            "prints an entry). What each status code means: [Status codes](#status-codes).",
            "",
            "## Services",
            "",
            "| service | file | RPCs |",
            "|---|---|---|",
        ]
        for proto in self.files:
            for service in proto.service:
                title = f"{service.name} (service)"
                self.out.append(
                    f"| [`{PACKAGE}.{service.name}`](#{_anchor(title)}) "
                    f"| `{proto.name}` | {len(service.method)} |"
                )
        self.out.append("")
        self._status_codes()
        for proto in self.files:
            self._file(proto)
        return "\n".join(self.out).rstrip("\n") + "\n"

    def _status_codes(self) -> None:
        self.out += [
            "## Status codes",
            "",
            "Every RPC answers OK or one of these codes, with a message that says what was",
            "wrong (never a secret). A job's completion (`Completion.status`, the COMPLETION",
            "capsule's `status`) carries the same numbers. Where a call has codes of its own",
            "to tell, its comment below names them. This table is written from",
            "`dpu_agent/status.py`, the one place the agent's errors (`dpu_agent/errors.py`)",
            "become codes; the agent answers no other code. gRPC itself answers some of them",
            "too (an unreachable agent, a failed TLS handshake, the caller's own deadline),",
            "as the rows say.",
            "",
            "| code | number | meaning | agent error |",
            "|---|---|---|---|",
        ]
        for row in self.statuses:
            error = f"`{row.error}`" if row.error else "any other exception"
            self.out.append(f"| `{row.name}` | {row.number} | {_cell(row.meaning)} | {error} |")
        self.out.append("")

    def _file(self, proto: descriptor_pb2.FileDescriptorProto) -> None:
        comments = Comments.of(proto)
        self.out += [f"## {Path(proto.name).name}", ""]
        if comments.header:
            self.out += [comments.header, ""]
        for s_index, service in enumerate(proto.service):
            self._service(service, comments, (_FILE_SERVICE, s_index))
        for m_index, message in enumerate(proto.message_type):
            self._message(message, comments, (_FILE_MESSAGE, m_index), "")
        for e_index, enum in enumerate(proto.enum_type):
            self._enum(enum, comments, (_FILE_ENUM, e_index), "")

    def _service(
        self,
        service: descriptor_pb2.ServiceDescriptorProto,
        comments: Comments,
        path: tuple[int, ...],
    ) -> None:
        self.out += [f"### {service.name} (service)", "", f"`{PACKAGE}.{service.name}`", ""]
        if text := comments.get(*path):
            self.out += [text, ""]
        self.out += ["| RPC | request | response | description |", "|---|---|---|---|"]
        for index, method in enumerate(service.method):
            request = self.link(method.input_type)
            response = self.link(method.output_type)
            if method.client_streaming:
                request = "stream " + request
            if method.server_streaming:
                response = "stream " + response
            text = _cell(comments.get(*path, _SERVICE_METHOD, index))
            self.out.append(f"| `{method.name}` | {request} | {response} | {text} |")
        self.out.append("")

    def _message(
        self,
        message: descriptor_pb2.DescriptorProto,
        comments: Comments,
        path: tuple[int, ...],
        prefix: str,
    ) -> None:
        name = prefix + message.name
        if message.options.map_entry:
            return
        self.out += [f"### {name} (message)", ""]
        if text := comments.get(*path):
            self.out += [text, ""]
        if message.field:
            self.out += ["| field | number | type | description |", "|---|---|---|---|"]
            for index, f in enumerate(message.field):
                text = comments.get(*path, _MSG_FIELD, index)
                if f.HasField("oneof_index") and not f.proto3_optional:
                    oneof = message.oneof_decl[f.oneof_index].name
                    text = f"(oneof `{oneof}`) {text}"
                self.out.append(
                    f"| `{f.name}` | {f.number} | {self.field_type(f)} | {_cell(text)} |"
                )
        else:
            self.out.append("No fields.")
        self.out.append("")
        for index, nested in enumerate(message.nested_type):
            self._message(nested, comments, (*path, _MSG_NESTED, index), name + ".")
        for index, enum in enumerate(message.enum_type):
            self._enum(enum, comments, (*path, _MSG_ENUM, index), name + ".")

    def _enum(
        self,
        enum: descriptor_pb2.EnumDescriptorProto,
        comments: Comments,
        path: tuple[int, ...],
        prefix: str,
    ) -> None:
        self.out += [f"### {prefix}{enum.name} (enum)", ""]
        if text := comments.get(*path):
            self.out += [text, ""]
        self.out += ["| name | number | description |", "|---|---|---|"]
        for index, value in enumerate(enum.value):
            text = _cell(comments.get(*path, _ENUM_VALUE, index))
            self.out.append(f"| `{value.name}` | {value.number} | {text} |")
        self.out.append("")


def descriptors() -> list[descriptor_pb2.FileDescriptorProto]:
    """The dpu.v1 files compiled by protoc with their comments (source info)."""
    import grpc_tools  # noqa: PLC0415 - dev-only dependency
    from grpc_tools import protoc  # noqa: PLC0415

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in (PROTO_DIR / "dpu/v1").glob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "dpu.pb"
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"-I{well_known}",
            f"--descriptor_set_out={out}",
            "--include_source_info",
            *protos,
        ]
        if protoc.main(args) != 0:
            sys.exit("protoc failed")
        files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    return sorted(files.file, key=lambda f: f.name)


def generate() -> str:
    """The text of docs/api.md."""
    return Writer(descriptors(), status_rows()).write()


def main() -> int:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if docs/api.md is stale")
    args = parser.parse_args()
    text = generate()
    if args.check:
        current = OUT.read_text() if OUT.exists() else ""
        if current == text:
            print(f"docs/api.md: up to date ({text.count(chr(10))} lines)")
            return 0
        diff = difflib.unified_diff(
            current.splitlines(),
            text.splitlines(),
            "docs/api.md (committed)",
            "docs/api.md (generated)",
            lineterm="",
            n=1,
        )
        print("\n".join(list(diff)[:40]))
        print("docs/api.md is stale: run `make docs` and commit the result", file=sys.stderr)
        return 1
    OUT.write_text(text)
    print(f"wrote docs/api.md ({text.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
