"""The seven domains, their prompt files and a deterministic calibration / held-out split."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

DOMAINS = ("summarization", "math", "translation", "story", "sql", "code", "qa")
DOMAIN_DIR = Path(__file__).resolve().parent.parent / "assets" / "domains"
HELD_OUT_EVERY = 4            # every 4th prompt (in a hash order) is held out


def load_prompts(domain_dir: Path | str = DOMAIN_DIR, domains=DOMAINS) -> dict[str, list[str]]:
    """Read `<domain>.jsonl` files (one {"prompt": ...} a line); clear errors for bad files."""
    domain_dir = Path(domain_dir)
    out = {}
    for d in domains:
        path = domain_dir / f"{d}.jsonl"
        if not path.exists():
            raise FileNotFoundError(f"domain file missing: {path}")
        prompts = []
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                prompts.append(str(json.loads(line)["prompt"]))
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: expected a JSON object with a 'prompt' ({exc})") from exc
        if not prompts:
            raise ValueError(f"{path} holds no prompts")
        out[d] = prompts
    return out


def split(prompts: list[str]) -> tuple[list[str], list[str]]:
    """Deterministic split, independent of file order: (calibration, held_out)."""
    order = sorted(prompts, key=lambda p: hashlib.sha1(p.encode("utf-8")).hexdigest())
    held = set(order[::HELD_OUT_EVERY])
    return [p for p in prompts if p not in held], [p for p in prompts if p in held]


def domains_hash(domain_dir: Path | str = DOMAIN_DIR, domains=DOMAINS) -> str:
    """sha256 over the domain files' bytes: artefacts record it to detect stale calibrations."""
    h = hashlib.sha256()
    for d in domains:
        path = Path(domain_dir) / f"{d}.jsonl"
        h.update(d.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()
