"""How long `python app.py` takes to start, cold and warm, measured from outside.

    python -m ssd_core.tools.startup_bench --out assets/bench/startup.json

Cold: an empty HOME and an empty model cache (HOME and KNN_SSD_CACHE set to fresh temporary folders),
as on a new machine or a rebuilt Space: the app converts the embedded GGUF on its first run. Warm: the
next launches with the same folders (the model read from the cache). Each launch starts `python app.py`
as a subprocess on a free port, reads the line the app prints ("start-up (cold…): X s (imports …, model
…)"), polls its port until the server answers HTTP, then stops it (so that the UMAP map's background
compilation never overlaps the next launch). The JSON holds every launch, the medians per kind, the CPU
model (/proc/cpuinfo), its vector flags, the cores, the app's threads, the commit and the date.

The environment is the caller's, less what would change what is measured: SPACE_ID (the public Space's
caps), OMP_WAIT_POLICY (the app leaves OpenMP's wait policy at its default), KNN_SSD_CACHE and the
XDG/HF cache folders (so they follow the empty HOME). This module imports neither gradio nor torch.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

from ssd_core.engine.cpuinfo import VECTOR_FLAGS, read_cpuinfo   # torch-free

ROOT = Path(__file__).resolve().parents[2]
DROPPED_ENV = ("SPACE_ID", "OMP_WAIT_POLICY", "KNN_SSD_CACHE", "XDG_CACHE_HOME", "XDG_CONFIG_HOME",
               "XDG_DATA_HOME", "HF_HOME", "HF_HUB_CACHE", "TRANSFORMERS_CACHE", "NUMBA_CACHE_DIR",
               "GRADIO_TEMP_DIR", "GRADIO_SERVER_PORT", "GRADIO_SERVER_NAME")
# the app's line: "start-up (cold: first run converts the GGUF): 18.4 s (imports 6.0 s, model 10.0 s,
# calibration 0.5 s, warm-up beside the UI build 2.0 s; ...)"
STARTUP_LINE = re.compile(r"start-up \((cold|warm)[^)]*\): ([\d.]+) s \((.*)")
PHASES = {"imports_s": r"imports ([\d.]+) s", "model_s": r"model ([\d.]+) s",
          "calibration_s": r"calibration (-?[\d.]+) s", "warmup_ui_s": r"warm-up beside the UI build ([\d.]+) s"}
FIGURES = ("http_s", "running_on_s", "reported_s", "imports_s", "model_s", "calibration_s", "warmup_ui_s")


def cpu() -> dict:
    """The CPU's name and vector flags (/proc/cpuinfo, else lscpu, else platform) and its logical cores."""
    model, flags = read_cpuinfo()
    if not model and shutil.which("lscpu"):
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        found = re.search(r"^Model name:\s*(.+)$", out, re.M)
        model = found.group(1).strip() if found else ""
    return {"model": model or platform.processor() or platform.machine(),
            "flags": [f for f in VECTOR_FLAGS if f in flags], "cores": os.cpu_count()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_1min() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) jiffies of the whole machine so far (/proc/stat), or None where there is none."""
    try:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = values[3] + (values[4] if len(values) > 4 else 0)          # idle + iowait
    return sum(values) - idle, sum(values)


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def git_commit() -> str | None:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return head + ("+uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def app_env(home: Path, port: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
    env.update({"HOME": str(home), "KNN_SSD_CACHE": str(home / "knn-ssd-cache"),
                "GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(port),
                "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1"})
    return env


def parse_startup(text: str) -> dict:
    """The app's start-up line → {kind, reported_s, imports_s, model_s, calibration_s, warmup_ui_s}."""
    found = STARTUP_LINE.search(text)
    if not found:
        return {}
    out = {"kind": found.group(1), "reported_s": float(found.group(2))}
    for name, pattern in PHASES.items():
        phase = re.search(pattern, found.group(3))
        if phase:
            out[name] = float(phase.group(1))
    return out


