"""Skip-set search on the tiny random Llama: matchness, its off-by-one, and the optuna search."""
import json

import pytest
import torch

from ssd_core.calibration.candidates import default_initial, searchable_layers, structured_candidates
from ssd_core.calibration.latency import LatencyModel
from ssd_core.calibration.matchness import (MatchData, build_match_data, matchness, matchness_per_domain, merge,
                                           model_drafted_only)
from ssd_core.calibration.search import STATIC, SearchResult, search_all, search_skip_set, static_share
from ssd_core.engine.backbone import EMPTY
from ssd_core.engine.skipset import SkipSet
from tiny import tiny_backbone

PROMPTS = ["the quick brown fox", "hello world, again", "1+1=2, 2+2=", "abc def ghi"]
OTHER = ["Summarize: rain fell.", "x y z"]


def latency_for(n_layers: int) -> LatencyModel:
    return LatencyModel(n_layers=n_layers, attn_a=2e-3, attn_b=1e-6, mlp=3e-3, head=1e-3,
                        overhead=1e-3, verify={1: 1.0, 2: 1.05, 5: 1.3, 9: 1.6})


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls gain nothing from threads, and on a shared 2-core box OpenMP threads that
    spin-wait for a busy core make them ~100× slower; restored for the other test modules."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def data(tiny, one_thread):
    return build_match_data(tiny, PROMPTS, continuation_tokens=16, progress=False)


@pytest.fixture(scope="module")
def other(tiny, one_thread):
    return build_match_data(tiny, OTHER, continuation_tokens=12, progress=False)


def everything_allowed(n_layers: int) -> SkipSet:
    inner = frozenset(searchable_layers(n_layers))
    return SkipSet(inner, inner)


def brute_force_matches(bb, skip: SkipSet, data: MatchData) -> int:
    """One token at a time: the full model's prompt KV, then the draft on each position."""
    hits = 0
    for seq, start, target in zip(data.sequences, data.starts, data.targets):
        cache = bb.new_cache(len(seq))
        if start > 1:
            bb.forward(seq[:start - 1], cache, EMPTY, logits="none")
        for j in range(len(seq) - start):
            # the hidden state at position start-1+j predicts the token at start+j
            logits = bb.forward([seq[start - 1 + j]], cache, skip, logits="last")
            hits += int(int(logits.argmax()) == int(target[j]))
    return hits


# --- matchness ---------------------------------------------------------------------------------
def test_match_data_shapes(data):
    assert len(data) == len(PROMPTS)
    for seq, start, target, (k, v) in zip(data.sequences, data.starts, data.targets, data.prefix_kv):
        assert 1 <= start < len(seq)
        assert len(target) == len(seq) - start <= 16
        assert k.shape[2] == v.shape[2] == start - 1
    assert data.tokens == sum(len(s) - st for s, st in zip(data.sequences, data.starts))


def test_targets_are_the_greedy_continuation(data):
    """targets[i][j] predicts sequence position starts[i]+j: it must be the token generated there."""
    for seq, start, target in zip(data.sequences, data.starts, data.targets):
        assert target.tolist() == list(seq[start:])


def test_empty_skip_set_matches_everything(tiny, data):
    assert matchness(tiny, SkipSet(), data) == 1.0


def test_skipping_everything_allowed_matches_less(tiny, data):
    assert matchness(tiny, everything_allowed(tiny.n_layers), data) < 0.9


@pytest.mark.parametrize("skip", [SkipSet({1, 3}, {2}), SkipSet(set(), {1, 2, 3}), SkipSet({2}, set()),
                                  everything_allowed(5)])
def test_matchness_equals_step_by_step_brute_force(tiny, data, skip):
    m = matchness(tiny, skip, data)
    assert 0.0 <= m < 1.0
    assert m * data.tokens == pytest.approx(brute_force_matches(tiny, skip, data))


def test_matchness_without_prefix_cache_is_the_same(tiny, data):
    bare = MatchData(data.sequences, data.starts, data.targets)
    skip = SkipSet({1}, {3})
    assert matchness(tiny, skip, bare) == matchness(tiny, skip, data)


