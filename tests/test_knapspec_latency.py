"""Latency model arithmetic, the auto policy, and KnapSpec's knapsack."""
import itertools
import math
import random

import numpy as np
import pytest
import torch

from ssd_core.calibration.latency import (LatencyModel, acceptance_for_tau, break_even, expected_tokens, fit_report,
                                          profile, speedup)
from ssd_core.engine.backbone import EMPTY
from ssd_core.engine.decode import DecodeConfig
from ssd_core.engine.generate import generate
from ssd_core.engine.skipset import SkipSet
from ssd_core.policies.ar import Autoregressive
from ssd_core.policies.auto import Auto
from ssd_core.policies.knapspec import KnapSpec, choose_skip, fit_kappa, knapsack_min_loss, sublayer_similarity
from ssd_core.policies.static import Static


def lat(n_layers=5, attn_b=1e-6, verify=None):
    return LatencyModel(n_layers=n_layers, attn_a=2e-3, attn_b=attn_b, mlp=3e-3, head=1e-3,
                        overhead=1e-3, verify=verify or {1: 1.0, 2: 1.05, 5: 1.3, 9: 1.6})


def test_expected_tokens_formula():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_speedup_formula_break_even_and_its_inverse():
    assert speedup(0.0, 0.5, 1.0, 4) == pytest.approx(1 / 3)
    assert speedup(1.0, 0.1, 1.0, 4) == pytest.approx(5 / 1.4, rel=1e-6)
    assert break_even(0.9, 1.5, 4) is None
    be = break_even(0.3, 1.0, 4)
    assert 0 < be < 1 and speedup(be, 0.3, 1.0, 4) >= 1.0
    assert acceptance_for_tau(expected_tokens(0.6, 4), 4) == pytest.approx(0.6, abs=1e-9)
    assert acceptance_for_tau(5.0, 4) == 1.0


def test_expected_speedup_by_hand():
    m = lat()
    skip = SkipSet({1, 2}, {3})
    full = 1e-3 + 1e-3 + 5 * (2e-3 + 1e-6 * 100) + 5 * 3e-3
    draft = full - 2 * (2e-3 + 1e-4) - 3e-3
    c = draft / full
    v = m.verify_cost(5)
    assert m.draft_cost(skip, 100) == pytest.approx(c)
    assert m.expected_speedup(skip, 0.8, 4, 100) == pytest.approx(expected_tokens(0.8, 4) / (4 * c + v))


def test_cost_breakdown_by_hand():
    """The cost panel's numbers, worked out on paper for the set above at context 100, γ 4, α 0.8."""
    b = lat().breakdown(SkipSet({1, 2}, {3}), 0.8, 4, 100)
    full = 1e-3 + 1e-3 + 5 * 2.1e-3 + 5 * 3e-3                 # overhead + head + 5 attn + 5 MLP = 27.5 ms
    c = (full - 2 * 2.1e-3 - 3e-3) / full                     # 20.3 / 27.5
    tau = 1 + 0.8 + 0.64 + 0.512 + 0.4096                     # 3.3616
    assert b["full_step_ms"] == pytest.approx(27.5) and b["draft_step_ms"] == pytest.approx(20.3)
    assert b["attn_ms"] == pytest.approx(2.1) and b["mlp_ms"] == pytest.approx(3.0)
    assert b["draft_cost"] == pytest.approx(c) and b["verify_cost"] == pytest.approx(1.3)
    assert b["expected_tokens"] == pytest.approx(tau) and b["step_cost"] == pytest.approx(4 * c + 1.3)
    assert b["predicted_speedup"] == pytest.approx(tau / (4 * c + 1.3))
    assert b["best_speedup"] == pytest.approx(5 / (4 * c + 1.3))
    a = b["break_even"]                                       # τ(a) equals the step's cost there
    assert sum(a ** k for k in range(5)) == pytest.approx(4 * c + 1.3)
    assert lat().breakdown(SkipSet(), 0.8, 4)["break_even"] is None    # a full-cost draft never breaks even


def test_verify_cost_interpolates_and_extrapolates():
    m = lat()
    assert m.verify_cost(1) == 1.0
    assert m.verify_cost(3) == pytest.approx(1.05 + (1.3 - 1.05) / 3)
    assert m.verify_cost(11) == pytest.approx(1.6 + 2 * (1.6 - 1.3) / 4)


