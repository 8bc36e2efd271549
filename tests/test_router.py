"""KNN router on synthetic clusters, its persistence, and KnnStrategy's losslessness."""
import json

import numpy as np
import pytest
import torch

from ssd_core.calibration.router import Route, Router, suggest_threshold
from ssd_core.engine.decode import DecodeConfig
from ssd_core.engine.generate import generate
from ssd_core.engine.skipset import SkipSet
from ssd_core.policies.ar import Autoregressive
from ssd_core.policies.knn import KnnStrategy

DOMAINS = ["summarization", "math", "translation", "story", "sql", "code", "qa"]
DIM, PER_DOMAIN, HELD_OUT = 32, 40, 10
FALLBACK = SkipSet({1}, {2}, name="static")


def _sets(n_layers=5):
    # distinct, valid sets so a test can tell which one the router picked
    return {d: SkipSet({i % n_layers}, {(i + 2) % n_layers}, name=d) for i, d in enumerate(DOMAINS)}


def _clusters(seed=0, dim=DIM, n=PER_DOMAIN, noise=0.08):
    """7 Gaussian clusters around random (near-orthogonal in 32-D) unit directions."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(len(DOMAINS), dim))
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    points = {d: (c + noise * rng.normal(size=(n, dim))).astype(np.float32)
              for d, c in zip(DOMAINS, centres)}
    return centres, points


@pytest.fixture(scope="module")
def clusters():
    centres, points = _clusters()
    train = {d: p[:-HELD_OUT] for d, p in points.items()}
    held = {d: p[-HELD_OUT:] for d, p in points.items()}
    texts = {d: [f"{d} prompt {i}" for i in range(len(p))] for d, p in train.items()}
    router = Router.build(train, texts, _sets(), FALLBACK, centroids_per_domain=4, seed=0)
    return centres, train, held, router


def test_anchor_table_has_centroids_and_every_prompt(clusters):
    _, train, _, router = clusters
    assert len(router) == len(DOMAINS) * (4 + PER_DOMAIN - HELD_OUT)
    assert router.kinds.count("centroid") == 4 * len(DOMAINS)
    assert all(t == "" for t, k in zip(router.texts, router.kinds) if k == "centroid")
    assert np.allclose(np.linalg.norm(router.vectors, axis=1), 1.0, atol=1e-5)


@pytest.mark.parametrize("vote", ["majority", "weighted"])
def test_held_out_accuracy(clusters, vote):
    *_, held, router = clusters
    acc = router.accuracy(held, vote=vote)
    assert acc["overall"] >= 0.9
    assert set(acc) == set(DOMAINS) | {"overall"}


def test_route_returns_the_domains_set(clusters):
    *_, held, router = clusters
    route = router.route(torch.from_numpy(held["math"][0]))
    assert route.domain == "math" and not route.unknown
    assert route.skip == _sets()["math"]
    assert len(route.neighbours) == router.k
    sims = [n.similarity for n in route.neighbours]
    assert sims == sorted(sims, reverse=True) and route.similarity == sims[0]
    assert "routed to math" in route.describe()


def test_majority_counts_and_weighted_sums(clusters):
    *_, held, router = clusters
    q = held["code"][1]
    maj = router.route(q, k=7, vote="majority")
    wei = router.route(q, k=7, vote="weighted")
    assert sum(maj.votes.values()) == 7
    assert sum(wei.votes.values()) == pytest.approx(sum(n.similarity for n in wei.neighbours))


def test_far_vector_is_unknown_and_uses_fallback(clusters):
    centres, _, _, router = clusters
    rng = np.random.default_rng(5)
    v = rng.normal(size=DIM)
    basis, _ = np.linalg.qr(centres.T)            # orthonormal span of the cluster centres
    v -= basis @ (basis.T @ v)                     # orthogonal to every centre
    route = router.route(v, threshold=0.5)
    assert route.unknown and route.domain is None
    assert route.skip == FALLBACK
    assert route.describe().startswith("unknown domain (best similarity")
    assert "static set" in route.describe()


def test_zero_and_bad_queries(clusters):
    router = clusters[-1]
    assert router.route(np.zeros(DIM)).unknown
    with pytest.raises(ValueError, match="32"):
        router.route(np.ones(DIM + 1))
    with pytest.raises(ValueError):
        router.route(np.full(DIM, np.nan))
    with pytest.raises(ValueError):
        router.route(np.ones(DIM), vote="plurality")
    with pytest.raises(ValueError):
        router.route(np.ones(DIM), k=0)


def test_ties_are_broken_deterministically():
    # two anchors at the same similarity from two domains: the name order decides, every time
    vecs = np.array([[1.0, 1.0], [1.0, -1.0]], dtype=np.float32)
    sets = {"a": SkipSet({0}), "b": SkipSet({1})}
    r = Router(vecs, ["b", "a"], ["", ""], ["prompt", "prompt"], sets, FALLBACK, k=2, threshold=0.0)
    picks = {r.route(np.array([1.0, 0.0]), vote=v).domain for v in ("majority", "weighted") * 3}
    assert picks == {"a"}


def test_to_arrays_round_trip_gives_identical_routes(clusters, tmp_path):
    *_, held, router = clusters
    arrays, meta = router.to_arrays()
    np.savez(tmp_path / "router.npz", **arrays)
    (tmp_path / "router.json").write_text(json.dumps(meta))
    with np.load(tmp_path / "router.npz") as data:
        again = Router.from_arrays(dict(data), json.loads((tmp_path / "router.json").read_text()))
    for d in DOMAINS:
        for q in held[d][:3]:
            a, b = router.route(q), again.route(q)
            assert a.to_dict() == b.to_dict()


def test_route_to_dict_is_json_safe(clusters):
    *_, held, router = clusters
    d = router.route(held["sql"][0]).to_dict()
    assert json.loads(json.dumps(d)) == d
    assert isinstance(router.route(held["sql"][0]), Route)


def test_with_settings_shares_the_index(clusters):
    router = clusters[-1]
    other = router.with_settings(k=3, vote="majority", threshold=0.9)
    assert other.index is router.index and other.vectors is router.vectors
    assert (other.k, other.vote, other.threshold) == (3, "majority", 0.9)
    assert (router.k, router.vote, router.threshold) == (5, "weighted", 0.5)
    with pytest.raises(ValueError):
        router.with_settings(threshold=2.0)


def test_small_domains_get_fewer_centroids():
    rng = np.random.default_rng(1)
    emb = {"math": rng.normal(size=(2, 8)), "qa": rng.normal(size=(5, 8))}
    texts = {"math": ["a", "b"], "qa": list("cdefg")}
    r = Router.build(emb, texts, {"math": SkipSet(), "qa": SkipSet()}, FALLBACK, centroids_per_domain=4)
    per = {d: sum(1 for dd, k in zip(r.domains, r.kinds) if dd == d and k == "centroid")
           for d in emb}
    assert per == {"math": 0, "qa": 1}
    assert len(r) == 2 + 5 + 1


def test_build_rejects_mismatched_inputs():
    emb = {"math": np.ones((3, 4))}
    with pytest.raises(ValueError, match="texts"):
        Router.build(emb, {"math": ["x"]}, {"math": SkipSet()}, FALLBACK)
    with pytest.raises(ValueError, match="skip set"):
        Router.build(emb, {"math": ["x"] * 3}, {}, FALLBACK)


def test_suggest_threshold_keeps_held_out_prompts_known(clusters):
    centres, _, held, router = clusters
    t = suggest_threshold(router, held)
    assert -1.0 <= t < 1.0
    known = [not router.route(q, threshold=t).unknown for qs in held.values() for q in qs]
    assert np.mean(known) >= 0.98
    # and it still leaves room to reject a prompt orthogonal to every domain
    assert t > 0.5


# --- the strategy in the decode loop ------------------------------------------------------------
def _tiny_router(tiny, threshold):
    rng = np.random.default_rng(3)
    emb = {d: rng.normal(size=(6, tiny.hidden)).astype(np.float32) for d in DOMAINS}
    texts = {d: [f"{d} {i}" for i in range(6)] for d in DOMAINS}
    return Router.build(emb, texts, _sets(tiny.n_layers), FALLBACK, centroids_per_domain=2,
                        threshold=threshold)


@pytest.mark.parametrize("threshold", [-1.0, 1.0])   # always routed / always unknown
def test_knn_strategy_is_lossless(tiny, threshold):
    router = _tiny_router(tiny, threshold)
    cfg = DecodeConfig(max_new_tokens=40, gamma=4)
    for prompt in ["route me somewhere", "12 + 30 = ?"]:
        strategy = KnnStrategy(router)
        spec = generate(tiny, prompt, strategy, cfg)
        ar = generate(tiny, prompt, Autoregressive(), cfg)
        assert spec.token_ids == ar.token_ids
        route = strategy.route
        assert route.unknown == (threshold == 1.0)
        assert route.skip == (FALLBACK if route.unknown else _sets()[route.domain])
        assert spec.start.route == route and spec.start.skip == route.skip
        assert spec.start.domain == route.domain
        assert spec.stats.drafted > 0
        assert all(s.skip == route.skip for s in spec.steps)


def test_knn_strategy_validates_skip_against_the_model(tiny):
    router = _tiny_router(tiny, -1.0)
    bad = {d: SkipSet({tiny.n_layers + 3}) for d in DOMAINS}
    strategy = KnnStrategy(Router(router.vectors, router.domains, router.texts, router.kinds,
                                  bad, FALLBACK, threshold=-1.0))
    with pytest.raises(ValueError, match="out of range"):
        generate(tiny, "abc", strategy, max_new_tokens=5)


def test_knn_strategy_overrides_router_settings(tiny):
    router = _tiny_router(tiny, -1.0)
    strategy = KnnStrategy(router, k=2, vote="majority", threshold=1.0)
    generate(tiny, "abc", strategy, max_new_tokens=3)
    assert strategy.route.unknown and len(strategy.route.neighbours) == 2


def test_a_centred_router_stores_its_center_and_round_trips(clusters, tmp_path):
    _, train, held, _ = clusters
    shift = np.ones(DIM, dtype=np.float32) * 3.0            # a direction every prompt shares
    moved = {d: v + shift for d, v in train.items()}
    texts = {d: [f"{d} prompt {i}" for i in range(len(p))] for d, p in moved.items()}
    r = Router.build(moved, texts, _sets(), FALLBACK, seed=0, centre=True)
    units = np.concatenate([v / np.linalg.norm(v, axis=1, keepdims=True) for v in moved.values()])
    assert np.allclose(r.center, units.mean(0), atol=1e-6)
    first = moved["qa"][0]
    q = (first / np.linalg.norm(first) - r.center)
    assert np.allclose(r.query(first)[0], q / np.linalg.norm(q), atol=1e-5)
    assert r.route(first).neighbours[0].similarity == pytest.approx(1.0, abs=1e-5)
    held_moved = {d: v + shift for d, v in held.items()}
    plain = Router.build(moved, texts, _sets(), FALLBACK, seed=0)
    assert r.accuracy(held_moved)["overall"] >= plain.accuracy(held_moved)["overall"]
    arrays, meta = r.to_arrays()
    assert meta["centred"] and "center" in arrays
    np.savez(tmp_path / "router.npz", **arrays)
    with np.load(tmp_path / "router.npz") as data:
        again = Router.from_arrays(dict(data), json.loads(json.dumps(meta)))
    for d in DOMAINS:
        for v in held_moved[d][:3]:
            assert again.route(v).to_dict() == r.route(v).to_dict()


def test_a_router_saved_before_centring_loads_uncentred(clusters):
    *_, held, router = clusters
    arrays, meta = router.to_arrays()
    meta.pop("centred")                                     # what an older router.npz / json holds
    again = Router.from_arrays(arrays, meta)
    assert again.center is None
    assert again.route(held["qa"][0]).to_dict() == router.route(held["qa"][0]).to_dict()