def test_matchness_is_weighted_by_tokens(tiny, data, other):
    skip = SkipSet({2}, {1})
    mixed = merge([data, other])
    assert len(mixed) == len(data) + len(other) and mixed.tokens == data.tokens + other.tokens
    expected = (matchness(tiny, skip, data) * data.tokens
                + matchness(tiny, skip, other) * other.tokens) / mixed.tokens
    assert matchness(tiny, skip, mixed) == pytest.approx(expected)
    per = matchness_per_domain(tiny, skip, {"a": data, "b": other})
    assert per == {"a": matchness(tiny, skip, data), "b": matchness(tiny, skip, other)}


def test_merge_interleaves_so_a_limit_keeps_the_mix(data, other):
    mixed = merge([data, other], limit=3)
    assert mixed.sequences == (data.sequences[0], other.sequences[0], data.sequences[1])
    assert len(mixed.prefix_kv) == 3
    bare = MatchData(other.sequences, other.starts, other.targets)
    assert merge([data, bare]).prefix_kv == ()


def lookup_would_draft(context) -> bool:
    """Independent of PromptLookup: the last two tokens occurred earlier, followed by a token."""
    tail = tuple(context[-2:])
    return len(context) >= 3 and any(tuple(context[i:i + 2]) == tail for i in range(len(context) - 2))


def test_model_drafted_only_drops_the_positions_lookup_drafts():
    seq = (5, 6, 7, 5, 6, 8, 5, 6)        # at position 5 the text ends in "5 6", seen before 7
    data = MatchData((seq,), (3,), (torch.tensor(seq[3:]),))
    kept = model_drafted_only(data)
    assert kept.targets[0].tolist() == [5, 6, -1, 5, 6]
    assert kept.tokens == 4 and data.tokens == 5
    with pytest.raises(ValueError):        # nothing left to score
        model_drafted_only(MatchData(((1, 2, 1, 2, 1),), (4,), (torch.tensor([1]),)))


def test_matchness_on_model_drafted_positions_only(tiny, data):
    kept = model_drafted_only(data)
    for seq, start, full, target in zip(data.sequences, data.starts, data.targets, kept.targets):
        for j in range(len(full)):
            dropped = lookup_would_draft(seq[:start + j])
            assert int(target[j]) == (-1 if dropped else int(full[j]))
    assert matchness(tiny, SkipSet(), kept) == 1.0
    skip = SkipSet({1, 3}, {2})
    hits = brute_force_matches(tiny, skip, kept)         # a -1 target never matches
    assert matchness(tiny, skip, kept) * kept.tokens == pytest.approx(hits)
    assert merge([kept, data]).tokens == kept.tokens + data.tokens


def test_match_data_rejects_inconsistent_rows(data):
    with pytest.raises(ValueError):
        MatchData(data.sequences, data.starts, data.targets[:-1])
    with pytest.raises(ValueError):
        MatchData(data.sequences[:1], (len(data.sequences[0]),), (torch.tensor([]),))


# --- search ------------------------------------------------------------------------------------
def objective(lat, skip, m):
    """What the search maximises: the predicted speedup at the best draft length γ ≤ 4."""
    return lat.expected_speedup(skip, m, lat.best_gamma(skip, m, 4, 256), 256)


def skipped_layers(skip: SkipSet) -> set:
    return set(skip.attn) | set(skip.mlp)


def worst_single_sublayer(bb, data, lat) -> SkipSet:
    """The one-sublayer draft with the lowest objective: costs nearly a full step, matches badly."""
    singles = [SkipSet({i}, set()) for i in searchable_layers(bb.n_layers)] + \
              [SkipSet(set(), {i}) for i in searchable_layers(bb.n_layers)]
    return min(singles, key=lambda s: objective(lat, s, matchness(bb, s, data)))


def test_search_beats_a_poor_initial_set(tiny, data):
    lat = latency_for(tiny.n_layers)
    poor = worst_single_sublayer(tiny, data, lat)
    r = search_skip_set(tiny, data, lat, budget=25, initial=poor, progress=False)
    assert r.initial_objective == pytest.approx(objective(lat, poor, matchness(tiny, poor, data)))
    assert r.objective > r.initial_objective
    assert r.history[0]["attn"] == sorted(poor.attn) and r.history[0]["mlp"] == sorted(poor.mlp)
    assert r.objective == max(h["objective"] for h in r.history if h["feasible"])
    assert not skipped_layers(r.skip) & {0, tiny.n_layers - 1}
    assert not r.skip.is_empty            # skipping nothing is no draft


