"""Soak test for a running app (not collected by pytest; run it by hand).

    python app.py &                                   # serve on 127.0.0.1:7860
    python tests/soak.py --url http://127.0.0.1:7860 --requests 40 --rate 0.5 --out assets/bench/soak.json

Sends N requests at a bounded rate (requests per second) to the local server only, with a few
concurrent clients, and reports errors, latency percentiles (p50 / p95) and the server's memory
before and after (RSS of the process listening on the port, read from /proc).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import threading
import time
from urllib.parse import urlparse

PROMPTS = [
    "Summarize: The river festival drew a record crowd this weekend despite the rain.",
    "Solve step by step: Ana buys 4 pens at $1.25 each. How much does she pay?",
    "Translate German to English: Der Hund schläft unter dem Tisch.",
    "Write a SQL query that counts orders per customer in orders(id, customer_id, total).",
    "Write a Python function that reverses a string.",
    "What is the boiling point of water at sea level?",
    "",                                   # bad input on purpose: must be answered, not crash
    "x" * 20000,                          # oversize on purpose: truncated with a notice
]


def server_rss_mb(port: int) -> float | None:
    """RSS of the process that listens on `port` (Linux /proc; None if it cannot be found)."""
    inode = None
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                for line in f.readlines()[1:]:
                    parts = line.split()
                    if int(parts[1].split(":")[1], 16) == port and parts[3] == "0A":
                        inode = parts[9]
        except OSError:
            continue
    if inode is None:
        return None
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                    with open(f"/proc/{pid}/status") as st:
                        for row in st:
                            if row.startswith("VmRSS:"):
                                return int(row.split()[1]) / 1024
        except OSError:
            continue
    return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:7860")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--rate", type=float, default=0.5, help="requests started per second (bounded)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--api", default="/generate_text")
    ap.add_argument("--timeout", type=float, default=600.0, help="whole soak stops after this many s")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    host = urlparse(args.url).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit("the soak only targets a server on this machine (127.0.0.1 / localhost)")
    from gradio_client import Client

    port = urlparse(args.url).port or 80
    rss_before = server_rss_mb(port)
    latencies, errors, lock = [], [], threading.Lock()
    deadline = time.monotonic() + args.timeout
    rng = random.Random(0)
    jobs = [rng.choice(PROMPTS) for _ in range(args.requests)]

    def worker(my_jobs):
        client = Client(args.url, verbose=False)
        for prompt in my_jobs:
            if time.monotonic() > deadline:
                return
            t = time.perf_counter()
            try:
                client.predict(prompt, "KNN-SSD", args.max_new_tokens, api_name=args.api)
                with lock:
                    latencies.append(time.perf_counter() - t)
            except Exception as exc:           # every failure is counted, none stops the soak
                with lock:
                    errors.append(repr(exc)[:200])

    threads = []
    per_client = [jobs[i::args.clients] for i in range(args.clients)]
    for i, chunk in enumerate(per_client):
        th = threading.Thread(target=worker, args=(chunk,), daemon=True)
        th.start()
        threads.append(th)
        time.sleep(1.0 / args.rate)
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    rss_after = server_rss_mb(port)
    lat = sorted(latencies)
    report = {
        "requests": args.requests, "completed": len(lat), "errors": len(errors),
        "error_samples": errors[:5],
        "p50_s": round(statistics.median(lat), 2) if lat else None,
        "p95_s": round(lat[min(len(lat) - 1, int(0.95 * len(lat)))], 2) if lat else None,
        "rss_mb_before": rss_before and round(rss_before, 1),
        "rss_mb_after": rss_after and round(rss_after, 1),
        "settings": vars(args),
    }
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
