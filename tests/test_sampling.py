"""Speculative SAMPLING is lossless in distribution (DESIGN.md §5), checked so that it can fail.

* End to end: the joint law of the first three generated tokens of `decode(...)` with γ = 3, a
  skip set that makes the draft really differ from the target, temperature and top-p, is compared
  with the EXACT joint computed from full forwards of the target (an independent float64
  softmax / top-p), by a chi-square goodness-of-fit on a fixed set of seeds.
  The bonus token after γ accepted drafts (token 5) is checked on its own by a randomised PIT.
* Power: the same statistic rejects wrong acceptance rules (accept every draft; accept with
  min(1, q/p)) monkeypatched into the decode loop; a per-position check of `_speculative_sample`
  on constructed rows also rejects "resample from p instead of the residual".
* The bonus token after γ accepted drafts is drawn from the target's row γ.
* The empty-residual fallback of `_speculative_sample` (only reachable through rounding: with exact
  arithmetic a rejection implies Σ max(0, p − q) ≥ q(d) − p(d) > 0) samples from the row's p.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import ssd_core.engine.events as D   # the loop (engine.rows) looks the rule up there
from ssd_core.engine.backbone import EMPTY
from ssd_core.engine.decode import DecodeConfig, Start, Step, _probs, _speculative_sample, decode
from ssd_core.engine.skipset import SkipSet
from ssd_core.policies.static import Static
from tiny import tiny_backbone

GAMMA = 3
TEMPERATURE = 0.5         # the random tiny Llama is flat at 1.0; 0.5 leaves ~60 heavy 3-token cells
TOP_P = 0.9               # exercises drafts outside the target's nucleus (always rejected)
DEPTH = 3                 # t1 (prefill), t2 and t3 (draft positions 0 and 1 of the first step)
N = 1000                  # honest draws (seeds 0..N-1): ~7 s on one free core
N_WRONG = 250             # draws per wrong rule: the honest test's power is overwhelming
SKIP = SkipSet({2}, ())   # the draft skips layer 2's attention: accepts 0/1/2/3 drafts all occur


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model is Python-bound; two threads on two shared cores only add contention."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


# --- the exact target law -----------------------------------------------------------------------
def _reference_probs(logits: torch.Tensor, temperature: float, top_p: float) -> np.ndarray:
    """softmax(logits / T) cut to the smallest top-p nucleus, in float64 (independent of _probs)."""
    x = logits.double().numpy() / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        sorted_p = p[order]
        keep = np.cumsum(sorted_p) - sorted_p < top_p     # keep a token while the mass before it < top_p
        cut = np.zeros_like(p)
        cut[order[keep]] = sorted_p[keep]
        p = cut / cut.sum()
    return p


class Target:
    """p(next token | prompt + prefix) from a full, cache-free forward of the target model."""

    def __init__(self, bb, prompt_ids, temperature=TEMPERATURE, top_p=TOP_P):
        self.bb, self.prompt_ids = bb, tuple(prompt_ids)
        self.temperature, self.top_p = temperature, top_p
        self._memo: dict[tuple, np.ndarray] = {}

    def next_probs(self, prefix: tuple) -> np.ndarray:
        if prefix not in self._memo:
            ids = list(self.prompt_ids + prefix)
            logits = self.bb.forward(ids, self.bb.new_cache(len(ids) + 1), EMPTY)
            self._memo[prefix] = _reference_probs(logits, self.temperature, self.top_p)
        return self._memo[prefix]

    def joint(self, depth: int, floor: float) -> dict[tuple, float]:
        """Every sequence of `depth` tokens with probability ≥ floor (exactly: prefixes are heavier)."""
        cells = {(): 1.0}
        for _ in range(depth):
            grown = {}
            for prefix, mass in cells.items():
                p = self.next_probs(prefix)
                for t in np.nonzero(mass * p >= floor)[0]:
                    grown[prefix + (int(t),)] = mass * float(p[t])
            cells = grown
        return cells

    def prob(self, seq: tuple) -> float:
        mass = 1.0
        for j, t in enumerate(seq):
            mass *= float(self.next_probs(tuple(seq[:j]))[t])
        return mass


def chi_square_p(samples: list[tuple], cells: dict[tuple, float]) -> tuple[float, int]:
    """Goodness of fit of `samples` to the exact law; cells expecting < 5 draws are pooled."""
    n = len(samples)
    keys = sorted((k for k, v in cells.items() if v * n >= 5), key=cells.get, reverse=True)
    index = {k: i for i, k in enumerate(keys)}
    observed = np.zeros(len(keys) + 1)
    for s in samples:
        observed[index.get(s, len(keys))] += 1
    expected = np.array([cells[k] for k in keys] + [0.0]) * n
    expected[-1] = n - expected[:-1].sum()                # everything else, exactly
    if expected[-1] < 5:                                  # too light to stand alone: merge it
        observed[-2] += observed[-1]
        expected[-2] += expected[-1]
        observed, expected = observed[:-1], expected[:-1]
    return float(chisquare(observed, expected).pvalue), len(observed)


# --- the decode loop, end to end ------------------------------------------------------------------
@pytest.fixture(scope="module")
def setting():
    bb = tiny_backbone(layers=4, seed=0)
    prompt = bb.encode("ab")
    target = Target(bb, prompt.ids)
    return bb, prompt, target, target.joint(DEPTH, 5 / N)


def first_tokens(bb, prompt, seeds) -> tuple[list[tuple], Counter, list[tuple]]:
    """Per seed, the first DEPTH tokens of `decode`; how many drafts each first step accepted; and
    for first steps that accepted all γ drafts, the tokens up to and including the bonus token."""
    samples, accepted, bonus = [], Counter(), []
    for seed in seeds:
        cfg = DecodeConfig(max_new_tokens=DEPTH + GAMMA, gamma=GAMMA, temperature=TEMPERATURE,
                           top_p=TOP_P, seed=seed, stop_at_eos=False)
        tokens: list[int] = []
        for event in decode(bb, prompt, Static(SKIP), cfg):
            if isinstance(event, Start):
                tokens.append(event.first_token)
                continue
            assert isinstance(event, Step)
            tokens.extend(event.committed)
            if event.index == 0:
                assert event.speculative and len(event.drafted) == GAMMA
                accepted[event.accepted] += 1
                if event.accepted == GAMMA:
                    bonus.append(tuple(tokens[:GAMMA + 2]))   # t1, the γ drafts, the bonus
            if len(tokens) >= DEPTH:
                break                                     # the generator stops computing here
        samples.append(tuple(tokens[:DEPTH]))
    return samples, accepted, bonus


def bonus_pit_p(target: Target, sequences: list[tuple], seed: int = 0) -> float:
    """Kolmogorov-Smirnov p-value of the randomised probability integral transform of each bonus
    token under p(· | t1 and the γ accepted drafts): uniform on [0, 1] if the bonus follows it."""
    from scipy.stats import kstest
    rng = np.random.default_rng(seed)
    pit = []
    for seq in sequences:
        p, b = target.next_probs(seq[:-1]), seq[-1]
        pit.append(float(p[:b].sum()) + rng.random() * float(p[b]))
    return float(kstest(pit, "uniform").pvalue)


@pytest.mark.slow
def test_speculative_sampling_joint_law_matches_target(setting):
    bb, prompt, target, cells = setting
    samples, accepted, bonus = first_tokens(bb, prompt, range(N))
    # the setting exercises every branch: rejection at position 0, acceptance at position 1
    # (t3 is then a draft), rejection later, and the bonus token after γ accepted drafts
    assert all(accepted[k] >= 0.05 * N for k in range(GAMMA + 1)), accepted
    # no token ever falls outside the target's support (top-p nucleus) given its prefix
    outside = [s for s in set(samples) if target.prob(s) == 0.0]
    assert not outside, f"sequences the target gives probability 0: {outside[:5]}"
    p_value, bins = chi_square_p(samples, cells)
    assert bins >= 30, bins                               # a joint with many heavy cells, not a coin
    assert p_value > 1e-3, f"speculative sampling does not reproduce the target: p = {p_value:.3g}"
    # t3 is at most the second draft: the bonus after γ = 3 accepted drafts is checked on its own
    assert len(bonus) >= 0.05 * N
    assert bonus_pit_p(target, bonus) > 1e-3


def _always_accept(logits, drafted, q_rows, cfg, gen, p_rows=None):
    p_rows = D._probs(logits, cfg)
    return len(drafted), D._sample(p_rows[len(drafted)], gen)


def _accept_q_over_p(logits, drafted, q_rows, cfg, gen, p_rows=None):
    """The ratio upside down: accept with min(1, q/p)."""
    p_rows = D._probs(logits, cfg)
    for i, d in enumerate(drafted):
        p, q = p_rows[i], q_rows[i]
        if float(torch.rand((), generator=gen)) < min(1.0, float(q[d]) / max(float(p[d]), 1e-20)):
            continue
        residual = torch.clamp(p - q, min=0.0)
        return i, D._sample(residual / residual.sum(), gen)
    return len(drafted), D._sample(p_rows[len(drafted)], gen)


def _resample_from_p(logits, drafted, q_rows, cfg, gen, p_rows=None):
    """The right acceptance test, but a rejection resamples from p instead of norm(max(0, p − q))."""
    p_rows = D._probs(logits, cfg)
    for i, d in enumerate(drafted):
        p, q = p_rows[i], q_rows[i]
        if float(torch.rand((), generator=gen)) < min(1.0, float(p[d]) / max(float(q[d]), 1e-20)):
            continue
        return i, D._sample(p, gen)
    return len(drafted), D._sample(p_rows[len(drafted)], gen)


@pytest.mark.slow
@pytest.mark.parametrize("wrong_rule", [_always_accept, _accept_q_over_p],
                         ids=["always-accept", "min(1,q/p)"])
def test_chi_square_rejects_wrong_acceptance_rules(setting, monkeypatch, wrong_rule):
    bb, prompt, target, cells = setting
    monkeypatch.setattr(D, "_speculative_sample", wrong_rule)
    samples, _, _ = first_tokens(bb, prompt, range(10 ** 6, 10 ** 6 + N_WRONG))
    p_value, _ = chi_square_p(samples, cells)
    assert p_value < 1e-8, f"the goodness-of-fit test has no power against {wrong_rule.__name__}"


# --- _speculative_sample directly -------------------------------------------------------------------
def _rows(*dists) -> torch.Tensor:
    return torch.log(torch.tensor(dists, dtype=torch.float32))


def _fit(counts: np.ndarray, p: np.ndarray) -> float:
    assert counts[p == 0].sum() == 0, "a token with probability 0 was drawn"
    keep = p > 0
    return float(chisquare(counts[keep], p[keep] / p[keep].sum() * counts.sum()).pvalue)


# target rows 0..γ (row γ is the bonus row) and draft rows 0..γ-1 that differ a lot (TV ≈ 0.3-0.6)
P_ROWS = _rows([0.40, 0.25, 0.15, 0.10, 0.05, 0.05],
               [0.05, 0.45, 0.20, 0.10, 0.10, 0.10],
               [0.10, 0.10, 0.10, 0.20, 0.30, 0.20],
               [0.30, 0.05, 0.05, 0.30, 0.05, 0.25])
Q_ROWS = [torch.tensor(q) for q in ([0.10, 0.10, 0.30, 0.30, 0.10, 0.10],
                                    [0.30, 0.10, 0.30, 0.10, 0.10, 0.10],
                                    [0.40, 0.10, 0.10, 0.10, 0.10, 0.20])]


def _position_counts(rule, n: int, seed: int) -> np.ndarray:
    """Drafts d_i ~ q_i (rows independent of the context), then `rule`; counts of the token committed
    at each position i among the trials that reached it. With context-free rows a correct rule
    commits, at every position it reaches, a token distributed as p_i (the bonus as p_γ)."""
    cfg = DecodeConfig(temperature=1.0)
    gen = torch.Generator().manual_seed(seed)
    counts = np.zeros((GAMMA + 1, P_ROWS.shape[1]))
    for _ in range(n):
        drafted = [int(torch.multinomial(q, 1, generator=gen)) for q in Q_ROWS]
        accepted, token = rule(P_ROWS, drafted, Q_ROWS, cfg, gen)
        for i, t in enumerate(drafted[:accepted] + [token]):
            counts[i, t] += 1
    return counts


def test_speculative_sample_each_position_follows_target_row():
    counts = _position_counts(_speculative_sample, 6000, seed=5)
    target = _probs(P_ROWS, DecodeConfig(temperature=1.0)).double().numpy()
    assert counts[GAMMA].sum() >= 300                     # the bonus row is reached often enough
    for i in range(GAMMA + 1):
        assert _fit(counts[i], target[i]) > 1e-3, f"position {i}: {counts[i]}"


@pytest.mark.parametrize("wrong_rule", [_always_accept, _accept_q_over_p, _resample_from_p],
                         ids=["always-accept", "min(1,q/p)", "resample-from-p"])
def test_position_check_rejects_wrong_rules(wrong_rule):
    counts = _position_counts(wrong_rule, 6000, seed=5)
    target = _probs(P_ROWS, DecodeConfig(temperature=1.0)).double().numpy()
    worst = min(_fit(counts[i], target[i]) for i in range(GAMMA) if counts[i].sum() > 0)
    assert worst < 1e-8, f"no power against {wrong_rule.__name__}: p = {worst:.3g}"


def test_bonus_token_comes_from_target_row_gamma():
    cfg = DecodeConfig(temperature=1.0)
    # four distinct target rows; the draft equals the target on rows 0..γ-1 → every draft accepted
    logits = _rows([0.4, 0.3, 0.15, 0.1, 0.05],
                   [0.1, 0.5, 0.2, 0.1, 0.1],
                   [0.25, 0.25, 0.25, 0.125, 0.125],
                   [0.05, 0.05, 0.1, 0.2, 0.6])
    p_rows = _probs(logits, cfg)
    q_rows = [p_rows[i].clone() for i in range(GAMMA)]
    drafted = [0, 1, 3]
    gen = torch.Generator().manual_seed(123)
    counts = np.zeros(p_rows.shape[1])
    for _ in range(4000):
        accepted, bonus = _speculative_sample(logits, drafted, q_rows, cfg, gen)
        assert accepted == GAMMA
        counts[bonus] += 1
    rows = p_rows.double().numpy()
    assert _fit(counts, rows[GAMMA]) > 1e-3
    for wrong in range(GAMMA):                            # and not from any other row
        assert _fit(counts, rows[wrong]) < 1e-12


class _TorchWithRand:
    """`torch` as seen by ssd_core.engine.decode, except that `rand` returns a chosen value."""

    def __init__(self, u: float):
        self._u = u

    def rand(self, *shape, generator=None, **kw):
        return torch.tensor(self._u, dtype=torch.float32)

    def __getattr__(self, name):
        return getattr(torch, name)


def test_empty_residual_falls_back_to_target_row(monkeypatch):
    """Reject draft 1 while max(0, p − q) is exactly empty: the token must be drawn from p_rows[1].

    q_rows[1] equals p_rows[1] except that the drafted token is a hair heavier in q (p/q = 1 − 1e-6),
    so the residual is zero everywhere; u is forced to the largest float32 below 1 so the draft is
    rejected (and draft 0, with p == q, is still accepted).
    """
    u = float(np.nextafter(np.float32(1.0), np.float32(0.0)))
    monkeypatch.setattr(D, "torch", _TorchWithRand(u))
    cfg = DecodeConfig(temperature=1.0)
    logits = _rows([0.4, 0.3, 0.2, 0.1],
                   [0.1, 0.6, 0.2, 0.1],
                   [0.25, 0.25, 0.25, 0.25])
    p_rows = _probs(logits, cfg)
    drafted = [0, 2]
    q1 = p_rows[1].clone()
    q1[2] = q1[2] * (1 + 1e-6)
    q_rows = [p_rows[0].clone(), q1]
    assert float(torch.clamp(p_rows[1] - q1, min=0.0).sum()) == 0.0      # the residual is empty
    assert float(p_rows[1][2]) / float(q1[2]) <= u                        # and u rejects draft 1
    counts = np.zeros(4)
    for seed in range(3000):
        gen = torch.Generator().manual_seed(seed)
        accepted, token = _speculative_sample(logits, drafted, q_rows, cfg, gen)
        assert accepted == 1                                              # rejected at index 1
        # drawn from p_rows[1] with the caller's generator (rand is patched, so gen is untouched)
        expected = int(torch.multinomial(p_rows[1], 1, generator=torch.Generator().manual_seed(seed)))
        assert token == expected
        counts[token] += 1
    rows = p_rows.double().numpy()
    assert _fit(counts, rows[1]) > 1e-3
    assert _fit(counts, rows[0]) < 1e-12 and _fit(counts, rows[2]) < 1e-12
