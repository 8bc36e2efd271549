"""Load test of the app as a public Space serves it (`SPACE_ID` set), on loopback only.

    python tests/loadtest.py --duration 120 --baseline 60 --out assets/bench/loadtest.json

Starts `python app.py` with SPACE_ID set and a fresh Gradio upload folder, waits for the domain map, then:
1. baseline: 4 visitors generating 32-token answers, alone, for --baseline seconds;
2. mixed, for --duration seconds: the same 4 generating visitors, plus 4 replaying a long trace at 0.5×,
   4 in Step-through auto-play (their walks started before the window) and 4 sending bad inputs.
Every visitor is a gradio_client Client (its own session) calling the app's own events (/generate,
/replay, /walk_start, /walk_auto, /race), as the page does. It reports, for the generating visitors, p50/p95
end-to-end time and queue wait (submit → the server starts it) in each phase; refusals of normal requests;
errors; the server's RSS after warm-up and at the end; files left in the upload folder. Exit status 1 when
a done-when check fails (see CHECKS), so a marked test can run it. Request loops are bounded in time.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from viz.limits import UPLOAD_GRACE_S  # noqa: E402
GEN_PROMPTS = [
    "Summarize: The town council voted to turn the old rail yard into a park with a community garden.",
    "Solve step by step: A baker sells 14 loaves a day for 6 days. How many loaves is that?",
    "Translate German to English: Morgen fahren wir mit dem Zug nach Hamburg.",
    "Write a Python function that returns the largest even number in a list.",
]
LONG_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
DEFAULTS = dict(strategy="KNN-SSD", oracle_domain="math", gamma=4, threshold=0.0, temperature=0.0, top_p=1.0, k=5,
                draft="int8 + prompt lookup", seed=None)
STARTED = {"PROCESSING", "ITERATING", "PROGRESS", "FINISHED"}
CHECKS = {  # done-when of the Space issue
    "p95_within_1_5x_baseline": lambda r: r["mixed"]["e2e_p95_s"] <= 1.5 * r["baseline"]["e2e_p95_s"],
    "no_normal_request_refused": lambda r: r["refused"] == 0,
    "no_errors": lambda r: r["errors"] == 0,
    "rss_end_within_15pct_of_warm": lambda r: r["rss_mb_end"] <= 1.15 * r["rss_mb_warm"],
    "no_files_left": lambda r: r["files_left"] == 0,
}


def rss_mb(pid: int) -> float:
    for row in Path(f"/proc/{pid}/status").read_text().splitlines():
        if row.startswith("VmRSS:"):
            return int(row.split()[1]) / 1024
    return float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def files_under(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


def pct(xs, q):
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else None


class Server:
    """`python app.py` as a public Space would run it, on 127.0.0.1, its output kept for the report."""

    def __init__(self, port: int, upload_dir: Path, extra_env: dict):
        # the caller's environment (under pytest: the session's own KNN_SSD_CACHE, tests/conftest.py), less
        # OMP_WAIT_POLICY, which conftest sets for the tests' threads and a Space does not (PASSIVE doubles
        # an int8 draft step)
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        env = {**env, "SPACE_ID": "loadtest/local", "GRADIO_SERVER_NAME": "127.0.0.1",
               "GRADIO_SERVER_PORT": str(port), "GRADIO_TEMP_DIR": str(upload_dir),
               "GRADIO_ANALYTICS_ENABLED": "False", "PYTHONUNBUFFERED": "1", **extra_env}
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "app.py")], cwd=ROOT, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    def wait_for(self, pattern: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(pattern in line for line in self.lines):
                return
            if self.proc.poll() is not None:
                raise RuntimeError("the app exited:\n" + "\n".join(self.lines[-30:]))
            time.sleep(0.2)
        raise TimeoutError(f"no {pattern!r} within {timeout} s:\n" + "\n".join(self.lines[-30:]))

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def client(url: str):
    from gradio_client import Client
    return Client(url, verbose=False)


def generate_args(prompt: str, max_new: int) -> list:
    d = DEFAULTS
    return [prompt, d["strategy"], d["oracle_domain"], max_new, d["gamma"], d["threshold"], d["temperature"],
            d["top_p"], d["k"], d["draft"], d["seed"]]


def timed_job(c, args, api_name: str, stop_at: float):
    """(end-to-end s, queue wait s, result) of one request, its status polled every 20 ms."""
    t0 = time.perf_counter()
    job = c.submit(*args, api_name=api_name)
    started = None
    while not job.done():
        if started is None and job.status().code.name in STARTED:
            started = time.perf_counter()
        if time.monotonic() > stop_at + 300:
            job.cancel()
            raise TimeoutError("request did not finish")
        time.sleep(0.02)
    result = job.result()
    end = time.perf_counter()
    return end - t0, (started or end) - t0, result


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.e2e, self.wait, self.refused, self.errors, self.samples, self.counts = [], [], 0, 0, [], {}

    def count(self, kind: str):
        with self.lock:
            self.counts[kind] = self.counts.get(kind, 0) + 1

    def failure(self, exc: BaseException, what: str):
        text = f"{what}: {exc!r}"[:300]
        refused = any(w in text for w in ("already have", "Queue is full", "queue is full", "limit here"))
        with self.lock:
            if refused:
                self.refused += 1
            else:
                self.errors += 1
            self.samples.append(text)


def generating_visitor(url, i, stop_at, tally: Tally):
    c = client(url)
    n = 0
    while time.monotonic() < stop_at:
        prompt = GEN_PROMPTS[(i + n) % len(GEN_PROMPTS)]
        n += 1
        try:
            e2e, wait, result = timed_job(c, generate_args(prompt, 32), "/generate", stop_at)
            if "Traceback" in json.dumps(result, default=str) or "⚠" in str(result[0]):
                raise RuntimeError("the answer carries an error: " + str(result[0])[:200])
            with tally.lock:
                tally.e2e.append(e2e)
                tally.wait.append(wait)
        except Exception as exc:                 # noqa: BLE001 - every failure is counted
            tally.failure(exc, "generate")
    c.close()


def replaying_visitor(url, trace_path, stop_at, tally: Tally):
    from gradio_client import handle_file
    c = client(url)
    while time.monotonic() < stop_at:
        try:
            out = c.predict(handle_file(trace_path), "0.5×", api_name="/replay")
            if "Cannot" in str(out[0]) or "⚠" in str(out[0]):
                raise RuntimeError("replay refused: " + str(out[0])[:200])
            tally.count("replays")
        except Exception as exc:                 # noqa: BLE001
            tally.failure(exc, "replay")
    c.close()


def walking_visitor(c, stop_at, tally: Tally):
    while time.monotonic() < stop_at:
        try:
            out = c.predict(api_name="/walk_auto")
            tally.count("auto_play_clicks")
            if "complete" in str(out):              # the answer is done: a teacher reads it for a moment
                time.sleep(1.0)
        except Exception as exc:                 # noqa: BLE001
            tally.failure(exc, "walk_auto")
    c.close()


def bad_visitor(url, i, stop_at, tally: Tally, bad_files):
    """Bad inputs through the same events: each must come back as a message, never an error or a refusal."""
    from gradio_client import handle_file
    c = client(url)
    cases = [
        ("/generate", generate_args("", 32)), ("/generate", generate_args("   \n ", 32)),
        ("/generate", generate_args("hello", 10 ** 7)), ("/race", generate_args("", 32)),
        ("/generate", [*generate_args("hello", 32)[:4], 0, *generate_args("hello", 32)[5:]]),
        ("/generate", [*generate_args("hello", 32)[:10], -4]),
        ("/replay", [handle_file(bad_files[0]), "1×"]), ("/replay", [handle_file(bad_files[1]), "1×"]),
        ("/walk_start", ["", "KNN-SSD", "math", 4, 5]),
    ]
    n = i
    while time.monotonic() < stop_at:
        api, args = cases[n % len(cases)]
        n += 1
        try:
            out = c.predict(*args, api_name=api)
            text = json.dumps(out, default=str, ensure_ascii=False)
            if "⚠" not in text and "Type a prompt" not in text:
                raise RuntimeError(f"{api} accepted bad input: {text[:200]}")
            tally.count("bad_inputs_answered")
        except Exception as exc:                 # noqa: BLE001
            if type(exc).__name__ == "AppError" and re.search(r"Value .* (greater|less) than", str(exc)):
                tally.count("bad_inputs_answered")      # Gradio's own range check on a slider: a sentence too
                continue
            tally.failure(exc, f"bad input {api}")
        time.sleep(0.5)
    c.close()


def summary(t: Tally) -> dict:
    return {"requests": len(t.e2e), "e2e_p50_s": pct(t.e2e, 0.5), "e2e_p95_s": pct(t.e2e, 0.95),
            "wait_p50_s": pct(t.wait, 0.5), "wait_p95_s": pct(t.wait, 0.95),
            "service_p50_s": round(statistics.median([e - w for e, w in zip(t.e2e, t.wait)]), 3) if t.e2e else None}


def long_trace(url: str, folder: Path) -> Path:
    """A long trace made through the app's own Generate event: its download link, saved as the browser would."""
    c = client(url)
    out = c.predict(*generate_args(LONG_PROMPT, 256), api_name="/generate")
    c.close()
    link = str(out[-1])
    payload = re.search(r'href="data:application/json;base64,([^"]+)"', link)
    if not payload:
        raise RuntimeError("no trace link in the Generate output: " + link[:200])
    path = folder / "long-trace.json"
    path.write_bytes(base64.b64decode(payload.group(1)))
    return path


