"""The greedy fixed-size search (calibration.greedy) on a made-up scorer and on the tiny Llama."""
import pytest
import torch

from ssd_core.calibration.candidates import from_slots, searchable_slots
from ssd_core.calibration.greedy import greedy_set
from ssd_core.calibration.matchness import build_match_data, matchness
from ssd_core.calibration.search import search_all, search_skip_set
from test_search import PROMPTS, latency_for


class Made:
    """A matchness with known structure: each skipped slot costs its price, one pair costs extra."""

    def __init__(self, price, pair=(), pair_cost=0.0):
        self.price, self.pair, self.pair_cost = price, set(pair), pair_cost
        self.seen: set = set()

    def __call__(self, skip):
        chosen = {("attn", i) for i in skip.attn} | {("mlp", i) for i in skip.mlp}
        self.seen.add(frozenset(chosen))
        hit = self.pair_cost if self.pair and self.pair <= chosen else 0.0
        return 1.0 - sum(self.price[s] for s in chosen) - hit

    def evaluated(self):
        return len(self.seen)


def prices(n_layers):
    return {s: 0.01 * (k + 1) for k, s in enumerate(searchable_slots(n_layers))}


def test_greedy_picks_the_cheapest_sublayers_when_costs_add_up():
    made = Made(prices(8))
    chosen, alone = greedy_set(8, 3, made, made.evaluated, budget=1000)
    assert set(chosen) == set(searchable_slots(8)[:3])
    assert alone == {s: pytest.approx(1.0 - p) for s, p in prices(8).items()}


def test_construction_sees_interactions_between_skipped_sublayers():
    """The two least important sublayers alone are a bad pair: the construction avoids the pair."""
    s = searchable_slots(8)
    made = Made(prices(8), pair=(s[0], s[1]), pair_cost=0.5)
    chosen, _ = greedy_set(8, 2, made, made.evaluated, budget=0)
    assert s[0] in chosen and s[1] not in chosen and s[2] in chosen


def test_swaps_repair_what_a_one_candidate_construction_got_wrong():
    s = searchable_slots(8)
    made = Made(prices(8), pair=(s[0], s[1]), pair_cost=0.5)
    built, _ = greedy_set(8, 2, made, made.evaluated, budget=0, shortlist=1)
    assert set(built) == {s[0], s[1]}                  # no choice per step, no swaps allowed
    made = Made(prices(8), pair=(s[0], s[1]), pair_cost=0.5)
    swapped, _ = greedy_set(8, 2, made, made.evaluated, budget=1000, shortlist=1)
    assert made(from_slots(swapped)) > made(from_slots(built))
    assert not {s[0], s[1]} <= set(swapped)


def test_the_budget_caps_only_the_swaps():
    made = Made(prices(8))
    greedy_set(8, 4, made, made.evaluated, budget=1)
    n = len(searchable_slots(8))
    assert n < made.evaluated() <= n + 3 * 6         # singles + construction, nothing more


def test_greedy_rejects_impossible_sizes():
    made = Made(prices(5))
    with pytest.raises(ValueError, match="cannot skip"):
        greedy_set(5, 7, made, made.evaluated, budget=10)


# --- through search_skip_set, on the tiny random Llama ------------------------------------------------
@pytest.fixture(scope="module")
def data(tiny):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield build_match_data(tiny, PROMPTS, continuation_tokens=16, progress=False)
    torch.set_num_threads(before)


def test_greedy_search_keeps_the_ratio_and_reports_the_set_it_built(tiny, data):
    lat = latency_for(tiny.n_layers)
    r = search_skip_set(tiny, data, lat, budget=40, progress=False, mode="matchness", skip_ratio=0.3,
                        name="qa")
    assert len(r.skip) == 3 and r.skip.name == "qa"
    assert r.matchness == matchness(tiny, r.skip, data)
    full = [h for h in r.history if h["feasible"]]
    assert full and r.matchness == max(h["matchness"] for h in full)
    singles = [h for h in r.history if len(h["attn"]) + len(h["mlp"]) == 1]
    assert len({(tuple(h["attn"]), tuple(h["mlp"])) for h in singles}) == 6   # every sublayer alone
    # the same search again, from the memo it left: the same set, no new passes
    memo: dict = {}
    first = search_skip_set(tiny, data, lat, budget=40, progress=False, mode="matchness", skip_ratio=0.3,
                            known=memo, on_new=lambda k, v: None)
    again = search_skip_set(tiny, data, lat, budget=40, progress=False, mode="matchness", skip_ratio=0.3,
                            known=dict(memo), on_new=lambda k, v: pytest.fail(k))
    assert again.skip == first.skip


def test_search_all_searches_matchness_mode_greedily(tiny, data):
    sets, static = search_all(tiny, {"math": data}, latency_for(tiny.n_layers), budget=8,
                              progress=False, mode="matchness", skip_ratio=0.3)
    assert len(sets["math"].skip) == len(static.skip) == 3
    assert any(len(h["attn"]) + len(h["mlp"]) == 1 for h in static.history)
