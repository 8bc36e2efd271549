"""Classroom load test (issue #40): a class presses Generate at once, on the app as a public Space serves it.

    python tests/classroom.py --out assets/bench/classroom.json
    python tests/classroom.py --scenarios 1,4              # a quick look; names: 1,4,8,16,mix,disconnect

Starts ONE `python app.py` with SPACE_ID set, on loopback (tests/loadtest.py's Server), waits for the domain
map, warms up every model event once, then runs the scenarios in order, the engine idle before each:
- N = 1, 4, 8, 16 visitors pressing Generate (default settings: KNN-SSD, 96 new tokens);
- mix: 8 Generate, 4 "Try these" (a Race vs AR: what an example button runs, `/race`) and 4 Step-through
  Starts (`/walk_start`);
- disconnect: one visitor starts a 256-token Generate and leaves mid-answer (gradio_client's cancel: the
  server closes the handler's generator); its row must be freed.
Every visitor is its own gradio_client Client (own session), made before the window; all press within
2 s (evenly staggered, deterministic). Prompts: the held-out examples of the seven domains, cycled (what
"Try these" offers). Per visitor: first token = submit → the first streamed update whose token panel
holds a token (`<span class="tok …">` inside `token-stream`; a Step-through Start is not streamed, so its
first token is its answer); done = submit → the job finished. Errors (an exception, or ⚠ in the answer)
and refusals (queue full, per-visitor gate) are counted; RSS after warm-up and at the end.

Engine status: when the app exposes `api_name="engine_status"` (Engine.status(): rows, waiting, …) it is
sampled during each scenario (peak rows) and the disconnect check reads the freed row from it; else a
log line `engine: rows=N` is used; else only timing evidence (a short Generate right after the cancel
finishes promptly) is reported and the row check is None. Exit status 1 when a check fails (CHECKS).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadtest import (ROOT, LONG_PROMPT, DEFAULTS, STARTED, Server, Tally, _cpu, client,  # noqa: E402
                      free_port, generate_args, pct, rss_mb)
from ssd_core.calibration.domains import DOMAINS, load_prompts, split  # noqa: E402

SCENARIOS = ("1", "4", "8", "16", "mix", "disconnect")
WINDOW_S = 2.0            # every visitor presses within this window
PAUSE_S = 3.0             # idle between scenarios (after the engine reports no rows, when it can)
POLL_S = 0.02
JOB_TIMEOUT_S = 300.0
MAX_NEW = 96              # the Generate tab's default slider value (app.py: min(96, max_new_tokens))
LIMITS = {"first_token_p50_s": 2.0, "first_token_max_s": 5.0, "last_done_s": 20.0, "rss_growth": 0.15}
MIX = ("generate", "race", "generate", "walk") * 4           # 8 Generate, 4 Race, 4 Step-through Start
API = {"generate": "/generate", "race": "/race", "walk": "/walk_start"}
TOKEN = re.compile(r'class="token-stream"[^>]*>\s*<span class="tok ')
DONE_TOKENS = re.compile(r"(?:done|stopped after) · (\d+) tokens")
ENGINE_LOG = re.compile(r"engine: rows=(\d+)")


def check(name: str, scenario: dict) -> dict:
    """One scenario's done-when checks (the issue's figures for 16 visitors, held for every scenario)."""
    stream, every = scenario["streaming"], scenario["all"]
    return {f"{name}:first_token_p50<={LIMITS['first_token_p50_s']:g}s":
            stream["first_token_p50_s"] is not None and stream["first_token_p50_s"] <= LIMITS["first_token_p50_s"],
            f"{name}:first_token_max<={LIMITS['first_token_max_s']:g}s":
            stream["first_token_max_s"] is not None and stream["first_token_max_s"] <= LIMITS["first_token_max_s"],
            f"{name}:last_done<={LIMITS['last_done_s']:g}s":
            every["done_max_s"] is not None and every["done_max_s"] <= LIMITS["last_done_s"],
            f"{name}:every_visitor_answered": every["n"] == scenario["visitors"],
            f"{name}:no_errors": scenario["errors"] == 0, f"{name}:no_refusals": scenario["refused"] == 0}


CHECKS = {  # report → {check name: passed}; the disconnect check counts only where the row could be seen
    "scenarios": lambda r: {k: v for name, s in r["scenarios"].items() for k, v in check(name, s).items()},
    "rss": lambda r: {"rss_end_within_15pct_of_warm": r["rss_mb_end"] <= (1 + LIMITS["rss_growth"]) * r["rss_mb_warm"]},
    "disconnect": lambda r: ({"disconnect_frees_its_row": bool(r["disconnect"]["freed"])}
                             if r.get("disconnect") and r["disconnect"]["freed"] is not None else {}),
}


def class_prompts(n: int) -> list[str]:
    """n prompts, domain after domain, from the held-out examples the "Try these" buttons cycle through."""
    held = {d: split(p)[1] for d, p in load_prompts().items()}
    return [held[DOMAINS[i % len(DOMAINS)]][i // len(DOMAINS) % len(held[DOMAINS[i % len(DOMAINS)]])]
            for i in range(n)]


def request_args(kind: str, prompt: str, max_new: int = MAX_NEW) -> list:
    if kind == "walk":            # the Step-through tab's Start: prompt, strategy, oracle domain, γ, K
        d = DEFAULTS
        return [prompt, d["strategy"], d["oracle_domain"], d["gamma"], d["k"]]
    return generate_args(prompt, max_new)


def has_token(output) -> bool:
    items = output if isinstance(output, (tuple, list)) else (output,)
    return any(isinstance(x, str) and TOKEN.search(x) for x in items)


def answer_text(outputs) -> str:
    """The last panel the visitor saw that carries the answer (or its error): the token stream, or the
    Step-through view. A later update may leave that panel out (it stays as it is on the page)."""
    panels = [x for o in outputs for x in (o if isinstance(o, (tuple, list)) else (o,))
              if isinstance(x, str) and ('class="token-stream"' in x or 'class="walk' in x)]
    return panels[-1] if panels else json.dumps(outputs[-1:], default=str)[:2000]


class EngineStatus:
    """The app's engine status, where it exposes one (`/engine_status`), read through its own client."""

    def __init__(self, url: str, server: Server):
        self.server, self.c = server, client(url)
        self.api = True                  # probed by one call (an undocumented endpoint is not in view_api)
        self.api = self.read() is not None

    def read(self) -> dict | None:
        if self.api:
            try:
                out = self.c.predict(api_name="/engine_status")
                return out if isinstance(out, dict) else json.loads(out)
            except Exception:        # noqa: BLE001 - a status read that fails is no status
                return None
        rows = [m for line in self.server.lines[-200:] for m in ENGINE_LOG.findall(line)]
        return {"rows": int(rows[-1]), "waiting": 0} if rows else None

    @property
    def method(self) -> str | None:
        return "engine_status" if self.api else ("log" if self.read() is not None else None)

    def wait_idle(self, timeout: float = 60.0) -> bool | None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            s = self.read()
            if s is None:
                return None
            if not s.get("rows") and not s.get("waiting"):
                return True
            time.sleep(0.1)
        return False


