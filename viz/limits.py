"""What one visitor may ask of a shared server, without Gradio: the caps, whether this server is private,
and how an uploaded file is forgotten.

A public Space (`SPACE_ID` set) runs with the tighter column of CAPS; a local run with the looser one.
Each cap can be raised or lowered by an environment variable (a Space runs `python app.py` bare, so its
settings are Space variables) and by `python app.py --cap NAME=VALUE`. Over a cap a visitor gets a
sentence, never a stack trace.
"""
from __future__ import annotations

import ipaddress
import os
import re
import shutil
import tempfile
import threading
from dataclasses import dataclass, fields
from pathlib import Path


@dataclass(frozen=True)
class Cap:
    """One limit: its value on a public Space and locally, the variable that overrides both, and why."""

    space: int
    local: int
    env: str
    what: str


# name → Cap; the docs' caps table is generated from this (viz.limits.caps_markdown)
CAPS = {
    "max_new_tokens": Cap(256, 512, "SSD_MAX_NEW_TOKENS", "new tokens one Generate request may ask for"),
    "race_max_new_tokens": Cap(128, 512, "SSD_RACE_MAX_NEW_TOKENS",
                               "new tokens per lap of a Race (it decodes twice; \"Try these\" is a Race)"),
    "walk_max_new_tokens": Cap(96, 256, "SSD_WALK_MAX_NEW_TOKENS",
                               "tokens a Step-through decodes at Start (then it plays back without the model)"),
    "max_rows": Cap(16, 16, "SSD_MAX_ROWS", "visitors' requests the model serves at once, in one batch; more wait "
                                            "in the queue"),
    "kv_budget_mb": Cap(768, 2048, "SSD_KV_BUDGET_MB", "KV-cache memory for the rows in the batch (MB); a request "
                                                      "that does not fit waits, its position shown"),
    "queue_size": Cap(32, 64, "SSD_QUEUE_SIZE", "requests waiting in the queue; more are turned away"),
    "in_flight": Cap(2, 8, "SSD_IN_FLIGHT", "requests one visitor (browser session or API client) may have "
                                           "queued or running at once"),
    "upload_kb": Cap(1024, 1024, "SSD_UPLOAD_KB", "size of an uploaded trace file (KB)"),
    "replay_steps": Cap(600, 2000, "SSD_REPLAY_STEPS", "steps a replayed trace may hold"),
    "replay_s": Cap(60, 300, "SSD_REPLAY_S", "wall seconds one replay may take (longer traces play faster)"),
    "session_ttl_s": Cap(1800, 7200, "SSD_SESSION_TTL_S", "seconds a visitor's state (last run, walk) is "
                                                           "kept after their last action"),
    "cache_age_s": Cap(900, 3600, "SSD_CACHE_AGE_S", "seconds before Gradio's cached files (uploads) are "
                                                      "deleted, checked every quarter of that"),
}


@dataclass(frozen=True)
class Limits:
    max_new_tokens: int = CAPS["max_new_tokens"].local
    race_max_new_tokens: int = CAPS["race_max_new_tokens"].local
    walk_max_new_tokens: int = CAPS["walk_max_new_tokens"].local
    max_rows: int = CAPS["max_rows"].local
    kv_budget_mb: int = CAPS["kv_budget_mb"].local
    queue_size: int = CAPS["queue_size"].local
    in_flight: int = CAPS["in_flight"].local
    upload_kb: int = CAPS["upload_kb"].local
    replay_steps: int = CAPS["replay_steps"].local
    replay_s: int = CAPS["replay_s"].local
    session_ttl_s: int = CAPS["session_ttl_s"].local
    cache_age_s: int = CAPS["cache_age_s"].local
    public: bool = False

    @classmethod
    def resolve(cls, public: bool | None = None, env=None, overrides: dict | None = None) -> "Limits":
        """The caps in force: the Space or local column, then environment variables, then `overrides`
        (from --cap). A value that is not a positive whole number is an error that names the cap."""
        env = os.environ if env is None else env
        public = bool(env.get("SPACE_ID")) if public is None else public
        values = {}
        for name, cap in CAPS.items():
            raw = (overrides or {}).get(name, env.get(cap.env))
            values[name] = cap.space if public else cap.local
            if raw is not None and str(raw).strip() != "":
                values[name] = _positive(raw, f"{name} ({cap.env})")
        return cls(public=public, **values)

    def describe(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self) if f.name != "public")