def answers_http(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def launch(home: Path, expect: str, app_args: list[str], timeout_s: float) -> dict:
    """One `python app.py` from start to the first HTTP answer on its port; the app is stopped after."""
    port = free_port()
    load = load_1min()
    ticks, app_cpu = cpu_ticks(), children_cpu_s()
    lines: list[str] = []
    seen: dict[str, float] = {}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "app.py", *app_args], cwd=ROOT, env=app_env(home, port),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def read():
        for line in proc.stdout:
            lines.append(line)
            if "Running on" in line and "running_on_s" not in seen:
                seen["running_on_s"] = time.perf_counter() - t0

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    url = f"http://127.0.0.1:{port}/"
    http_s = None
    try:
        while time.perf_counter() - t0 < timeout_s:
            if proc.poll() is not None:
                break
            if answers_http(url):
                http_s = time.perf_counter() - t0
                break
            time.sleep(0.1)
    finally:
        ticks_end = cpu_ticks()
        stop(proc)
        reader.join(timeout=5)
    app_cpu = children_cpu_s() - app_cpu
    busy = None
    if ticks and ticks_end and ticks_end[1] > ticks[1]:
        busy = round((ticks_end[0] - ticks[0]) / (ticks_end[1] - ticks[1]), 2)
    text = "".join(lines)
    if http_s is None:
        why = f"exited with {proc.returncode}" if proc.returncode not in (None, -15) else f"no answer in {timeout_s} s"
        raise SystemExit(f"`python app.py` did not answer on its port ({why}):\n{text[-3000:]}")
    record = {"expected": expect, **parse_startup(text), "http_s": round(http_s, 2),
              "running_on_s": round(seen["running_on_s"], 2) if "running_on_s" in seen else None,
              "load_1m_before": load, "machine_busy": busy, "app_cpu_s": round(app_cpu, 1)}
    if record.get("kind") != expect:
        raise SystemExit(f"expected a {expect} start, the app printed: {record.get('kind')!r}\n{text[-3000:]}")
    return record


def medians(runs: list[dict]) -> dict:
    out = {"launches": len(runs)}
    for name in FIGURES:
        values = [r[name] for r in runs if r.get(name) is not None]
        if values:
            out[name] = round(statistics.median(values), 2)
            out[name + "_range"] = [min(values), max(values)]
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="assets/bench/startup.json")
    ap.add_argument("--cold", type=int, default=2, help="cold launches, each with a fresh HOME and cache")
    ap.add_argument("--warm", type=int, default=3, help="warm launches after the last cold one, same folders")
    ap.add_argument("--timeout", type=float, default=300, help="seconds one launch may take to answer")
    ap.add_argument("--pause", type=float, default=3.0, help="seconds between launches (the machine settles)")
    ap.add_argument("app_args", nargs="*", help="passed to app.py after `--`, e.g. -- --model ...")
    args = ap.parse_args(argv)
    if args.cold < 1:
        raise SystemExit("--cold must be at least 1: the warm launches reuse the last cold launch's folders")
    started = datetime.now(timezone.utc)
    runs, homes = [], []
    try:
        for i in range(args.cold):
            home = Path(tempfile.mkdtemp(prefix="startup-home-"))
            homes.append(home)
            runs.append(launch(home, "cold", args.app_args, args.timeout))
            print(f"cold {i + 1}/{args.cold}: {runs[-1]}", flush=True)
            time.sleep(args.pause)
        for i in range(args.warm):
            runs.append(launch(homes[-1], "warm", args.app_args, args.timeout))
            print(f"warm {i + 1}/{args.warm}: {runs[-1]}", flush=True)
            time.sleep(args.pause)
    finally:
        for home in homes:
            shutil.rmtree(home, ignore_errors=True)
    result = {
        "command": "python -m ssd_core.tools.startup_bench " + " ".join(argv if argv is not None else sys.argv[1:]),
        "started": started.isoformat(timespec="seconds"),
        "total_s": round((datetime.now(timezone.utc) - started).total_seconds(), 1),
        "commit": git_commit(),
        "machine": {"cpu": cpu(), "app_threads": _app_threads(args.app_args), "python": platform.python_version(),
                    "platform": platform.platform(), "load_1m_end": load_1min()},
        "definitions": {
            "http_s": "seconds from starting `python app.py` to the first HTTP 200 on its port: what a visitor waits",
            "running_on_s": "seconds until Gradio printed 'Running on'",
            "reported_s": "the app's own figure (from its first line of code to the start-up line, before the "
                          "server starts): imports_s + model_s + calibration_s + warmup_ui_s",
            "cold": "empty HOME and KNN_SSD_CACHE: the first run converts the embedded GGUF",
            "warm": "the same folders again: the model is read from the cache",
            "machine_busy": "share of all cores busy (any process) from the start to the HTTP answer (/proc/stat)",
            "app_cpu_s": "CPU seconds the app used, start to stop (it is stopped right after the HTTP answer): "
                         "well below machine_busy × cores × http_s means other processes took the cores"},
        "median": {"cold": medians([r for r in runs if r["expected"] == "cold"]),
                   "warm": medians([r for r in runs if r["expected"] == "warm"])},
        "runs": runs,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    cold, warm = result["median"]["cold"], result["median"]["warm"]
    print(f"{out}: cold {cold.get('http_s')} s, warm {warm.get('http_s')} s to the first HTTP answer "
          f"(medians; {result['machine']['cpu']['model']}, {result['machine']['cpu']['cores']} cores)")


def _app_threads(app_args: list[str]) -> int:
    """The torch threads the app runs with: its --threads flag, default 2 (app.py)."""
    for i, a in enumerate(app_args):
        if a == "--threads" and i + 1 < len(app_args):
            return int(app_args[i + 1])
        if a.startswith("--threads="):
            return int(a.split("=", 1)[1])
    return 2


if __name__ == "__main__":
    main()