class Visit:
    """One visitor's request: submitted at `at`, polled every POLL_S for its first token and its end."""

    def __init__(self, c, kind: str, args: list):
        self.c, self.kind, self.args = c, kind, args
        self.first = self.done = self.started = None
        self.tokens, self.failure = None, None

    def run(self, at: float, tally: Tally) -> None:
        time.sleep(max(0.0, at - time.monotonic()))
        t0 = time.perf_counter()
        try:
            job = self.c.submit(*self.args, api_name=API[self.kind])
            seen = 0
            while True:
                finished = job.done()
                now = time.perf_counter() - t0
                if self.started is None and job.status().code.name in STARTED:
                    self.started = now
                outs = job.outputs()
                if self.first is None and any(has_token(o) for o in outs[seen:]):
                    self.first = now
                seen = len(outs)
                if finished:
                    break
                if now > JOB_TIMEOUT_S:
                    job.cancel()
                    raise TimeoutError(f"no answer within {JOB_TIMEOUT_S:.0f} s")
                time.sleep(POLL_S)
            job.result()                          # raises what the server raised
            text = answer_text(job.outputs())
            self.done = now
            if "⚠" in text or "Traceback" in text or 'class="walk idle"' in text:
                raise RuntimeError("the answer carries an error: " + re.sub(r"<[^>]+>", " ", text)[-200:])
            m = DONE_TOKENS.search(text)
            self.tokens = int(m.group(1)) if m else None
            if self.first is None and self.kind == "walk":
                self.first = self.done            # not streamed: the whole walk arrives at once
        except Exception as exc:                 # noqa: BLE001 - every failure is counted
            self.failure = exc
            self.done = None
            tally.failure(exc, self.kind)