def _positive(raw, what: str) -> int:
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise ValueError(f"cap {what} must be a whole number, got {raw!r}") from None
    if value < 1:
        raise ValueError(f"cap {what} must be at least 1, got {value}")
    return value


def parse_overrides(items) -> dict:
    """`--cap NAME=VALUE` arguments → {name: value}; an unknown name is an error listing the known ones."""
    out = {}
    for item in items or ():
        name, sep, value = str(item).partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in CAPS:
            raise ValueError(f"--cap takes NAME=VALUE with NAME one of: {', '.join(CAPS)} (got {item!r})")
        out[name] = value
    return out


def caps_markdown() -> str:
    """The caps table for docs/space.md: name, variable, Space value, local value, what it limits."""
    rows = ["| cap | variable | on a Space | locally | what it limits |", "|---|---|---|---|---|"]
    rows += [f"| `{n}` | `{c.env}` | {c.space} | {c.local} | {c.what} |" for n, c in CAPS.items()]
    return "\n".join(rows)


def busy_message(held: int, cap: int) -> str:
    """What a visitor over the in-flight cap reads."""
    return (f"You already have {held} request{'s' if held != 1 else ''} running or waiting (the limit here is "
            f"{cap}). Wait for {'it' if held == 1 else 'them'} to finish, or press Stop, then try again.")


def private_server(env=None) -> bool:
    """Bound to loopback and not a Hugging Face Space: only the person at this machine can reach it."""
    env = os.environ if env is None else env
    if env.get("SPACE_ID"):
        return False
    name = env.get("GRADIO_SERVER_NAME") or "127.0.0.1"
    try:
        return name == "localhost" or ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def upload_folder() -> Path:
    """Where Gradio keeps uploads and the files it serves (its GRADIO_TEMP_DIR)."""
    return Path(os.environ.get("GRADIO_TEMP_DIR") or Path(tempfile.gettempdir()) / "gradio").resolve()


def forget_upload(digest: str) -> None:
    """Delete an upload once it is read: Gradio keeps each one in a folder of the upload folder named by a
    (seeded) sha256 of its content, `digest`; only such a folder (64 hex digits, directly inside) is removed."""
    if not re.fullmatch(r"[0-9a-f]{64}", str(digest)):
        return
    shutil.rmtree(upload_folder() / digest, ignore_errors=True)


UPLOAD_GRACE_S = 30.0   # an upload is deleted this long after it was read: Gradio stores identical uploads at
                        # one path, and another visitor's request may not have read its copy yet


class LaterDelete:
    """forget_upload(digest), `delay_s` after the last call for that digest (a thread timer per pending
    digest: as many as distinct uploads in the last `delay_s` seconds)."""

    def __init__(self, delay_s: float = UPLOAD_GRACE_S):
        self.delay_s = delay_s
        self._timers: dict[str, threading.Timer] = {}
        self._lock = threading.Lock()

    def __call__(self, digest: str) -> None:
        with self._lock:
            old = self._timers.pop(digest, None)
            if old is not None:
                old.cancel()
            timer = threading.Timer(self.delay_s, self._fire, (digest,))
            timer.daemon = True
            self._timers[digest] = timer
            timer.start()

    def _fire(self, digest: str) -> None:
        with self._lock:
            self._timers.pop(digest, None)
        forget_upload(digest)

    def pending(self) -> int:
        with self._lock:
            return len(self._timers)
