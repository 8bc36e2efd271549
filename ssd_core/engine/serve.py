"""The serving engine: one thread owns the model and steps every visitor's sequence in one batch.

The shape of vLLM's scheduler/worker split, written small. A caller's `decode()` (engine.decode) hands
its Row to `Engine.submit` and reads that request's own events; the engine thread loops: admit waiting
requests (within `max_rows` and a KV budget in bytes), take one `rows.advance` step over every request
that wants one (continuous batching: requests join and leave between steps; a newcomer's prompt is
prefilled in chunks beside the others' steps), hand each event to its request. A request ends at EOS,
max tokens, its `should_stop`, or when its reader closes the generator (a visitor who left: the row
and its memory are freed at the next step).

A request may let the engine run ahead of its reader (lookahead None: up to BUFFER events) or step
only when its reader asks (lookahead 0: a race's two laps then alternate as `race.lockstep` pulls).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque

from .decode import Waiting
from .kv_cache import KVPool, bytes_per_position
from .rows import Row, advance

log = logging.getLogger(__name__)

BUFFER = 64            # most undelivered events of a free-running request before the engine waits for its reader
PREFILL_CHUNK = 256    # prompt tokens per step over all rows, while others decode (each stall ≈ one chunk)
_END = object()


class Request:
    """One submitted row and its event queue (filled by the engine, read by the submitter's generator)."""

    def __init__(self, engine: "Engine", row: Row, lookahead: int | None, group=None):
        self.engine, self.row, self.lookahead, self.group = engine, row, lookahead, group
        self.cv = threading.Condition(engine._lock)     # its reader waits here; only its own events wake it
        self.events: deque = deque()
        self.asked = False            # its reader is waiting for an event
        self.closed = False           # its reader left
        self.admitted = False
        self.held = False             # the engine looked and it did not fit: only now is it waiting
        self.error: BaseException | None = None

    def wants_step(self) -> bool:
        if self.closed or self.row.finished:
            return False
        if self.lookahead is None:
            return len(self.events) < BUFFER
        return self.asked and len(self.events) <= self.lookahead


class Engine:
    """Owns the backbone's forward passes while it serves; `decode()` on any other thread goes through it."""

    def __init__(self, backbone, max_rows: int = 16, kv_budget_mb: float = 1024, rule=None,
                 chunk: int = PREFILL_CHUNK, slot_len: int = 1024):
        self.bb, self.max_rows, self.kv_budget = backbone, max_rows, int(kv_budget_mb * 1e6)
        self.rule, self.chunk = rule, chunk
        # one lock; the engine thread waits on _cv, each reader on its own Request.cv: a step wakes only
        # the readers it gave events to (one shared condition woke every reader at every event, and each
        # woken reader woke all the others: with 16 readers the engine starved, 1.5 s a step)
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._waiting: deque[Request] = deque()
        self._active: list[Request] = []
        self._thread: threading.Thread | None = None
        self._owner: threading.Thread | None = None   # the thread that runs the loop
        # the rows' caches: a slot each of up to `slot_len` positions, reserved (zeroed) now within the KV
        # budget, so serving a class does not grow the process; a longer row, or one beyond the slots
        # (a race's second lap may join past max_rows), gets a cache of its own
        bb = backbone
        slot_len = max(1, min(slot_len, bb.max_positions, self.kv_budget // (max_rows * bytes_per_position(bb))))
        self.pool = KVPool(bb.n_layers, bb.n_kv, max_rows, slot_len, bb.head_dim, bb.dtype, bb.device)
        self._stop = False
        self.steps = 0                 # engine steps taken (tests, the status line)
        self.busy_s = 0.0              # seconds spent stepping (the load tests: model time vs the page's)
        self.last_rows = 0             # rows in the last step

    # --- life cycle -----------------------------------------------------------------------------------
    def attach(self, thread: bool = True) -> "Engine":
        """Route the backbone's `decode()` calls through this engine and start serving them: on a thread
        of its own, or (thread=False) on the caller's thread when it calls `run()` — requests queue until
        then. Prefer the thread that loaded the model: torch's OpenMP workers are made per thread that
        starts parallel work, and a second thread's step ran ~30% slower here (AMD EPYC, 2 cores;
        16 one-token rows: 146 vs 97 ms) once the first had run torch."""
        self.bb.engine = self
        if thread:
            self._thread = threading.Thread(target=self.run, name="ssd-engine", daemon=True)
            self._thread.start()
        return self

    def run(self) -> None:
        """Serve on this thread until `close()`."""
        self._owner = threading.current_thread()
        self._loop()

    def close(self) -> None:
        if getattr(self.bb, "engine", None) is self:
            self.bb.engine = None
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    def serving(self) -> bool:
        """Whether a decode() call here should go through the engine (not on the engine's own thread)."""
        return not self._stop and threading.current_thread() is not self._owner

    # --- what callers see ---------------------------------------------------------------------------
    def submit(self, row: Row, lookahead: int | None = None, report_wait: bool = False, group=None):
        """Queue `row`; yield its events as the engine produces them (Waiting ones if report_wait).
        group: requests one reader alternates between (a race's two laps): once one of them runs, the
        others join at once, caps or not — the reader could otherwise wait on a lap that waits on it."""
        req = Request(self, row, lookahead, group)
        with self._lock:
            self._waiting.append(req)
            self._cv.notify()
        shown = None
        try:
            while True:
                with self._lock:
                    while not req.events:
                        if report_wait and req.held and not req.admitted:
                            pos = self._position(req)
                            if pos and pos != shown:
                                break
                        if not req.asked:
                            req.asked = True
                            if req.lookahead is not None:
                                self._cv.notify()       # it steps only when asked: tell the engine
                        req.cv.wait(timeout=1.0)
                    req.asked = False
                    full = len(req.events) >= BUFFER
                    ev = req.events.popleft() if req.events else None
                    if ev is None:
                        shown = self._position(req)
                        ev = Waiting(shown, self._wait_reason(req))
                    if full:
                        self._cv.notify()               # room in its buffer again
                if ev is _END:
                    if req.error is not None:
                        raise req.error
                    return
                yield ev
        finally:                       # the reader left (GeneratorExit) or finished: free the row
            with self._lock:
                req.closed = True
                if req in self._waiting:
                    self._waiting.remove(req)
                self._cv.notify()

    def _position(self, req: Request) -> int:
        try:
            return self._waiting.index(req) + 1
        except ValueError:
            return 0

    def _wait_reason(self, req: Request) -> str:
        if len(self._active) >= self.max_rows:
            return f"all {self.max_rows} rows busy"
        return f"KV memory: {self._kv_used() / 1e6:.0f} of {self.kv_budget / 1e6:.0f} MB in use"

    def status(self) -> dict:
        """Rows decoding, requests waiting, KV memory in use (bytes) — for the page and the tests."""
        with self._cv:
            return {"rows": len(self._active), "waiting": len(self._waiting), "kv_bytes": self._kv_used(),
                    "kv_budget": self.kv_budget, "max_rows": self.max_rows, "steps": self.steps,
                    "busy_s": round(self.busy_s, 3)}

    # --- the engine thread ----------------------------------------------------------------------------
    def _kv_used(self) -> int:
        return sum(r.row.kv_bytes() for r in self._active)

    def _admit(self) -> None:
        """Waiting requests join in arrival order while rows and KV memory allow; on an idle engine the
        first joins whatever its size. A request whose group already runs joins at once (`submit`): a
        race holds at most one row beyond the caps, and its reader never waits on itself."""
        running = {id(r.group) for r in self._active if r.group is not None}
        for req in [w for w in self._waiting if w.group is not None and id(w.group) in running]:
            self._waiting.remove(req)
            self._join(req)
        while self._waiting:
            req = self._waiting[0]
            fits = len(self._active) < self.max_rows and self._kv_used() + req.row.kv_bytes() <= self.kv_budget
            if not (fits or not self._active):
                for w in self._waiting:       # looked at and held: their readers may report Waiting now
                    w.held = True
                    w.cv.notify()
                return
            self._join(self._waiting.popleft())

    def _join(self, req: Request) -> None:
        req.admitted = True
        self._active.append(req)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while True:
                    if self._stop:
                        for req in self._active + list(self._waiting):
                            req.events.append(_END)
                            req.cv.notify()
                        return
                    self._drop_finished()
                    self._admit()
                    ready = [r for r in self._active if r.wants_step()]
                    if ready:
                        break
                    self._cv.wait(timeout=0.5)
                rows = [r.row for r in ready]
            t_step = time.perf_counter()
            try:
                out = advance(self.bb, rows, self.chunk, self.rule.choose if self.rule is not None else None,
                              self.pool)
            except Exception as exc:   # noqa: BLE001 - the step's requests fail, the engine keeps serving
                log.exception("engine step failed")
                with self._cv:
                    for req in ready:
                        req.error, req.row.finished = exc, True
                        req.events.append(_END)
                        req.cv.notify()
                continue
            with self._cv:
                self.busy_s += time.perf_counter() - t_step
                self.steps += 1
                self.last_rows = len(rows)
                by_row = {id(r.row): r for r in ready}
                for row, ev in out:
                    by_row[id(row)].events.append(ev)
                for req in ready:
                    if req.row.finished:
                        req.events.append(_END)
                    if req.events:
                        req.cv.notify()

    def _drop_finished(self) -> None:
        keep = []
        for req in self._active:
            if req.closed or req.row.finished:
                if not req.row.finished:
                    req.row.finished = True
                cache, req.row.cache = req.row.cache, None     # its KV memory goes back now
                if cache is not None and cache.pool is not None:
                    cache.pool.give(cache)
            else:
                keep.append(req)
        self._active = keep


def wait_idle(engine: Engine, timeout: float = 30.0) -> bool:
    """Until no request is active or waiting (tests)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        s = engine.status()
        if not s["rows"] and not s["waiting"]:
            return True
        time.sleep(0.01)
    return False