def figures(visits: list[Visit]) -> dict:
    ok = [v for v in visits if v.failure is None and v.done is not None]
    first, done = [v.first for v in ok if v.first is not None], [v.done for v in ok]
    tokens = [v.tokens for v in ok if v.tokens is not None]
    return {"n": len(ok), "first_token_p50_s": pct(first, 0.5), "first_token_max_s": round(max(first), 3) if first else None,
            "done_p50_s": pct(done, 0.5), "done_max_s": round(max(done), 3) if done else None,
            "queue_wait_p50_s": pct([v.started for v in ok if v.started is not None], 0.5),
            "tokens_p50": pct(tokens, 0.5)}


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) the process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def scenario(url: str, kinds: list[str], status: EngineStatus, server: Server, log) -> dict:
    """len(kinds) visitors, each its own session, pressing within WINDOW_S; their figures per kind."""
    prompts = class_prompts(len(kinds))
    with ThreadPoolExecutor(8) as pool:                 # client creation is slow: before the window
        clients = list(pool.map(lambda _: client(url), kinds))
    visits = [Visit(c, k, request_args(k, p)) for c, k, p in zip(clients, kinds, prompts)]
    tally, peak, sampling = Tally(), [0], threading.Event()

    def sample():                                        # the engine's rows while the class is served
        while not sampling.is_set():
            s = status.read()
            peak[0] = max(peak[0], (s or {}).get("rows", 0))
            time.sleep(0.25)
    before, cpu0 = status.read() or {}, cpu_s(server.proc.pid)
    t0 = time.monotonic() + 0.5
    threads = [threading.Thread(target=v.run, args=(t0 + WINDOW_S * i / len(visits), tally))
               for i, v in enumerate(visits)]
    sampler = threading.Thread(target=sample, daemon=True) if status.method else None
    [t.start() for t in threads + ([sampler] if sampler else [])]
    [t.join() for t in threads]
    sampling.set()
    after, cpu1 = status.read() or {}, cpu_s(server.proc.pid)
    for c in clients:
        c.close()
    out = {"visitors": len(kinds), "window_s": WINDOW_S, "prompts": prompts,
           "all": figures(visits), "streaming": figures([v for v in visits if v.kind != "walk"]),
           "kinds": {k: figures([v for v in visits if v.kind == k]) for k in dict.fromkeys(kinds)},
           "errors": tally.errors, "refused": tally.refused, "failure_samples": tally.samples[:6],
           "peak_rows": peak[0] if sampler else None, "rss_mb_after": round(rss_mb(server.proc.pid), 1),
           # the server's CPU seconds (all threads) while the class was served, and the engine's stepping
           # seconds (wall; its matmuls use both cores): what is left is the page's own work
           "server_cpu_s": round(cpu1 - cpu0, 2), "engine_steps": after.get("steps", 0) - before.get("steps", 0),
           "engine_busy_s": round(after.get("busy_s", 0.0) - before.get("busy_s", 0.0), 2)}
    log(f"  {len(kinds)} visitors: first token p50 {out['streaming']['first_token_p50_s']} s, max "
        f"{out['streaming']['first_token_max_s']} s; done p50 {out['all']['done_p50_s']} s, last "
        f"{out['all']['done_max_s']} s; errors {tally.errors}, refused {tally.refused}, peak rows {out['peak_rows']}; "
        f"engine busy {out['engine_busy_s']} s in {out['engine_steps']} steps, server CPU {out['server_cpu_s']} s")
    return out