def test_search_at_least_matches_its_default_initial(tiny, data):
    lat = latency_for(tiny.n_layers)
    r = search_skip_set(tiny, data, lat, budget=25, progress=False, name="qa")
    init = default_initial(tiny.n_layers)
    init_match = matchness(tiny, init, data)
    assert init_match > 0                   # a real draft: the comparison below is not 0 ≥ 0
    assert r.initial_objective == pytest.approx(objective(lat, init, init_match))
    assert r.initial_objective > 0
    # the initial set is scored first and the answer is the best feasible set scored, so it cannot
    # end below the initial one (a search that returned its last or a random trial would)
    first = r.history[0]
    assert (first["attn"], first["mlp"], first["feasible"]) == (sorted(init.attn), sorted(init.mlp), True)
    assert r.objective == max(h["objective"] for h in r.history if h["feasible"])
    assert r.objective >= r.initial_objective
    assert r.skip.name == "qa"
    assert r.objective == pytest.approx(objective(lat, r.skip, r.matchness))
    assert r.matchness == matchness(tiny, r.skip, data)


def test_search_never_touches_first_or_last_layer():
    bb = tiny_backbone(layers=6)
    d = build_match_data(bb, PROMPTS[:2], continuation_tokens=10, progress=False)
    r = search_skip_set(bb, d, latency_for(6), budget=30, n_random=30, progress=False)
    for h in r.history:
        assert not (set(h["attn"]) | set(h["mlp"])) & {0, 5}
    assert not skipped_layers(r.skip) & {0, 5}
    for cand in structured_candidates(6):
        assert not skipped_layers(cand) & {0, 5}


def test_budget_counts_distinct_candidates(tiny, data):
    r = search_skip_set(tiny, data, latency_for(tiny.n_layers), budget=20, progress=False)
    distinct = {(tuple(h["attn"]), tuple(h["mlp"])) for h in r.history}
    assert len(distinct) == 20
    assert r.trials == len(r.history) >= 20


def test_search_is_deterministic_for_a_seed(tiny, data):
    lat = latency_for(tiny.n_layers)
    a, b = (search_skip_set(tiny, data, lat, budget=20, seed=3, progress=False) for _ in range(2))
    assert a.history == b.history and a.skip == b.skip


def test_search_result_serialises(tiny, data):
    r = search_skip_set(tiny, data, latency_for(tiny.n_layers), budget=8, progress=False, name="math")
    d = json.loads(json.dumps(r.to_dict()))
    assert d["skip"]["name"] == "math" and d["trials"] == r.trials == len(d["history"])
    assert isinstance(r, SearchResult)


def test_search_rejects_bad_inputs(tiny, data):
    with pytest.raises(ValueError, match="layers"):
        search_skip_set(tiny, data, latency_for(6), budget=5, progress=False)
    with pytest.raises(ValueError, match="first or last"):
        search_skip_set(tiny, data, latency_for(5), budget=5, initial=SkipSet({0}, set()), progress=False)
    with pytest.raises(ValueError, match="min_skipped"):
        search_skip_set(tiny, data, latency_for(5), budget=5, initial=SkipSet(), progress=False)


def test_search_all_names_one_set_per_domain_plus_static(tiny, data, other):
    per, static = search_all(tiny, {"math": data, "qa": other}, latency_for(tiny.n_layers),
                             budget=8, progress=False, static_per_domain=None)
    assert set(per) == {"math", "qa"}
    assert all(r.skip.name == d for d, r in per.items())
    assert static.skip.name == STATIC
    mixed = merge([data, other])
    assert static.matchness == matchness(tiny, static.skip, mixed)


def test_static_mix_takes_a_balanced_share_of_each_domain(tiny, data, other):
    _, static = search_all(tiny, {"math": data, "qa": other}, latency_for(tiny.n_layers),
                           budget=4, progress=False, static_per_domain=1)
    mixed = merge([data, other], limit=2)
    assert static.matchness == matchness(tiny, static.skip, mixed)


