"""Do the numbers a visitor reads agree with what happens? The app as a public Space serves it, on loopback.

    python tests/truth.py --out assets/bench/truth.json

Starts `python app.py` with SPACE_ID set and an empty home and model cache (a fresh Space), then:
1. right after start-up, five Race vs static on a prompt whose domain drafts with the static set (same
   draft, same work): each ratio must read within [0.90, 1.10] in at least 4 of 5, median in [0.95, 1.05];
2. once the start-up's background work is done (the latency model measured on an idle engine, the domain
   map loaded), for each domain's first "Try these" prompt, three Race vs AR, alternated across domains: the
   cost panel's headline prediction must land within ±15% of the measured speedup (medians of the three)
   on at least 6 of the 7 domains.
Then restarts the app on the same home (its cache now warm) and repeats both; the second start must
measure nothing the first cached (no verifier-kernel timing, no latency profile). Every visitor is a
gradio_client Client calling the app's own events (/race, /race_static), as the page does. Writes the
figures to --out; exit status 1 when a check fails, so a marked test can run it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadtest import Server, client, free_port, generate_args  # noqa: E402

from ssd_core.calibration.domains import DOMAINS, load_prompts, split  # noqa: E402

PREDICTED = re.compile(r"predicted (\d+\.\d+)×")
MEASURED = re.compile(r"measured (\d+\.\d+)×</div>")
RACE = re.compile(r'race-speedup \w+">(\d+\.\d+)×')
MAX_NEW = 96                       # the Generate tab's default


def first_prompts() -> dict[str, str]:
    """Each domain's first "Try these" prompt (viz.startup: the held-out half of assets/domains)."""
    return {d: (split(p)[1] or p)[0] for d, p in load_prompts().items() if d in DOMAINS}


def _html(result, marker: str) -> str:
    for item in result if isinstance(result, (list, tuple)) else [result]:
        if isinstance(item, str) and marker in item:
            return item
    raise RuntimeError(f"no {marker!r} output in the answer")


def race_vs_static(c, prompt: str) -> float:
    out = c.predict(*generate_args(prompt, MAX_NEW), api_name="/race_static")
    return float(RACE.search(_html(out, 'class="race"')).group(1))


def race_vs_ar(c, prompt: str) -> tuple[float, float]:
    """(the cost panel's headline prediction, the race's measured speedup) of one Race vs AR."""
    out = c.predict(*generate_args(prompt, MAX_NEW), api_name="/race")
    cost = _html(out, 'class="cost"')
    return float(PREDICTED.search(cost).group(1)), float(MEASURED.search(cost).group(1))


def one_start(home: Path, label: str) -> dict:
    port = free_port()
    env = {"HOME": str(home), "KNN_SSD_CACHE": str(home / "cache")}
    server = Server(port, home / "gradio", env)
    try:
        server.wait_for("Running on", timeout=600)
        c = client(f"http://127.0.0.1:{port}/")
        prompts = first_prompts()
        same = [race_vs_static(c, prompts["math"]) for _ in range(5)]
        server.wait_for("domain map ready", timeout=600)     # the background start-up work is done
        runs = {d: [] for d in prompts}
        for _ in range(3):
            for d, p in prompts.items():
                runs[d].append(race_vs_ar(c, p))
        c.close()
    finally:
        server.stop()
    per_domain = {}
    for d, rs in runs.items():
        pred, meas = statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs)
        per_domain[d] = {"predicted": pred, "measured": meas, "error": round(pred / meas - 1, 3),
                         "races": [list(r) for r in rs]}
    return {"start": label, "race_vs_static": same, "per_domain": per_domain, "measurements": _measurements(home),
            "log": [line for line in server.lines if "start-up" in line or "latency" in line or "kernel" in line]}


def _measurements(home: Path) -> dict:
    """What the machine-specific caches hold (the verifier's kernel choice, latency profiles): path → mtime."""
    cache = home / "cache"
    return {str(p.relative_to(cache)): p.stat().st_mtime for p in sorted(cache.rglob("*.json"))} if cache.exists() else {}


CHECKS = {
    "same_draft_4_of_5_within_10pct": lambda s: sum(0.90 <= x <= 1.10 for x in s["race_vs_static"]) >= 4,
    "same_draft_median_within_5pct": lambda s: 0.95 <= statistics.median(s["race_vs_static"]) <= 1.05,
    "prediction_within_15pct_on_6_of_7": lambda s: sum(abs(v["error"]) <= 0.15
                                                       for v in s["per_domain"].values()) >= 6,
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    home = Path(tempfile.mkdtemp(prefix="truth-home-"))
    starts = [one_start(home, "fresh home"), one_start(home, "restart, same home")]
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpu": _cpu(),
              "max_new_tokens": MAX_NEW, "starts": starts, "checks": {}}
    ok = True
    for s in starts:
        for name, check in CHECKS.items():
            passed = bool(check(s))
            report["checks"][f"{s['start']}: {name}"] = passed
            ok &= passed
    first, second = starts[0]["measurements"], starts[1]["measurements"]
    remeasured = any("latency model" in line and "measured" in line for line in starts[1]["log"])
    report["checks"]["restart measures nothing cached"] = bool(first) and first == second and not remeasured
    ok &= report["checks"]["restart measures nothing cached"]
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if ok else 1


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip() + f" ({os.cpu_count()} CPUs)"
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
