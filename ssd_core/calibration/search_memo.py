"""A matchness memo on disk, so an interrupted calibration resumes where its search stopped.

Matchness depends only on the model, the draft weights and the teacher-forcing data, not on the
search mode, ratio or seed, so one memo serves every search run over the same data. The file holds
a fingerprint of those inputs; a memo written for other inputs is ignored (and then replaced).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .artifact import atomic_write


def fingerprint(**inputs) -> str:
    """sha256 of the inputs matchness depends on (JSON-serialisable values)."""
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()


class SearchMemo:
    """{search name → {set key → matchness}}, saved atomically after every new value."""

    def __init__(self, path: Path | str, fingerprint: str):
        self.path, self.fingerprint = Path(path), fingerprint
        self.data: dict[str, dict[str, float]] = {}
        if self.path.exists():
            try:
                doc = json.loads(self.path.read_text(encoding="utf-8"))
                if doc.get("fingerprint") == fingerprint:
                    self.data = {k: dict(v) for k, v in doc["values"].items()}
            except (ValueError, KeyError, TypeError, AttributeError):
                self.data = {}        # unreadable: start afresh (it is only a cache)

    @property
    def size(self) -> int:
        return sum(len(v) for v in self.data.values())

    def values(self, name: str) -> dict[str, float]:
        return self.data.setdefault(name, {})

    def recorder(self, name: str):
        def record(key: str, value: float) -> None:
            self.values(name)[key] = value
            self.save()
        return record

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(self.path, "w", encoding="utf-8") as f:
            json.dump({"fingerprint": self.fingerprint, "values": self.data}, f)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