def disconnect(url: str, status: EngineStatus, server: Server) -> dict:
    """A visitor leaves mid-answer: its row must be freed (engine status), and a short request after it
    must finish about as fast as one alone (timing evidence, whatever the app exposes)."""
    def short() -> float:
        c = client(url)
        t = time.perf_counter()
        c.predict(*generate_args(class_prompts(1)[0], 32), api_name="/generate")
        c.close()
        return round(time.perf_counter() - t, 3)
    solo_s, rss_before = short(), rss_mb(server.proc.pid)
    c = client(url)
    job = c.submit(*generate_args(LONG_PROMPT, 256), api_name="/generate")
    end = time.monotonic() + 60
    while time.monotonic() < end and not any(has_token(o) for o in job.outputs()) and not job.done():
        time.sleep(POLL_S)
    time.sleep(1.0)                                       # mid-answer
    during, finished_first = status.read(), job.done()
    job.cancel()
    t_cancel = time.perf_counter()
    c.close()
    freed_s = None
    if status.method:
        idle = status.wait_idle(timeout=15)
        freed_s = round(time.perf_counter() - t_cancel, 3) if idle else None
    follow_s = short()
    rows_during = (during or {}).get("rows")
    freed = None if not status.method or finished_first else (freed_s is not None and bool(rows_during))
    return {"method": status.method, "rows_before_leaving": rows_during, "freed": freed, "freed_after_s": freed_s,
            "answer_finished_before_cancel": finished_first, "solo_32_tokens_s": solo_s,
            "after_leaving_32_tokens_s": follow_s, "prompt_after_leaving": follow_s <= 2 * solo_s + 3,
            "rss_mb_before": round(rss_before, 1), "rss_mb_after": round(rss_mb(server.proc.pid), 1)}


def commit() -> str:
    def git(*a):
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return git("rev-parse", "HEAD") + (" (dirty)" if git("status", "--porcelain", "--untracked-files=no") else "")


def run(scenarios=SCENARIOS, extra_env: dict | None = None, log=print) -> dict:
    work = Path(tempfile.mkdtemp(prefix="ssd-classroom-"))
    (work / "gradio").mkdir()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = Server(port, work / "gradio", extra_env or {})
    report = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "commit": commit(),
              "machine": {"cpu": _cpu(), "cores": os.cpu_count(), "load_1m_start": round(os.getloadavg()[0], 2)},
              "settings": {"window_s": WINDOW_S, "max_new_tokens": MAX_NEW, "strategy": DEFAULTS["strategy"],
                           "draft": DEFAULTS["draft"], "space": True, "pause_s": PAUSE_S, "mix": list(MIX)},
              "scenarios": {}}
    try:
        server.wait_for("Running on", 180)
        server.wait_for("domain map", 180)
        warm = client(url)                                # every model event once, before anything is timed
        for kind in ("generate", "race", "walk"):
            warm.predict(*request_args(kind, class_prompts(1)[0], 32), api_name=API[kind])
        warm.close()
        status = EngineStatus(url, server)
        status.wait_idle()
        time.sleep(2)
        report["rss_mb_warm"] = round(rss_mb(server.proc.pid), 1)
        report["engine_status"] = status.method
        log(f"warm: RSS {report['rss_mb_warm']:.0f} MB; engine status from {status.method}")
        for name in scenarios:
            if name == "disconnect":
                continue
            status.wait_idle()
            time.sleep(PAUSE_S)
            kinds = list(MIX) if name == "mix" else ["generate"] * int(name)
            log(f"scenario {name} …")
            report["scenarios"][name] = scenario(url, kinds, status, server, log)
        if "disconnect" in scenarios:
            status.wait_idle()
            time.sleep(PAUSE_S)
            report["disconnect"] = disconnect(url, status, server)
            log(f"  disconnect: {report['disconnect']}")
        report["rss_mb_end"] = round(rss_mb(server.proc.pid), 1)
        report["machine"]["load_1m_end"] = round(os.getloadavg()[0], 2)
        report["server_exit"] = server.proc.poll()
        report["checks"] = {k: v for part in CHECKS.values() for k, v in part(report).items()}
        return report
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated, of " + ",".join(SCENARIOS))
    ap.add_argument("--out", default=None, help="write the report (JSON) here")
    args = ap.parse_args(argv)
    chosen = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenario(s) {unknown}: choose from {','.join(SCENARIOS)}")
    report = run(chosen, log=lambda *a: print(*a, file=sys.stderr, flush=True))
    text = json.dumps(report, indent=1, ensure_ascii=False)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    failed = [k for k, ok in report["checks"].items() if not ok]
    if failed:
        print("failed: " + ", ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