def run(duration: float, baseline: float, extra_env: dict | None = None, log=print) -> dict:
    work = Path(tempfile.mkdtemp(prefix="ssd-load-"))
    uploads = work / "gradio"
    uploads.mkdir()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = Server(port, uploads, extra_env or {})
    try:
        server.wait_for("Running on", 180)
        server.wait_for("domain map", 180)
        trace = long_trace(url, work)
        steps = len(json.loads(trace.read_text())["steps"])
        bad = [work / "not-json.json", work / "not-a-trace.json"]
        bad[0].write_text("{ nope")
        bad[1].write_text('{"question_id": 1, "turns": ["hi"]}')
        # the walkers' Start runs the model (like a Generate) before the window; in it they only auto-play
        walkers = [client(url) for _ in range(4)]
        for w in walkers:                        # a story: the longest of the walks, ~96 tokens
            w.predict(LONG_PROMPT, "KNN-SSD", "story", 4, 5, api_name="/walk_start")
        time.sleep(2)
        rss_warm, files_warm = rss_mb(server.proc.pid), files_under(uploads)
        log(f"warm: RSS {rss_warm:.0f} MB, long trace {steps} steps; baseline {baseline:.0f} s …")

        base = Tally()
        stop_at = time.monotonic() + baseline
        threads = [threading.Thread(target=generating_visitor, args=(url, i, stop_at, base)) for i in range(4)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        log(f"baseline: {summary(base)}; mixed {duration:.0f} s …")

        mixed = Tally()
        stop_at = time.monotonic() + duration
        threads = ([threading.Thread(target=generating_visitor, args=(url, i, stop_at, mixed)) for i in range(4)]
                   + [threading.Thread(target=replaying_visitor, args=(url, str(trace), stop_at, mixed))
                      for _ in range(4)]
                   + [threading.Thread(target=walking_visitor, args=(w, stop_at, mixed)) for w in walkers]
                   + [threading.Thread(target=bad_visitor, args=(url, i, stop_at, mixed, [str(b) for b in bad]))
                      for i in range(4)])
        [t.start() for t in threads]
        [t.join() for t in threads]
        time.sleep(UPLOAD_GRACE_S + 3)          # uploads are deleted that long after they are read
        left = sorted(files_under(uploads) - files_warm)
        left = [f"{name} ({(uploads / name).stat().st_size} B: {(uploads / name).read_bytes()[:40]!r})"
                for name in left]
        report = {
            "settings": {"duration_s": duration, "baseline_s": baseline, "visitors": {
                "generating": 4, "replaying": 4, "auto_play": 4, "bad_input": 4},
                "generate_tokens": 32, "replay_speed": "0.5×", "long_trace_steps": steps, "space": True},
            "baseline": summary(base), "mixed": summary(mixed),
            "refused": base.refused + mixed.refused, "errors": base.errors + mixed.errors,
            "failure_samples": (base.samples + mixed.samples)[:8], "counts": mixed.counts,
            "rss_mb_warm": round(rss_warm, 1), "rss_mb_end": round(rss_mb(server.proc.pid), 1),
            "files_left": len(left), "files_left_names": left[:10],
            "server_exit": server.proc.poll(), "server_tail": server.lines[-12:] if server.proc.poll() is not None else [],
            "machine": {"cpu": _cpu(), "cores": os.cpu_count(), "load_1m_end": round(os.getloadavg()[0], 2)},
        }
        report["p95_ratio"] = (round(report["mixed"]["e2e_p95_s"] / report["baseline"]["e2e_p95_s"], 3)
                               if report["baseline"]["e2e_p95_s"] and report["mixed"]["e2e_p95_s"] else None)
        report["checks"] = {name: bool(check(report)) if report["mixed"]["e2e_p95_s"] else False
                            for name, check in CHECKS.items()}
        return report
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


def _cpu() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of the mixed phase")
    ap.add_argument("--baseline", type=float, default=60.0, help="seconds of the generating visitors alone")
    ap.add_argument("--out", default=None, help="write the report (JSON) here")
    args = ap.parse_args(argv)
    report = run(args.duration, args.baseline)
    text = json.dumps(report, indent=1, ensure_ascii=False)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    return 0 if all(report["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