def test_latency_round_trip_and_break_even():
    m = lat()
    assert LatencyModel.from_dict(m.to_dict()) == m
    skip = SkipSet({1, 2, 3}, {1, 2, 3})
    a = m.break_even_acceptance(skip, 4)
    assert a is not None and m.expected_speedup(skip, a, 4) == pytest.approx(1.0, abs=1e-6)


def test_profile_on_tiny_model(tiny):
    m = profile(tiny, contexts=(16, 64, 128), verify_ks=(1, 2, 5), repeats=3, progress=False)
    assert m.n_layers == tiny.n_layers
    assert set(m.verify) == {1, 2, 5}
    assert len(fit_report(m)) == 3


def test_profile_recovers_a_known_cost_model(tiny, monkeypatch):
    """Forwards timed by a known cost model: the profile's fit must give its numbers back (the real
    timings above are too noisy on a shared CPU to check anything but the shape)."""
    import ssd_core.calibration.latency as latency
    A, B, M, BARE, V = 2e-4, 3e-6, 5e-4, 0.2, 1e-3

    def timed(bb, cache, n_tokens, context, skip, repeats, draft=None, turn=None):
        L = bb.n_layers
        return BARE + (L - len(skip.attn)) * (A + B * context) + (L - len(skip.mlp)) * M + V * (n_tokens - 1)
    monkeypatch.setattr(latency, "_time_forward", timed)
    m = profile(tiny, contexts=(16, 64, 128), verify_ks=(1, 2, 5), repeats=1, progress=False, drafts=())
    assert (m.attn_a, m.attn_b, m.mlp) == (pytest.approx(A), pytest.approx(B), pytest.approx(M))
    assert m.overhead + m.head == pytest.approx(BARE)          # the head is timed for real, the rest is not
    assert all(abs(r["error_pct"]) < 0.1 for r in fit_report(m))
    ref = 16                                                   # verify costs are timed at the shortest context
    assert m.verify[5] == pytest.approx(timed(tiny, None, 5, ref, EMPTY, 1) / timed(tiny, None, 1, ref, EMPTY, 1),
                                        abs=1e-4)


def test_auto_falls_back_when_a_loss_is_predicted(tiny):
    skip = SkipSet({1}, {2}, name="math")
    slow_verify = lat(verify={1: 1.0, 5: 3.0})
    auto = Auto(Static(skip), slow_verify, {"math": 0.3}, gamma=4)
    g = generate(tiny, "auto", auto, max_new_tokens=12, gamma=4)
    assert g.start.forecast.skip == skip and g.start.forecast.speculate is False
    assert not any(s.speculative for s in g.steps[:7])
    # one probe every `probe_every` steps lets the run's own acceptance overturn the prediction
    assert [s.index for s in g.steps if s.speculative] == [i for i in range(len(g.steps)) if i % 8 == 7]
    assert "autoregressive" in g.steps[0].note
    fast = Auto(Static(skip), lat(verify={1: 1.0, 5: 1.01}), {"math": 0.99}, gamma=4)
    g2 = generate(tiny, "auto", fast, max_new_tokens=12, gamma=4)
    assert g2.start.forecast.speculate is True
    assert any(s.speculative for s in g2.steps)
    assert g2.token_ids == g.token_ids


# --- knapsack ----------------------------------------------------------------------------------
def _brute(weights, losses, capacity):
    best = [math.inf] * (capacity + 1)
    for r in range(len(weights) + 1):
        for subset in itertools.combinations(range(len(weights)), r):
            w = sum(weights[i] for i in subset)
            if w <= capacity:
                best[w] = min(best[w], sum(losses[i] for i in subset))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_knapsack_matches_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    weights = [rng.randint(1, 6) for _ in range(n)]
    losses = [round(rng.random(), 3) for _ in range(n)]
    cap = rng.randint(1, 25)
    best, choose = knapsack_min_loss(weights, losses, cap)
    expected = _brute(weights, losses, cap)
    for c in range(cap + 1):
        assert best[c] == pytest.approx(expected[c]) or (math.isinf(best[c]) and math.isinf(expected[c]))
        if math.isfinite(best[c]):
            items = choose(c)
            assert sum(weights[i] for i in items) == c
            assert sum(losses[i] for i in items) == pytest.approx(best[c])


def test_choose_skip_prefers_low_loss_sublayers_and_protects_ends():
    m = lat(n_layers=6)
    attn = np.array([0.5, 0.999, 0.6, 0.999, 0.6, 0.5])
    mlp = np.array([0.5, 0.6, 0.999, 0.6, 0.6, 0.5])
    choice = choose_skip(m, attn, mlp, context_len=128, gamma=4, kappa=4.0)
    assert 0 not in choice.skip.attn | choice.skip.mlp
    assert 5 not in choice.skip.attn | choice.skip.mlp
    assert {1, 3} <= choice.skip.attn and 2 in choice.skip.mlp