@pytest.mark.parametrize("per_domain, n_domains, share", [(10, 7, 4), (24, 7, 4), (28, 7, 4), (29, 7, 5),
                                                         (64, 7, 10), (3, 2, 4)])
def test_static_mix_is_never_smaller_than_one_domains_search_data(per_domain, n_domains, share):
    assert static_share(per_domain, n_domains) == share
    assert share * n_domains >= per_domain


# --- KNN-SSD's mode: fixed skip ratio, maximise matchness ---------------------------------------------
def test_matchness_mode_keeps_the_ratio_and_maximises_matchness(tiny, data):
    from ssd_core.calibration.candidates import ratio_count
    count = ratio_count(tiny.n_layers, 0.3)
    assert count == 3                       # 0.3 × 2 × 5 sublayers
    r = search_skip_set(tiny, data, latency_for(tiny.n_layers), budget=15, progress=False,
                        mode="matchness", skip_ratio=0.3, name="qa")
    sizes = {len(h["attn"]) + len(h["mlp"]) for h in r.history}
    assert sizes == set(range(1, count + 1))           # greedy: single sublayers first, built up to count
    feasible = [h for h in r.history if h["feasible"]]
    assert feasible and all(len(h["attn"]) + len(h["mlp"]) == count for h in feasible)
    assert len(r.skip) == count and r.skip.name == "qa"
    assert r.objective == r.matchness == max(h["matchness"] for h in feasible)
    assert r.matchness == matchness(tiny, r.skip, data)
    # its objective is matchness, not speed: a speed search on the same data picks by speedup
    assert all(h["objective"] == h["matchness"] for h in r.history)
    assert {h["speedup"] for h in r.history} != {h["objective"] for h in r.history}


def test_matchness_mode_rejects_bad_settings(tiny, data):
    lat = latency_for(tiny.n_layers)
    with pytest.raises(ValueError, match="search mode"):
        search_skip_set(tiny, data, lat, budget=3, progress=False, mode="fastest")
    with pytest.raises(ValueError, match="skip ratio"):
        search_skip_set(tiny, data, lat, budget=3, progress=False, mode="matchness", skip_ratio=1.5)
    with pytest.raises(ValueError, match="no initial set"):
        search_skip_set(tiny, data, lat, budget=3, progress=False, mode="matchness", skip_ratio=0.3,
                        initial=SkipSet({2}, set()))


@pytest.mark.parametrize("mode", ["speed", "matchness"])
def test_a_resumed_search_replays_without_forward_passes(tiny, data, mode, monkeypatch):
    """An interrupted search resumed from its memo gives the same answer and re-measures nothing."""
    import ssd_core.calibration.search as search
    lat = latency_for(tiny.n_layers)
    memo: dict = {}
    first = search_skip_set(tiny, data, lat, budget=12, seed=1, progress=False, mode=mode,
                            known=memo, on_new=lambda k, v: None)
    n = len(memo)
    assert n >= 8           # 
    half = dict(list(memo.items())[:n // 2])            # as if killed halfway
    calls = []
    real = search.matchness
    monkeypatch.setattr(search, "matchness", lambda *a, **k: calls.append(1) or real(*a, **k))
    resumed = search_skip_set(tiny, data, lat, budget=12, seed=1, progress=False, mode=mode, known=half)
    assert resumed.history == first.history and resumed.skip == first.skip
    assert len(calls) == n - n // 2                     # only the ones it had not measured
    calls.clear()
    again = search_skip_set(tiny, data, lat, budget=12, seed=1, progress=False, mode=mode, known=memo)
    assert again.skip == first.skip and calls == []


def test_search_memo_on_disk_is_keyed_by_its_inputs(tmp_path):
    from ssd_core.calibration.search_memo import SearchMemo, fingerprint
    path = tmp_path / ".search_memo.json"
    fp = fingerprint(model="tiny", draft="int8", tokens=8)
    memo = SearchMemo(path, fp)
    memo.recorder("qa")("a1|m", 0.5)
    assert SearchMemo(path, fp).values("qa") == {"a1|m": 0.5}
    assert SearchMemo(path, fingerprint(model="tiny", draft="fp32", tokens=8)).size == 0
    path.write_text("{not json")
    assert SearchMemo(path, fp).size == 0               # a broken memo is only a lost cache
    memo.remove()
    assert not path.exists()
