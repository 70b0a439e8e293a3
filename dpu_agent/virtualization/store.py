"""Function records on disk: one JSON file, replaced atomically, so they survive restarts."""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any

from dpu_agent.private_files import replace_durably
from dpu_agent.virtualization.model import (
    FunctionRecord,
    FunctionSpec,
    FunctionState,
    FunctionType,
    Provisioned,
)

if TYPE_CHECKING:
    from pathlib import Path

FORMAT_VERSION = 1


def to_json(record: FunctionRecord) -> dict[str, object]:
    """A record as JSON-ready data."""
    spec = dataclasses.asdict(record.spec)
    spec["type"] = str(record.spec.type)
    return {
        "spec": spec,
        "provisioned": dataclasses.asdict(record.provisioned) if record.provisioned else None,
        "state": str(record.state),
        "created_ns": record.created_ns,
        "updated_ns": record.updated_ns,
    }


def from_json(data: dict[str, Any]) -> FunctionRecord:
    """A record from `to_json`'s data."""
    spec = dict(data["spec"])
    spec["type"] = FunctionType(spec["type"])
    made = data.get("provisioned")
    return FunctionRecord(
        spec=FunctionSpec(**spec),
        provisioned=Provisioned(**made) if made else None,
        state=FunctionState(data["state"]),
        created_ns=int(data["created_ns"]),
        updated_ns=int(data["updated_ns"]),
    )


class FunctionStore:
    """The records of one agent, in a JSON file written with write-then-rename."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> list[FunctionRecord]:
        """Every saved record ([] when the file does not exist yet)."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return []
        data = json.loads(text)
        if data.get("version") != FORMAT_VERSION:
            msg = f"{self.path}: unknown format version {data.get('version')!r}"
            raise ValueError(msg)
        return [from_json(item) for item in data["functions"]]

    def save(self, records: list[FunctionRecord]) -> None:
        """Replace the file with these records, durably."""
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        body = {"version": FORMAT_VERSION, "functions": [to_json(r) for r in records]}
        replace_durably(self.path, json.dumps(body, indent=1, sort_keys=True), "the functions")
