"""The seven domains, their prompt files and a deterministic calibration / held-out split."""
from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

DOMAINS = ("summarization", "math", "translation", "story", "sql", "code", "qa")
DOMAIN_DIR = Path(__file__).resolve().parents[2] / "assets" / "domains"
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


def held_out_questions(per_domain: int, skip: int = 0, domain_dir: Path | str = DOMAIN_DIR) -> list[dict]:
    """A Spec-Bench-format question list (category = domain) from the held-out split.

    skip: held-out prompts to pass over first in each domain, e.g. the ones the calibration's
    held-out matchness and domain check already looked at (its --held-out-per-domain).
    """
    prompts = load_prompts(domain_dir)
    rows = []
    for d, ps in prompts.items():
        held = split(ps)[1][skip:skip + per_domain]
        rows += [{"question_id": len(rows) + 1 + i, "category": d, "turns": [p]} for i, p in enumerate(held)]
    return rows


def main(argv=None) -> None:
    """python -m ssd_core.calibration.domains --held-out-questions N [--skip K] --out FILE"""
    ap = argparse.ArgumentParser(description="Write held-out domain prompts as a bench question file.")
    ap.add_argument("--held-out-questions", type=int, required=True, help="questions per domain")
    ap.add_argument("--skip", type=int, default=0, help="held-out prompts to pass over per domain")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    rows = held_out_questions(args.held_out_questions, args.skip)
    Path(args.out).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    print(f"{len(rows)} questions → {args.out}")


if __name__ == "__main__":
    main()
