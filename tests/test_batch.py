"""The batched serving engine (issue #40): lossless beside other visitors, and how it behaves.

Every request's greedy tokens through the engine must equal what the same request gets alone — exactly
on the tiny model in float64 (where a 1-row and a packed pass cannot disagree on a token), up to
floating-point near-ties on the default model in fp32 (marked `real`). Then the behaviour a visitor
sees: Stop, leaving mid-answer, waiting for KV memory, a race's lockstep laps, seeded sampling, and
the goodput rule that shortens drafts under load.
"""
import random
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from ssd_core.engine.backbone import Backbone
from ssd_core.engine.decode import DecodeConfig, Start, Step, Waiting, decode
from ssd_core.engine.goodput import BatchCosts, GoodputRule, ROWS, TOKENS
from ssd_core.engine.packed import RowPass, forward_rows
from ssd_core.engine.race import lockstep
from ssd_core.engine.rows import Row
from ssd_core.engine.serve import Engine, wait_idle
from ssd_core.engine.skipset import SkipSet
from ssd_core.policies.ar import Autoregressive
from ssd_core.policies.static import Static
from tiny import tiny_backbone

LAYERS = 4
ALPHABET = "abcdefghij klmnop.,?!0123"
TIMEOUT = 60.0          # no test here should take near this: reaching it means the engine hung


@pytest.fixture(scope="module")
def bb64():
    """The tiny model in float64: a packed pass and a 1-row pass agree to ~1e-15, so tokens agree exactly."""
    tiny = tiny_backbone(layers=LAYERS, seed=1)
    return Backbone(tiny.hf_model.double(), tiny.tokenizer, name="tiny-llama-f64")


@pytest.fixture
def serve(bb64):
    """Start engines on the float64 model; every one is closed (thread joined, backbone detached) after."""
    made = []

    def start(**kw) -> Engine:
        engine = Engine(bb64, **kw).attach()
        made.append(engine)
        return engine
    yield start
    for engine in made:
        engine.close()
    assert getattr(bb64, "engine", None) is None


def tokens(events) -> tuple[int, ...]:
    """The answer's token ids: the Start's first token, then every Step's committed tokens."""
    out = []
    for ev in events:
        if isinstance(ev, Start):
            out.append(ev.first_token)
        elif isinstance(ev, Step):
            out.extend(ev.committed)
    return tuple(out)


