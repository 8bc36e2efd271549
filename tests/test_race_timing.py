"""Fair races (lockstep laps), the run's own costs, the run-aware prediction, and the latency model of
the machine that runs (cached, committed, measured in quiet slices) — on the tiny model."""
import json
import threading
import time

import pytest

from ssd_core.calibration import profiles
from ssd_core.calibration.latency import LatencyModel, profile
from ssd_core.engine.backbone import EMPTY
from ssd_core.engine.decode import DecodeConfig, Start, Step, decode
from ssd_core.engine.race import Lap, lockstep, measured_costs, segment_ratios
from ssd_core.engine.skipset import SkipSet
from ssd_core.policies.ar import Autoregressive
from ssd_core.policies.static import Static

SET = SkipSet({1, 3}, {2})


def _ids(bb, prompt, strategy, cfg):
    out = []
    for ev in decode(bb, prompt, strategy, cfg):
        out.extend([ev.first_token] if isinstance(ev, Start) else ev.committed)
    return tuple(out)


@pytest.mark.parametrize("prompt", ["the quick brown fox", "abc abc abc abc abc"])
def test_lockstep_laps_decode_exactly_what_each_decodes_alone_and_stay_level(tiny, prompt):
    cfg = DecodeConfig(max_new_tokens=40, gamma=4, stop_at_eos=False)
    laps, lead = {}, []
    for side, ev, lap in lockstep(tiny, prompt, Static(SET), Autoregressive(), cfg):
        laps[side] = lap
        if "a" in laps and "b" in laps and not (laps["a"].done or laps["b"].done):
            lead.append(laps["a"].committed - laps["b"].committed)
    assert laps["a"].token_ids == _ids(tiny, prompt, Static(SET), cfg)
    assert laps["b"].token_ids == _ids(tiny, prompt, Autoregressive(), cfg) == laps["a"].token_ids
    # whichever is behind steps next: neither lap gets ahead by more than one step's commit (γ + 1)
    assert max(abs(x) for x in lead) <= cfg.gamma + 1
    # both laps take part all along: the speculative lap does not finish before the plain one starts
    sides = [side for side, ev, _ in lockstep(tiny, prompt, Static(SET), Autoregressive(), cfg)
             if not isinstance(ev, Start)]
    first_b = sides.index("b")
    assert first_b <= 2 and "a" in sides[len(sides) // 2:]


def _step(i, drafted=(), accepted=0, committed=(5,), draft_s=0.0, verify_s=0.01, source="", skip=SET, ctx=10):
    return Step(index=i, context_len=ctx, drafted=tuple(drafted), draft_probs=(1.0,) * len(drafted),
                verified=tuple(committed), accepted=accepted, committed=tuple(committed), skip=skip,
                draft_s=draft_s, verify_s=verify_s, overhead_s=0.0, source=source)


def test_a_laps_speed_leaves_out_its_first_step_and_the_prefill():
    lap = Lap(start=None, steps=[_step(i, committed=(1, 2)) for i in range(4)], step_s=[9.0, 1.0, 1.0, 2.0])
    assert lap.timed() == (6, 4.0)
    assert lap.tokens_per_s == pytest.approx(1.5)
    other = Lap(steps=[_step(i, committed=(1,)) for i in range(4)], step_s=[1.0] * 4)
    assert lap.tokens_per_s / other.tokens_per_s == pytest.approx(1.5)
    assert len(segment_ratios(lap, other)) == 3


def test_the_runs_own_costs_leave_lookup_drafts_out():
    """c is a model draft pass over a plain step; lookup drafts cost nothing and would pull it down."""
    plain = [_step(i, skip=None, verify_s=0.030) for i in range(9)]
    spec = ([_step(i, drafted=(1, 2, 3, 4), accepted=2, committed=(1, 2, 9), draft_s=0.048, verify_s=0.036,
                   source="model") for i in range(6)]
            + [_step(i, drafted=(1, 2, 3, 4), accepted=4, committed=(1, 2, 3, 4, 5), draft_s=0.0001,
                     verify_s=0.036, source="lookup") for i in range(6)])
    m = measured_costs(spec, plain)
    assert m["c"] == pytest.approx(0.4)
    assert m["v"] == pytest.approx(1.2) and m["v_tokens"] == 5
    assert measured_costs(spec, []) == {}


def _lat(**kw):
    base = dict(n_layers=4, attn_a=0.001, attn_b=0.0, mlp=0.002, head=0.004, overhead=0.0,
                verify={1: 1.0, 2: 1.1, 3: 1.2, 5: 1.5},
                drafts={"int8": dict(attn_a=0.0005, attn_b=0.0, mlp=0.001, head=0.002, overhead=0.0)})
    base.update(kw)
    return LatencyModel(**base)


def test_the_run_aware_prediction_counts_model_drafts_lookup_drafts_and_verified_lengths():
    lat = _lat()
    full = lat.pass_time(1, 10)                        # 0.004 + 4·0.001 + 4·0.002 = 0.016
    assert full == pytest.approx(0.016)
    skip = SkipSet({0}, {0})
    draft = lat.pass_time(1, 10, "int8", skip)        # 0.002 + 3·0.0005 + 3·0.001 = 0.0065
    model = _step(0, drafted=(1, 2), accepted=2, committed=(1, 2, 3), source="model", skip=skip)
    lookup = _step(1, drafted=(1, 2, 3, 4), accepted=4, committed=(1, 2, 3, 4, 5), source="lookup", skip=skip)
    plain = _step(2, skip=None)
    spec, ar = lat.run_time([model, lookup, plain], "int8")
    assert spec == pytest.approx(2 * draft + 1.2 * full + 1.5 * full + full)
    assert ar == pytest.approx(9 * full)
    assert lat.predicted_run_speedup([model, lookup, plain], "int8") == pytest.approx(ar / spec)
    with pytest.raises(ValueError):
        lat.pass_time(1, 10, rows=4)


def test_the_latency_model_is_cached_per_machine_and_a_committed_one_seeds_a_fresh_machine(tiny, tmp_path,
                                                                                         monkeypatch):
    monkeypatch.setenv("KNN_SSD_CACHE", str(tmp_path / "cache"))
    lat = profile(tiny, contexts=(16, 32), verify_ks=(1, 2), repeats=1, progress=False)
    other_cpu = LatencyModel.from_dict({**lat.to_dict(), "machine": {**lat.machine, "cpu": {"model": "other"}}})

    class Cal:
        latency = other_cpu
    assert profiles.known(tiny, Cal)[0] is None                     # stale, nothing cached, nothing committed
    committed = tmp_path / "cal" / profiles.PROFILE_DIR
    committed.mkdir(parents=True)
    (committed / "this-cpu.json").write_text(json.dumps(lat.to_dict()))
    got, source = profiles.known(tiny, Cal, tmp_path / "cal")
    assert source == "committed" and got.attn_a == lat.attn_a
    measured = profiles.measure(tiny)                                 # measured once: cached for the next start
    got, source = profiles.known(tiny, Cal, None)
    assert source == "cache" and got.attn_a == measured.attn_a
    Cal.latency = lat                                                  # the calibration's own fits: used as it is
    assert profiles.known(tiny, Cal)[1] == "calibration"


def test_background_timings_never_overlap_a_visitors_job():
    quiet = profiles.Quiet(idle_s=0.05)
    log = []

    def visitor():
        for _ in range(5):
            with quiet.job():
                log.append(("job", "in"))
                time.sleep(0.02)
                log.append(("job", "out"))
            time.sleep(0.01)

    def measurer():
        for _ in range(5):
            with quiet.slice():
                log.append(("slice", "in"))
                time.sleep(0.02)
                log.append(("slice", "out"))

    threads = [threading.Thread(target=visitor), threading.Thread(target=measurer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    inside = {"job": 0, "slice": 0}
    for who, what in log:
        inside[who] += 1 if what == "in" else -1
        assert not (inside["job"] and inside["slice"]), log
    assert log.count(("slice", "in")) == 5


def test_profile_takes_every_timing_inside_a_turn(tiny):
    turns, inside = [], []

    class Turn:
        def __enter__(self):
            turns.append(1)
            inside.append(True)

        def __exit__(self, *a):
            inside.pop()
    real = tiny.forward
    outside = []

    def forward(*a, **kw):
        if not inside:
            outside.append(1)
        return real(*a, **kw)
    tiny.forward = forward
    try:
        profile(tiny, contexts=(16, 32), verify_ks=(1, 2), repeats=1, progress=False, turn=Turn)
    finally:
        del tiny.forward
    assert turns and not outside


def test_a_profile_that_a_fresh_step_contradicts_is_measured_again(tiny, tmp_path, monkeypatch):
    """Another process's burst during the profile: the check after it disagrees, so it is taken again."""
    monkeypatch.setenv("KNN_SSD_CACHE", str(tmp_path / "cache"))
    agreements = iter([1.4, 0.97])
    monkeypatch.setattr(profiles, "check", lambda *a, **kw: next(agreements))
    calls = []
    real = profiles.profile

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **{**kw, "contexts": (16, 32), "verify_ks": (1, 2), "repeats": 1})
    monkeypatch.setattr(profiles, "profile", counted)
    lat = profiles.measure(tiny)
    assert len(calls) == 2 and lat.machine["attempts"] == 2 and lat.machine["check"] == 0.97
    from ssd_core.calibration.latency import check
    assert 0.2 < check(tiny, lat, repeats=3) < 5          # a real step against the profile's own timing of it
