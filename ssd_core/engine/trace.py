"""Traces: one run as a JSON file, to keep, attach to a question, and replay without the model.

A trace holds what the app shows about a run: the model, the decode settings, the strategy and its plan
(route with the K nearest anchors, skip set, forecast), and every step's drafted / accepted / rejected /
verifier tokens with the draft's and the verifier's probabilities and the step's timings, plus the text
of every token id it uses (so a replay needs no tokenizer).

The format is versioned: {"format": FORMAT, "version": VERSION, ...}. `Trace.from_json` checks the format,
the version and every field, and raises TraceError with a message that says which field is wrong and why.
`to_json` / `from_json` round-trip exactly: floats are written as Python's repr, which reads back to the
same bits, and the prompt embedding keeps its dtype.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from .decode import DecodeConfig, Start, Step
from .generate import Stats, summarize
from .skipset import SkipSet
from .strategy import Forecast, Neighbour, Route

FORMAT = "knn-ssd-studio/trace"
VERSION = 1
MAX_BYTES = 32 * 2 ** 20            # a 512-token run is well under 1 MB
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16}


class TraceError(ValueError):
    """A file that is not a trace this code can read; the message says why, in words."""


@dataclass(frozen=True)
class Trace:
    model: str                      # the backbone's name
    prompt: str
    strategy: str                   # the strategy's name: ar, static, knn, oracle, knapspec, auto
    config: DecodeConfig
    start: Start
    steps: tuple[Step, ...]
    tokens: dict[int, str]          # the text of every token id the run shows
    eos: tuple[int, ...]            # the model's end-of-text ids
    compute_s: float                # model time of the whole run (prefill, routing, steps)
    text: str                       # the answer, as the tokenizer decodes it
    meta: dict = field(default_factory=dict)   # JSON values: created, device, calibration, race, …

    @property
    def token_ids(self) -> tuple[int, ...]:
        return (self.start.first_token,) + tuple(t for s in self.steps for t in s.committed)

    @property
    def stats(self) -> Stats:
        return summarize(self.start, self.steps, self.compute_s)

    def token_str(self, i: int) -> str:
        return self.tokens[int(i)]

    # --- writing ---------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        s = self.start
        emb = s.embedding.detach().cpu()
        start = {"prompt_len": s.prompt_len, "first_token": s.first_token, "prefill_s": s.prefill_s,
                 "strategy": s.strategy, "truncated": s.truncated, "draft": s.draft,
                 "skip": _skip_out(s.skip), "domain": s.domain,
                 "route": _route_out(s.route), "forecast": _forecast_out(s.forecast),
                 "embedding": {"dtype": str(emb.dtype).replace("torch.", ""), "shape": list(emb.shape),
                               "values": emb.reshape(-1).tolist()}}
        return {"format": FORMAT, "version": VERSION, "model": self.model, "prompt": self.prompt,
                "strategy": self.strategy, "config": asdict(self.config), "start": start,
                "steps": [_step_out(st) for st in self.steps],
                "tokens": {str(i): self.tokens[i] for i in sorted(self.tokens)}, "eos": list(self.eos),
                "compute_s": self.compute_s, "text": self.text, "meta": self.meta}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False, indent=1, allow_nan=False)

    def save(self, path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json(), encoding="utf-8")
        return path

    # --- reading ----------------------------------------------------------------------------------
    @classmethod
    def from_json(cls, text: str | bytes) -> "Trace":
        if isinstance(text, bytes):
            if len(text) > MAX_BYTES:
                raise TraceError(f"the file is {len(text) / 2 ** 20:.1f} MB; a trace is at most "
                                 f"{MAX_BYTES // 2 ** 20} MB")
            try:
                text = text.decode("utf-8")
            except UnicodeDecodeError:
                raise TraceError("the file is not UTF-8 text, so it is not a trace (traces are JSON)") from None
        if len(text) > MAX_BYTES:
            raise TraceError(f"the text is over {MAX_BYTES // 2 ** 20} MB; a trace is smaller")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceError(f"the file is not valid JSON ({exc.msg} at line {exc.lineno}, column "
                             f"{exc.colno}), so it is not a trace") from None
        except RecursionError:
            raise TraceError("the file nests JSON too deeply to be a trace") from None
        return cls.from_dict(data)

    @classmethod
    def load(cls, path) -> "Trace":
        path = Path(path)
        size = path.stat().st_size
        if size > MAX_BYTES:
            raise TraceError(f"{path.name} is {size / 2 ** 20:.1f} MB; a trace is at most "
                             f"{MAX_BYTES // 2 ** 20} MB")
        return cls.from_json(path.read_bytes())

    @classmethod
    def from_dict(cls, data) -> "Trace":
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise TraceError(f'not a KNN-SSD Studio trace: a trace is a JSON object with "format": "{FORMAT}"'
                             + ("" if isinstance(data, dict) else f" (this file holds a {_kind(data)})"))
        version = data.get("version")
        if not _is_int(version):
            raise TraceError('the trace has no integer "version"')
        if version != VERSION:
            newer = version > VERSION
            raise TraceError(f"this trace is format version {version}; this app reads version {VERSION}"
                             + (" — it was written by a newer KNN-SSD Studio: update the app" if newer else ""))
        r = _Reader(data, "trace")
        r.str("format"), r.int("version")
        model, prompt, strategy = r.str("model"), r.str("prompt"), r.str("strategy")
        config = r.obj("config", _config)
        start = r.obj("start", _start)
        steps = tuple(_step(s, f"steps[{i}]") for i, s in enumerate(r.list("steps")))
        tokens = r.obj("tokens", _token_texts)
        eos, compute_s, text, meta = r.ints("eos"), r.float("compute_s"), r.str("text"), r.dict("meta")
        r.done()
        trace = cls(model, prompt, strategy, config, start, steps, tokens, eos, compute_s, text, meta)
        _check_consistent(trace)
        return trace


def record(backbone, prompt: str, strategy: str, config: DecodeConfig, start: Start, steps, compute_s: float,
           **meta) -> Trace:
    """A trace of a run from its events (the app's live run, the bench's generations)."""
    steps = tuple(steps)
    ids = {start.first_token}
    for s in steps:
        ids.update(s.drafted, s.verified, s.committed)
    run_ids = (start.first_token,) + tuple(t for s in steps for t in s.committed)
    return Trace(backbone.name, prompt, strategy, config, start, steps,
                 {i: backbone.token_str(i) for i in sorted(ids)}, tuple(sorted(backbone.eos_ids)),
                 float(compute_s), backbone.decode(run_ids), dict(meta))


# --- writing helpers -------------------------------------------------------------------------------
def _skip_out(s: SkipSet | None):
    return None if s is None else s.to_dict()


def _forecast_out(f: Forecast | None):
    return None if f is None else {"skip": f.skip.to_dict(), "acceptance": f.acceptance,
                                   "predicted_speedup": f.predicted_speedup, "context_len": f.context_len}


def _route_out(r: Route | None):
    if r is None:
        return None
    d = r.to_dict()
    d.pop("description", None)            # derived: Route.describe() writes it again
    return d


def _step_out(s: Step) -> dict:
    d = {f.name: getattr(s, f.name) for f in fields(Step)}
    d["skip"], d["forecast"] = _skip_out(s.skip), _forecast_out(s.forecast)
    for k in ("drafted", "draft_probs", "verified", "committed", "verify_probs"):
        d[k] = list(d[k])
    return d


# --- reading helpers: each says which field is wrong ------------------------------------------------
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _kind(v) -> str:
    return {dict: "object", list: "list", str: "string", bool: "true/false", type(None): "null"}.get(
        type(v), "number")


class _Reader:
    """Typed access to one JSON object; records the keys used so that unknown keys are an error."""

    def __init__(self, d, where: str):
        if not isinstance(d, dict):
            raise TraceError(f"{where}: expected an object, found a {_kind(d)}")
        self.d, self.where, self.used = d, where, set()

    def _get(self, key, optional=False):
        self.used.add(key)
        if key not in self.d:
            if optional:
                return None
            raise TraceError(f'{self.where}: the field "{key}" is missing')
        return self.d[key]

    def _bad(self, key, want, v):
        return TraceError(f'{self.where}.{key}: expected {want}, found {_kind(v)} {json.dumps(v)[:40]}')

    def int(self, key):
        v = self._get(key)
        if not _is_int(v):
            raise self._bad(key, "an integer", v)
        return v

    def opt_int(self, key, default: int):
        """An integer field that older traces lack (`default` then)."""
        return default if key not in self.d else self.int(key)

    def float(self, key):
        v = self._get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self._bad(key, "a number", v)
        return float(v)

    def str(self, key, optional=False):
        v = self._get(key, optional)
        if v is None and optional:
            return None
        if not isinstance(v, str):
            raise self._bad(key, "a string", v)
        return v

    def bool(self, key):
        v = self._get(key)
        if not isinstance(v, bool):
            raise self._bad(key, "true or false", v)
        return v

    def list(self, key):
        v = self._get(key)
        if not isinstance(v, list):
            raise self._bad(key, "a list", v)
        return v

    def dict(self, key):
        v = self._get(key)
        if not isinstance(v, dict):
            raise self._bad(key, "an object", v)
        return v

    def ints(self, key) -> tuple[int, ...]:
        v = self.list(key)
        if not all(_is_int(x) for x in v):
            raise self._bad(key, "a list of integers", v)
        return tuple(v)

    def floats(self, key) -> tuple[float, ...]:
        v = self.list(key)
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v):
            raise self._bad(key, "a list of numbers", v)
        return tuple(float(x) for x in v)

    def obj(self, key, parse, optional=False):
        v = self._get(key)
        if v is None and optional:
            return None
        return parse(v, f"{self.where}.{key}")

    def done(self):
        unknown = sorted(set(self.d) - self.used)
        if unknown:
            raise TraceError(f"{self.where}: unknown field(s) {', '.join(map(repr, unknown))}")


def _config(d, where) -> DecodeConfig:
    if not isinstance(d, dict):
        raise TraceError(f"{where}: expected an object, found a {_kind(d)}")
    unknown = sorted(set(d) - {f.name for f in fields(DecodeConfig)})
    if unknown:
        raise TraceError(f"{where}: unknown setting(s) {', '.join(map(repr, unknown))}")
    try:
        return DecodeConfig(**d)
    except (TypeError, ValueError) as exc:
        raise TraceError(f"{where}: {exc}") from None


def _skip(d, where) -> SkipSet:
    r = _Reader(d, where)
    skip = SkipSet(frozenset(r.ints("attn")), frozenset(r.ints("mlp")), r.str("name"))
    r.done()
    return skip


def _forecast(d, where) -> Forecast:
    r = _Reader(d, where)
    f = Forecast(r.obj("skip", _skip), r.float("acceptance"), r.float("predicted_speedup"), r.int("context_len"))
    r.done()
    return f


def _neighbour(d, where) -> Neighbour:
    r = _Reader(d, where)
    n = Neighbour(r.str("text"), r.str("domain"), r.float("similarity"), r.str("kind"), r.int("index"))
    r.done()
    return n


def _route(d, where) -> Route:
    r = _Reader(d, where)
    votes = r.dict("votes")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in votes.values()):
        raise TraceError(f"{where}.votes: expected numbers")
    route = Route(r.str("domain", optional=True), {k: float(v) for k, v in votes.items()},
                  tuple(_neighbour(n, f"{where}.neighbours[{i}]") for i, n in enumerate(r.list("neighbours"))),
                  r.float("similarity"), r.obj("skip", _skip), r.bool("unknown"), r.str("vote"),
                  r.float("threshold"))
    r.done()
    return route


def _embedding(d, where) -> torch.Tensor:
    r = _Reader(d, where)
    dtype, shape, values = r.str("dtype"), r.ints("shape"), r.floats("values")
    r.done()
    if dtype not in DTYPES:
        raise TraceError(f"{where}.dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    if math.prod(shape) != len(values):
        raise TraceError(f"{where}: shape {list(shape)} does not hold {len(values)} values")
    return torch.tensor(values, dtype=DTYPES[dtype]).reshape(shape)


def _start(d, where) -> Start:
    r = _Reader(d, where)
    start = Start(prompt_len=r.int("prompt_len"), first_token=r.int("first_token"),
                  embedding=r.obj("embedding", _embedding), prefill_s=r.float("prefill_s"),
                  strategy=r.str("strategy"), truncated=r.bool("truncated"), draft=r.str("draft"),
                  skip=r.obj("skip", _skip, optional=True), domain=r.str("domain", optional=True),
                  route=r.obj("route", _route, optional=True), forecast=r.obj("forecast", _forecast, optional=True))
    r.done()
    return start


def _step(d, where) -> Step:
    r = _Reader(d, where)
    step = Step(index=r.int("index"), context_len=r.int("context_len"), drafted=r.ints("drafted"),
                draft_probs=r.floats("draft_probs"), verified=r.ints("verified"), accepted=r.int("accepted"),
                committed=r.ints("committed"), skip=r.obj("skip", _skip, optional=True),
                draft_s=r.float("draft_s"), verify_s=r.float("verify_s"), overhead_s=r.float("overhead_s"),
                note=r.str("note"), finished=r.bool("finished"), source=r.str("source"),
                forecast=r.obj("forecast", _forecast, optional=True), verify_probs=r.floats("verify_probs"),
                rows=r.opt_int("rows", 1), rule=r.str("rule", optional=True) or "")
    r.done()
    return step


def _token_texts(d, where) -> dict[int, str]:
    if not isinstance(d, dict):
        raise TraceError(f"{where}: expected an object of token id → text, found a {_kind(d)}")
    out = {}
    for k, v in d.items():
        if not k.isdigit() or not isinstance(v, str):
            raise TraceError(f"{where}: entry {k!r} must map a token id to its text")
        out[int(k)] = v
    return out


def _check_consistent(t: Trace) -> None:
    """What the types cannot say: the steps in order, counts that match, a text for every token."""
    for i, s in enumerate(t.steps):
        where = f"steps[{i}]"
        if s.index != i:
            raise TraceError(f"{where}: index is {s.index}, expected {i} (steps out of order or missing)")
        if not 0 <= s.accepted <= len(s.drafted):
            raise TraceError(f"{where}: {s.accepted} accepted of {len(s.drafted)} drafted")
        if len(s.draft_probs) != len(s.drafted):
            raise TraceError(f"{where}: {len(s.draft_probs)} draft probabilities for {len(s.drafted)} drafts")
        if not s.committed or tuple(s.committed[:s.accepted]) != s.drafted[:min(s.accepted, len(s.committed))]:
            raise TraceError(f"{where}: the committed tokens do not start with the accepted drafts")
        missing = sorted({*s.drafted, *s.verified, *s.committed} - set(t.tokens))
        if missing:
            raise TraceError(f"{where}: token(s) {missing[:5]} have no text in \"tokens\"")
    if t.start.first_token not in t.tokens:
        raise TraceError("start.first_token has no text in \"tokens\"")