def in_threads(jobs, timeout: float = TIMEOUT) -> list:
    """Run `(delay_s, fn)` jobs on their own threads (each starts after its delay); their results.
    A thread still running after `timeout` fails the test (a deadlock), an exception in one re-raises."""
    results, errors = [None] * len(jobs), []

    def work(i, delay, fn):
        time.sleep(delay)
        try:
            results[i] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
            errors.append(exc)
    threads = [threading.Thread(target=work, args=(i, d, fn), daemon=True) for i, (d, fn) in enumerate(jobs)]
    for t in threads:
        t.start()
    end = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    assert not any(t.is_alive() for t in threads), f"requests still running after {timeout:.0f} s: the engine hung"
    if errors:
        raise errors[0]
    return results


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a − b| where both are finite; inf if they disagree on where they are not (a small draft
    head's logits are −inf outside the head)."""
    finite = torch.isfinite(a)
    if not torch.equal(finite, torch.isfinite(b)) or not torch.equal(a[~finite], b[~finite]):
        return float("inf")
    return float((a[finite] - b[finite]).abs().max()) if finite.any() else 0.0


def random_skip(rng: random.Random) -> SkipSet:
    return SkipSet(frozenset(rng.sample(range(LAYERS), rng.randint(0, 2))),
                   frozenset(rng.sample(range(LAYERS), rng.randint(0, 2))))


def mixture(seed: int, n: int = 12) -> list[dict]:
    """A seeded mix of requests: prompt lengths 3..80 characters, skip sets, γ 1..5, lookup on/off,
    plain decoding for some, answers of 1..40 tokens, stopping at EOS or not."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(3, 80)))
        skip = None if rng.random() < 0.25 else random_skip(rng)
        cfg = DecodeConfig(max_new_tokens=rng.randint(1, 40), gamma=rng.randint(1, 5), lookup=rng.random() < 0.5,
                           stop_at_eos=rng.random() < 0.5, draft="fp32")   # int8 drafts are fp32-only
        out.append({"prompt": prompt, "skip": skip, "cfg": cfg})
    return out


def strategy_of(req: dict):
    return Autoregressive() if req["skip"] is None else Static(req["skip"])


def alone(bb, req: dict, **kw) -> tuple[int, ...]:
    """The request decoded by itself (no engine attached to `bb`)."""
    assert getattr(bb, "engine", None) is None
    return tokens(decode(bb, req["prompt"], strategy_of(req), req["cfg"], **kw))


def ask(bb, req: dict, **kw):
    """A job for `in_threads`: the request's events (through the engine attached to `bb`, if any)."""
    return lambda: list(decode(bb, req["prompt"], strategy_of(req), req["cfg"], **kw))


def steep_costs() -> BatchCosts:
    """Pass costs where verifying many tokens is dear: the rule's choice swings with the rows' acceptance."""
    full = {r: {t: 0.01 * r * (1 + 0.25 * (t - 1) ** 2) for t in TOKENS} for r in ROWS}
    return BatchCosts(full=full, draft={r: 0.001 * r for r in ROWS})


class Recording(GoodputRule):
    """The goodput rule, remembering each shared step's (cap, the rows' own γ)."""

    def __init__(self, bb, costs):
        super().__init__(bb, costs)
        self.choices = []

    def choose(self, rows, gammas, lookups):
        cap, words = super().choose(rows, gammas, lookups)
        self.choices.append((cap, tuple(gammas)))
        return cap, words


def paced(delay_s: float):
    """A should_stop that never stops but slows its row's steps (runs on the engine thread): its reader
    then keeps up, so the row keeps wanting steps and holds its place."""
    def should_stop():
        time.sleep(delay_s)
        return False
    return should_stop


# --- 1. the packed forward ---------------------------------------------------------------------------
@pytest.mark.parametrize("small_head", [False, True])
def test_packed_forward_equals_each_row_alone(bb64, small_head):
    """Rows of 1..6 tokens (or many one-token rows) over random cached prefixes, random skip sets and
    logits modes, packed in one pass: every row's output and KV cache equal that row's own forward
    (to 1e-9 in float64)."""
    rng = random.Random(11)
    bb64.drafts.set_head(range(0, bb64.vocab, 3) if small_head else None)
    try:
        draft = bb64.drafts.get("fp32", small_head, SkipSet())        # None: the verifier's own weights
        assert (draft is not None) == small_head
        for trial in range(12):
            # mixed lengths; only one-token rows (decode steps: from 4 they attend in one padded call);
            # many one-token rows beside a few longer ones
            sizes = ([rng.randint(1, 6) for _ in range(rng.randint(2, 6))], [1] * rng.randint(4, 8),
                     [1] * rng.randint(4, 6) + [rng.randint(2, 6) for _ in range(rng.randint(1, 2))])[trial % 3]
            rng.shuffle(sizes)
            passes, expected, caches = [], [], []
            for n in sizes:
                prefix = [rng.randrange(5, bb64.vocab) for _ in range(rng.randint(0, 20))]
                ids = [rng.randrange(5, bb64.vocab) for _ in range(n)]
                skip, mode = random_skip(rng), rng.choice(["last", "all", "none"])
                room = rng.randint(27, 40)              # caches of different sizes
                packed, own = bb64.new_cache(room), bb64.new_cache(room)
                if prefix:
                    bb64.forward(prefix, packed), bb64.forward(prefix, own)
                passes.append(RowPass(ids, packed, skip, mode))
                expected.append(bb64.forward(ids, own, skip, logits=mode, draft=draft))
                caches.append(own)
            outs = forward_rows(bb64, passes, draft=draft)
            assert len(outs) == len(passes)
            for p, out, want, own in zip(passes, outs, expected, caches):
                assert out.shape == want.shape, p.logits
                assert max_diff(out, want) < 1e-9, (p.logits, p.skip, len(p.ids))
                assert p.cache.length == own.length
                assert float((p.cache.k - own.k).abs().max()) < 1e-9
                assert float((p.cache.v - own.v).abs().max()) < 1e-9
    finally:
        bb64.drafts.set_head(None)


# --- 2. lossless beside others -----------------------------------------------------------------------
def test_engine_is_lossless_for_a_random_mixture(bb64, serve):
    """12 requests from threads with staggered starts (rows join and leave), 4 rows, 8-token prefill
    chunks, a goodput rule whose choices swing: each answer equals the same request decoded alone."""
    reqs = mixture(seed=40)
    want = [alone(bb64, r) for r in reqs]
    rule = Recording(bb64, steep_costs())
    engine = serve(max_rows=4, chunk=8, rule=rule)
    rng = random.Random(1)
    got = in_threads([(rng.uniform(0, 0.3), ask(bb64, r)) for r in reqs])
    for i, (r, events, w) in enumerate(zip(reqs, got, want)):
        assert tokens(events) == w, f"request {i} ({r['cfg']}, skip {r['skip']}) differs from alone"
        assert isinstance(events[0], Start) and sum(isinstance(e, Start) for e in events) == 1
    steps = [e for events in got for e in events if isinstance(e, Step)]
    assert max(s.rows for s in steps) > 1, "no step was shared: the engine never batched"
    assert any(s.rule for s in steps)
    assert any(cap < max(gs) for cap, gs in rule.choices), "the goodput rule never shortened a draft"
    assert any(cap > 0 for cap, _ in rule.choices), "the goodput rule never let rows draft"
    assert any(s.drafted and s.rows > 1 for s in steps), "no batched draft was verified"
    assert wait_idle(engine, 5)
    assert engine.status()["kv_bytes"] == 0


def test_plain_batched_decoding_is_lossless(bb64, serve, monkeypatch):
    """8 visitors at once, the rule turning drafts off (plain batched decoding: one token a row, the
    shape where one-token rows attend in one padded call): each answer equals the request alone."""
    import ssd_core.engine.rows as rows_module
    shapes = []

    def spy(bb, passes, draft=None):
        shapes.append(sorted(len(p.ids) for p in passes))
        return forward_rows(bb, passes, draft)
    monkeypatch.setattr(rows_module, "forward_rows", spy)
    rng = random.Random(8)
    reqs = [{"prompt": "".join(rng.choice(ALPHABET) for _ in range(rng.randint(3, 30))),
             "skip": None if i % 2 else random_skip(rng),
             "cfg": DecodeConfig(max_new_tokens=rng.randint(20, 40), gamma=3, stop_at_eos=False, draft="fp32")}
            for i in range(8)]
    want = [alone(bb64, r) for r in reqs]
    rule = Recording(bb64, steep_costs())
    serve(max_rows=8, chunk=None, rule=rule)
    shapes.clear()
    got = in_threads([(0.0, ask(bb64, r)) for r in reqs])
    assert [tokens(e) for e in got] == want
    assert any(sum(n == 1 for n in shape) >= 6 for shape in shapes), "never 6 one-token rows in one pass"
    assert any(cap == 0 for cap, _ in rule.choices)


# --- 3. Stop -----------------------------------------------------------------------------------------
def test_stop_ends_one_request_while_others_continue(bb64, serve):
    """A request whose should_stop turns true after 3 steps gets its Start and 3 Steps, nothing more;
    the others run on and stay exact."""
    reqs = mixture(seed=3, n=4)
    stopped = {"prompt": "stop me after three steps", "skip": SkipSet({1}, {2}),
               "cfg": DecodeConfig(max_new_tokens=40, gamma=3, draft="fp32", stop_at_eos=False)}

    def read(**kw):
        """Start + 3 Steps, then Stop: should_stop looks at what this reader has seen (it is also asked
        while the prompt is read); lookahead 0 keeps the engine from stepping ahead of the reader."""
        seen = []
        for ev in decode(bb64, stopped["prompt"], strategy_of(stopped), stopped["cfg"],
                         should_stop=lambda: len(seen) > 3, lookahead=0, **kw):
            seen.append(ev)
        return seen
    want_stopped = tokens(read())
    want = [alone(bb64, r) for r in reqs]
    serve(max_rows=3, chunk=8)
    jobs = [(0.0, read)]
    jobs += [(0.01 * i, ask(bb64, r)) for i, r in enumerate(reqs)]
    got = in_threads(jobs)
    events = got[0]
    assert [type(e) for e in events] == [Start, Step, Step, Step]
    assert tokens(events) == want_stopped
    assert len(want_stopped) < 40
    assert [tokens(e) for e in got[1:]] == want


# --- 4. a visitor who leaves ---------------------------------------------------------------------------
def test_closing_the_generator_frees_the_row(bb64, serve):
    """One row only: a visitor reading a long answer leaves mid-answer (closes its generator); its row
    and KV memory are freed and the visitor waiting behind it is admitted and answered exactly."""
    leaver = {"prompt": "a long answer", "skip": None,
              "cfg": DecodeConfig(max_new_tokens=800, stop_at_eos=False, draft="fp32")}
    waiter = {"prompt": "me next, please", "skip": SkipSet({0}, {3}),
              "cfg": DecodeConfig(max_new_tokens=30, gamma=3, draft="fp32")}
    want = alone(bb64, waiter)
    engine = serve(max_rows=1, chunk=8)
    leave, started, left = threading.Event(), threading.Event(), {}
    read = []

    def read_then_leave():
        gen = decode(bb64, leaver["prompt"], strategy_of(leaver), leaver["cfg"], should_stop=paced(0.003))
        for ev in gen:
            read.append(ev)
            started.set()
            if leave.is_set():
                left["kv_before"] = engine.status()["kv_bytes"]
                gen.close()
                left["t"] = time.monotonic()
                return
    seen = {}

    def wait_behind():
        assert started.wait(TIMEOUT)
        events = []
        for ev in decode(bb64, waiter["prompt"], strategy_of(waiter), waiter["cfg"], report_wait=True):
            if isinstance(ev, Waiting):
                leave.set()                     # it is waiting: now the first visitor leaves
            elif isinstance(ev, Start):
                seen["t_start"], seen["status"] = time.monotonic(), engine.status()
            events.append(ev)
        return events
    _, events = in_threads([(0.0, read_then_leave), (0.0, wait_behind)])
    assert isinstance(events[0], Waiting) and events[0].position == 1
    assert "rows busy" in events[0].reason
    assert tokens(events) == want
    assert 1 < len(read) and len(tokens(read)) < 800, "it left mid-answer"
    assert left["kv_before"] > 0
    assert left["t"] < seen["t_start"]
    assert seen["status"]["rows"] == 1, "the row of the visitor who left was still held"
    assert wait_idle(engine, 5)
    assert engine.status()["rows"] == 0 and engine.status()["kv_bytes"] == 0


# --- 5. the KV budget ----------------------------------------------------------------------------------
def test_kv_budget_makes_a_request_wait_and_it_still_completes(bb64, serve):
    """A budget that holds one row: the second request reports Waiting (position ≥ 1, the KV memory as
    reason) before its Start, then runs once the first is done; both exact, no deadlock. A request that
    fits at once reports no Waiting."""
    first = {"prompt": "first in line", "skip": SkipSet({2}, {1}),
             "cfg": DecodeConfig(max_new_tokens=120, gamma=2, stop_at_eos=False, draft="fp32")}
    second = {"prompt": "second in line", "skip": None,
              "cfg": DecodeConfig(max_new_tokens=100, stop_at_eos=False, draft="fp32")}
    want = [alone(bb64, first), alone(bb64, second)]
    kv = [Row(bb64, bb64.encode(r["prompt"]), None, r["cfg"]).kv_bytes() for r in (first, second)]
    engine = serve(max_rows=8, chunk=8, kv_budget_mb=(sum(kv) - 1) / 1e6)
    assert max(kv) <= engine.kv_budget < sum(kv)
    started = threading.Event()

    def run_first():
        events = []
        for ev in decode(bb64, first["prompt"], strategy_of(first), first["cfg"], should_stop=paced(0.003),
                         report_wait=True):
            events.append(ev)
            started.set()
        return events

    def run_second():
        assert started.wait(TIMEOUT)
        return list(decode(bb64, second["prompt"], strategy_of(second), second["cfg"], report_wait=True))
    a, b = in_threads([(0.0, run_first), (0.0, run_second)])
    waits = [e for e in b if isinstance(e, Waiting)]
    assert waits and all(w.position >= 1 for w in waits)
    assert "KV memory" in waits[0].reason
    start = next(i for i, e in enumerate(b) if isinstance(e, Start))
    assert all(isinstance(e, Waiting) for e in b[:start]) and not any(isinstance(e, Waiting) for e in b[start:])
    assert not any(isinstance(e, Waiting) for e in a), "a request that fitted at once reported Waiting"
    assert [tokens(a), tokens(b)] == want
    assert max(s.rows for s in b if isinstance(s, Step)) == 1, "the budget let both rows in at once"
    # a request larger than the whole budget still runs when nothing else does (no deadlock)
    big = {"prompt": "too big for the budget", "skip": None,
           "cfg": DecodeConfig(max_new_tokens=400, stop_at_eos=False, draft="fp32")}
    assert Row(bb64, bb64.encode(big["prompt"]), None, big["cfg"]).kv_bytes() > engine.kv_budget
    engine_out, = in_threads([(0.0, ask(bb64, big, report_wait=True))])
    assert len(tokens(engine_out)) == 400 and isinstance(engine_out[0], Start)


# --- 6. a race's lockstep laps ---------------------------------------------------------------------------
def test_lockstep_through_the_engine_alternates_and_is_exact(bb64, serve):
    """lockstep through an attached engine (beside another visitor) yields the same laps, event for
    event, as without one: the laps alternate and each equals its strategy decoded alone."""
    cfg = DecodeConfig(max_new_tokens=30, gamma=3, draft="fp32", stop_at_eos=False)
    prompt, skip = "race me, fairly", SkipSet({1, 3}, {0})

    def race():
        return [(side, tokens([ev])) for side, ev, _ in lockstep(bb64, prompt, Autoregressive(), Static(skip), cfg)]
    want = race()
    want_a = alone(bb64, {"prompt": prompt, "skip": None, "cfg": cfg})
    want_b = alone(bb64, {"prompt": prompt, "skip": skip, "cfg": cfg})
    other = mixture(seed=6, n=1)[0]
    want_other = alone(bb64, other)
    engine = serve(max_rows=4, chunk=8)
    got, other_events = in_threads([(0.0, race), (0.0, ask(bb64, other))])
    assert engine.steps > 0
    assert got == want
    sides = "".join(s for s, _ in got)
    assert sides[:2] == "ab"
    assert sides.index("b", 2) < sides.rindex("a") and sides.index("a", 2) < sides.rindex("b"), \
        f"the laps did not alternate: {sides}"
    for side, w in (("a", want_a), ("b", want_b)):
        assert tuple(t for s, ids in got if s == side for t in ids) == w
    assert tokens(other_events) == want_other


# --- 7. sampling -------------------------------------------------------------------------------------------
def test_seeded_sampling_through_the_engine_equals_alone(bb64, serve):
    """Each row has its own random stream: a seeded sampled answer beside others is the one it gets alone
    (no goodput rule here: a shortened draft would change which random numbers a row draws)."""
    rng = random.Random(7)
    reqs = []
    for i in range(6):
        r = mixture(seed=70 + i, n=1)[0]
        if i % 3:                               # two of three sample, the rest are greedy
            r["cfg"] = DecodeConfig(max_new_tokens=r["cfg"].max_new_tokens + 10, gamma=r["cfg"].gamma,
                                    lookup=r["cfg"].lookup, draft="fp32", temperature=rng.choice([0.7, 1.0, 1.3]),
                                    top_p=rng.choice([1.0, 0.9]), seed=100 + i)
        reqs.append(r)
    want = [alone(bb64, r) for r in reqs]
    serve(max_rows=3, chunk=8)
    got = in_threads([(0.02 * i, ask(bb64, r)) for i, r in enumerate(reqs)])
    assert [tokens(e) for e in got] == want
    assert max(s.rows for e in got for s in e if isinstance(s, Step)) > 1


# --- 8. the goodput rule -------------------------------------------------------------------------------------
def test_goodput_rule_drafts_alone_and_stops_drafting_under_load(bb64):
    rule = GoodputRule(bb64, BatchCosts.builtin())
    one = rule.predict([0.95], [4], [False], [0.5])
    assert max(one, key=one.get) == 4, one               # alone, a good draft drafts its full length
    row = SimpleNamespace(alpha=0.95, draft_skip=None)
    cap, words = rule.choose([row], [4], [True])         # a lookup draft costs no draft pass
    assert cap == 4 and "draft length 4" in words
    rows = [SimpleNamespace(alpha=0.5, draft_skip=SkipSet({1}, {2})) for _ in range(16)]
    cap, words = rule.choose(rows, [4] * 16, [False] * 16)
    assert cap == 0 and "plain batched decoding" in words
    assert rule.last.rows == 16 and rule.last.gamma == 0


def test_goodput_curve_falls_as_rows_grow(bb64):
    curve = GoodputRule(bb64, BatchCosts.builtin()).curve(alpha=0.8, gamma=4, ratio=0.6)
    speedups = [c["speedup"] for c in curve]
    assert [c["rows"] for c in curve] == list(range(1, 17))
    assert speedups[0] > 1.2 and speedups[-1] == pytest.approx(1.0)
    assert all(b <= a + 1e-9 for a, b in zip(speedups, speedups[1:])), speedups
    assert curve[0]["gamma"] > curve[-1]["gamma"] == 0


# --- 9. the default model, fp32 --------------------------------------------------------------------------------
REAL_NEW_TOKENS = 48


def first_difference(a, b) -> int | None:
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if at is None and len(a) != len(b):
        at = min(len(a), len(b))
    return at


@pytest.mark.real
def test_default_model_batched_equals_alone_and_generate(real_model):
    """5 domain prompts decoded at once through an engine (KNN routing, the goodput rule): each equals
    the same request alone and transformers' greedy `generate`, or parts from it only at a near-tie
    (top-2 logit gap < 1e-3, reported)."""
    from hf_reference import hf_greedy, processors_are_plain
    from ssd_core import calibration as cal_io
    from ssd_core.calibration.domains import load_prompts, split
    from ssd_core.engine.ties import logit_gap
    from ssd_core.policies.registry import build as build_strategy

    bb = real_model
    assert processors_are_plain(bb)
    cal = cal_io.load(cal_io.default_folder(None), bb)
    gamma = int(cal.meta.get("settings", {}).get("gamma", 4))
    cfg = DecodeConfig(max_new_tokens=REAL_NEW_TOKENS, gamma=gamma)
    prompts = [bb.encode(split(ps)[1][-1]) for ps in list(load_prompts().values())[:5]]

    def knn(ids):
        return list(decode(bb, ids, build_strategy(cal, "knn", gamma=gamma), cfg))
    want = [tokens(knn(ids)) for ids in prompts]
    engine = Engine(bb, max_rows=8, rule=GoodputRule(bb, BatchCosts.builtin())).attach()
    try:
        got = in_threads([(0.05 * i, lambda ids=ids: knn(ids)) for i, ids in enumerate(prompts)], timeout=300)
    finally:
        engine.close()
    steps = [s for e in got for s in e if isinstance(s, Step)]
    assert max(s.rows for s in steps) > 1, "the engine never batched"
    assert any(s.drafted and s.rows > 1 for s in steps), "no drafts were verified in a shared pass"
    print(f"{len(steps)} steps, {sum(s.rows > 1 for s in steps)} shared, "
          f"{sum(bool(s.drafted) and s.rows > 1 for s in steps)} shared with drafts")
    problems, notes = [], []
    for i, (ids, events, alone_ids) in enumerate(zip(prompts, got, want)):
        ours = tokens(events)
        for name, ref in (("alone", alone_ids), ("generate", hf_greedy(bb, ids, REAL_NEW_TOKENS))):
            at = first_difference(ours, ref)
            if at is None:
                continue
            gap = logit_gap(bb, ids.ids, ours[:at])
            line = (f"prompt {i} vs {name}: first difference at token {at} (ours {ours[at:at + 3]}, "
                    f"{name} {ref[at:at + 3]}), top-2 logit gap {gap.gap:.2e}")
            (notes if gap.near_tie else problems).append(line)
    if notes:
        print("near-ties:\n" + "\n".join(notes))
    assert not problems, "batched decoding changed the text:\n" + "\n".join(problems + notes)