def test_attention_gets_skipped_more_as_context_grows():
    # attention sublayers match a little worse than MLPs: at 16 tokens attention is cheap (2.3 ms vs
    # 3 ms per MLP) so the knapsack skips MLPs; at 4000 tokens attention (82 ms) dominates the step
    m = lat(n_layers=8, attn_b=2e-5)
    attn_sim, mlp_sim = np.full(8, 0.985), np.full(8, 0.995)
    short = choose_skip(m, attn_sim, mlp_sim, context_len=16, gamma=4, kappa=3.0)
    long = choose_skip(m, attn_sim, mlp_sim, context_len=4000, gamma=4, kappa=3.0)
    assert short.predicted_speedup > 1 and long.predicted_speedup > 1     # both really speculate
    assert short.skip.mlp and not short.skip.attn
    assert long.skip.attn and len(long.skip.attn) > len(short.skip.attn)
    assert len(long.skip.mlp) < len(short.skip.mlp)


def test_fit_kappa_recovers_a_known_value():
    pts = [(l, math.exp(-5.0 * l)) for l in (0.01, 0.05, 0.1, 0.2)]
    assert fit_kappa(pts) == pytest.approx(5.0)


def test_sublayer_similarity_leaves_the_cache_intact(tiny):
    ids = list(tiny.encode("similarity probe").ids)
    cache = tiny.new_cache(64)
    tiny.forward(ids[:-1], cache)
    k0 = cache.k[:, :, :cache.length].clone()
    attn, mlp = sublayer_similarity(tiny, cache, ids, window=6)
    assert cache.length == len(ids) - 1
    torch.testing.assert_close(cache.k[:, :, :cache.length], k0, atol=1e-5, rtol=1e-5)
    assert attn.shape == (tiny.n_layers,) and np.all(attn <= 1.0 + 1e-6)


def test_knapspec_is_lossless_and_reports_its_decisions(tiny):
    cfg = DecodeConfig(max_new_tokens=40, gamma=3)
    ar = generate(tiny, "knapsack decoding", Autoregressive(), cfg)
    ks = KnapSpec(lat(), gamma=3, every=8)
    g = generate(tiny, "knapsack decoding", ks, cfg)
    assert g.token_ids == ar.token_ids
    assert all(s.speculative for s in g.steps)
    notes = [s.note for s in g.steps if s.note]
    assert notes and notes[0].startswith("knapspec: re-optimised")
    forecasts = [s.forecast for s in g.steps if s.forecast is not None]     # one per re-optimisation
    assert len(forecasts) == len(notes) and forecasts[0].skip == g.steps[0].skip
    assert forecasts[0].context_len == g.steps[0].context_len and 0 < forecasts[0].acceptance <= 1


# --- the machine the costs describe (issue #33, item 3) ----------------------------------------------
def test_a_profile_knows_the_cpu_and_kernel_it_was_measured_with(tiny):
    from ssd_core.calibration.latency import profile
    from ssd_core.engine.machine import cpu_info
    lat = profile(tiny, contexts=(16,), verify_ks=(1, 2), repeats=1, progress=False, drafts=())
    assert lat.machine["cpu"] == cpu_info() and lat.machine["kernel"] == tiny.kernel
    assert lat.stale_for(tiny) is None
    other_cpu = {**lat.machine, "cpu": {**cpu_info(), "model": "AMD EPYC 7B13", "flags": ["avx2", "fma"]}}
    why = LatencyModel.from_dict({**lat.to_dict(), "machine": other_cpu}).stale_for(tiny)
    assert "AMD EPYC 7B13 (avx2, fma" in why and "running on" in why
    older = {k: v for k, v in lat.machine.items() if k != "cpu"}      # calibrations made before the record
    assert "unrecorded CPU" in LatencyModel.from_dict({**lat.to_dict(), "machine": older}).stale_for(tiny)
    kernel = {**lat.machine, "kernel": "onednn" if tiny.kernel != "onednn" else "plain"}
    assert "verifier kernel" in LatencyModel.from_dict({**lat.to_dict(), "machine": kernel}).stale_for(tiny)
    gpu = LatencyModel.from_dict({**lat.to_dict(), "device": "cuda: NVIDIA H100"})
    assert gpu.stale_for(tiny).startswith("profiled on cuda: NVIDIA H100")
