"""DomainMap: UMAP of anchors, placing new prompts, and a checksum-guarded load."""
import os
import pickle
import time

import numpy as np
import pytest

from ssd_core.calibration.umap_map import MODEL_FILE, DomainMap, DomainMapError

N_CLUSTERS, PER_CLUSTER, DIM = 5, 30, 16


def _centres():
    # orthogonal directions: clusters that cosine UMAP cannot confuse
    return np.eye(DIM)[:N_CLUSTERS] * 3.0


def _points(rng, n):
    return [c + 0.1 * rng.normal(size=(n, DIM)) for c in _centres()]


@pytest.fixture(scope="module")
def fitted():
    rng = np.random.default_rng(0)
    vectors = np.concatenate(_points(rng, PER_CLUSTER)).astype(np.float32)
    t0 = time.perf_counter()
    dm = DomainMap.fit(vectors, seed=0)
    fit_s = time.perf_counter() - t0
    return dm, vectors, dm.warm(), fit_s


def _cluster_centroids(coords):
    return coords.reshape(N_CLUSTERS, PER_CLUSTER, 2).mean(1)


@pytest.mark.slow          # the UMAP fit: umap's first import compiles numba code
def test_fit_gives_one_point_per_vector(fitted):
    dm, vectors, *_ = fitted
    assert dm.coords.shape == (len(vectors), 2)
    assert np.all(np.isfinite(dm.coords))


@pytest.mark.slow          # the UMAP fit: umap's first import compiles numba code
def test_transform_lands_near_its_cluster(fitted):
    dm, *_ = fitted
    centroids = _cluster_centroids(dm.coords)
    rng = np.random.default_rng(1)
    for c, pts in enumerate(_points(rng, 2)):
        for p in pts:
            xy = np.array(dm.transform(p))
            assert int(np.argmin(np.linalg.norm(centroids - xy, axis=1))) == c


@pytest.mark.slow          # the UMAP fit: umap's first import compiles numba code
def test_transform_is_fast_after_warm(fitted):
    dm, vectors, warm_s, _ = fitted
    q = vectors[7] + 0.01
    t0 = time.perf_counter()
    dm.transform(q)
    assert time.perf_counter() - t0 < 0.2


@pytest.mark.slow          # the UMAP fit: umap's first import compiles numba code
def test_transform_rejects_wrong_width(fitted):
    with pytest.raises(DomainMapError, match="fitted on"):
        fitted[0].transform(np.ones(DIM + 2))


@pytest.mark.slow          # the UMAP fit: umap's first import compiles numba code
def test_save_load_round_trip(fitted, tmp_path):
    dm, vectors, *_ = fitted
    info = dm.save(tmp_path)
    assert info["coords_file"] == "domain_map.npz" and info["model_file"] == MODEL_FILE
    again = DomainMap.load(tmp_path, info["umap_sha256"])
    np.testing.assert_array_equal(again.coords, dm.coords)
    np.testing.assert_allclose(again.transform(vectors[3]), dm.transform(vectors[3]), atol=1e-4)


@pytest.mark.slow          # the UMAP fit: umap's first import compiles numba code
def test_tampered_file_is_refused_before_unpickling(fitted, tmp_path, monkeypatch):
    dm, *_ = fitted
    info = dm.save(tmp_path)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):                 # unpickling this would create the marker folder
            return os.mkdir, (str(marker),)

    (tmp_path / MODEL_FILE).write_bytes(pickle.dumps(Evil()))
    import joblib
    monkeypatch.setattr(joblib, "load", lambda *a, **k: pytest.fail("unpickled an unverified file"))
    with pytest.raises(DomainMapError, match="SHA-256"):
        DomainMap.load(tmp_path, info["umap_sha256"])
    assert not marker.exists()


@pytest.mark.slow          # the UMAP fit: umap's first import compiles numba code
def test_load_needs_a_checksum_and_the_file(fitted, tmp_path):
    with pytest.raises(DomainMapError, match="no fitted UMAP"):
        DomainMap.load(tmp_path, "0" * 64)
    info = fitted[0].save(tmp_path)
    with pytest.raises(DomainMapError, match="checksum"):
        DomainMap.load(tmp_path, "")
    assert isinstance(DomainMapError("x"), ValueError)
    assert DomainMap.load_coords(tmp_path).coords.shape == fitted[0].coords.shape
    assert info["umap_sha256"]


def test_coords_only_map_cannot_place_points(tmp_path):
    dm = DomainMap.coords_only(np.zeros((3, 2)))
    assert not dm.can_transform
    with pytest.raises(DomainMapError, match="coordinates only"):
        dm.transform(np.ones(4))
    assert dm.save(tmp_path)["umap_sha256"] is None
    with pytest.raises(DomainMapError):
        DomainMap.coords_only(np.zeros((3, 3)))


@pytest.mark.slow          # the UMAP fit: umap's first import compiles numba code
def test_load_without_umap_is_a_domain_map_error(fitted, tmp_path, monkeypatch):
    info = fitted[0].save(tmp_path)
    monkeypatch.setitem(__import__("sys").modules, "umap", None)   # makes `import umap` fail
    with pytest.raises(DomainMapError, match="umap-learn"):
        DomainMap.load(tmp_path, info["umap_sha256"])


def test_domain_check_table_names_failing_domains_loudly():
    from viz.layers import domain_check_md
    check = {"math": {"own": 0.8, "static": 0.7, "other": 0.4, "gain": 0.1, "passed": True},
             "qa": {"own": 0.6, "static": 0.6, "other": 0.5, "gain": 0.0, "passed": False}}
    md = domain_check_md(check, 0.02, "matchness")
    assert "1 of 2 domain searches did not beat the static set" in md and "qa" in md.split("\n")[0]
    assert "| qa | 0.60 | 0.60 | +0.00 | 0.50 | **no → static** |" in md
    assert "| math | 0.80 | 0.70 | +0.10 | 0.40 | yes |" in md
    assert md.startswith("**⚠")
    ok = domain_check_md({"math": check["math"]}, 0.02)
    assert ok.startswith("**Every domain set beats the static set")
    assert "predates" in domain_check_md(None, None)
    assert "prompt lookup" not in md
    assert "prompt lookup would not draft" in domain_check_md(check, 0.02, "matchness", lookup_aware=True)


# --- the figure: zoom, cluster labels, the K nearest ringed and listed (viz.domain_map, pure) ---------
from viz import domain_map as vmap  # noqa: E402
from viz import theme  # noqa: E402

MAP_DOMAINS = ("math", "sql", "story")


def _map_data(k=3):
    """Three well-separated clusters of 12 anchors (the first of each a centroid) and a prompt inside
    the math cluster whose K nearest anchors are math prompts."""
    rng = np.random.default_rng(3)
    centres = {"math": (0.0, 0.0), "sql": (10.0, 0.0), "story": (5.0, 8.0)}
    coords, domains, texts, kinds = [], [], [], []
    for d in MAP_DOMAINS:
        for i in range(12):
            coords.append(np.array(centres[d]) + rng.normal(scale=0.6, size=2))
            domains.append(d)
            kinds.append("centroid" if i == 0 else "prompt")
            texts.append("" if i == 0 else f"{d} prompt {i}: <b>{{x}}</b>")
    coords = np.array(coords)
    prompt = np.array([0.2, 0.1])
    order = np.argsort(np.linalg.norm(coords - prompt, axis=1))[:k]
    route = {"domain": "math", "similarity": 0.93, "threshold": 0.5, "unknown": False, "vote": "weighted",
             "votes": {"math": 2.7},
             "neighbours": [{"index": int(i), "domain": domains[i], "similarity": 0.93 - 0.01 * r,
                             "text": texts[i], "kind": kinds[i]} for r, i in enumerate(order)]}
    return vmap.anchor_traces(coords, domains, texts, kinds), coords, tuple(prompt), route


def _inside(fig, x, y):
    (x0, x1), (y0, y1) = fig.layout.xaxis.range, fig.layout.yaxis.range
    return x0 <= x <= x1 and y0 <= y <= y1


def _width(fig):
    (x0, x1), (y0, y1) = fig.layout.xaxis.range, fig.layout.yaxis.range
    return x1 - x0, y1 - y0


def test_after_a_run_the_map_zooms_to_the_prompt_and_its_neighbours():
    anchors, coords, prompt, route = _map_data(k=5)
    zoomed = vmap.domain_map(anchors, coords, prompt, route, "a prompt")
    whole = vmap.domain_map(anchors, coords, prompt, route, "a prompt", whole=True)
    assert _inside(zoomed, *prompt)
    for n in route["neighbours"]:
        assert _inside(zoomed, *coords[n["index"]])
    assert all(_inside(whole, x, y) for x, y in coords)              # the toggle: every anchor again
    assert not all(_inside(zoomed, x, y) for x, y in coords)         # zoomed: the other clusters are out
    (zw, zh), (ww, wh) = _width(zoomed), _width(whole)
    assert zw < 0.5 * ww and zh < 0.5 * wh
    before = vmap.domain_map(anchors, coords)                        # no run yet: the whole map
    assert all(_inside(before, x, y) for x, y in coords)


def test_zoom_has_a_margin_and_a_floor_and_never_exceeds_the_whole_map():
    full = ((0.0, 100.0), (0.0, 50.0))
    (x0, x1), (y0, y1) = vmap.neighbourhood((10.0, 10.0), [(20.0, 10.0)], full)
    assert x0 < 10 and x1 > 20                                       # room around the points
    assert y1 - y0 >= 0.06 * 50 - 1e-9                               # same y: not a zero-height view
    assert vmap.neighbourhood((0.0, 0.0), [(100.0, 50.0)], full) == full


def test_every_domain_is_labelled_on_its_cluster_in_its_colour():
    anchors, coords, prompt, route = _map_data()
    whole = vmap.domain_map(anchors, coords, prompt, route, whole=True)
    labels = {a.text.replace("<b>", "").replace("</b>", ""): a for a in whole.layout.annotations}
    assert set(labels) == set(MAP_DOMAINS)
    for d, a in labels.items():
        assert a.bgcolor == theme.domain_color(d) and a.xref == "x" and a.yref == "y"
        members = coords[[i for i, dom in enumerate(sum(([d] * 12 for d in MAP_DOMAINS), [])) if dom == d]]
        assert np.min(np.linalg.norm(members - (a.x, a.y), axis=1)) < 1e-9     # on one of its own anchors
        assert theme.contrast_ratio(a.font.color, a.bgcolor) >= 4.0
    zoomed = vmap.domain_map(anchors, coords, prompt, route)
    assert [a.text for a in zoomed.layout.annotations] == ["<b>math</b>"]   # only what the zoom shows
    assert not vmap.domain_map(anchors, coords).layout.showlegend          # labels instead of a legend


def test_the_k_nearest_are_ringed_numbered_and_joined_to_the_prompt():
    anchors, coords, prompt, route = _map_data(k=4)
    fig = vmap.domain_map(anchors, coords, prompt, route)
    lines = [t for t in fig.data if t.mode == "lines"]
    assert len(lines) == 4 and all(t.line.width >= 2.5 for t in lines)
    for t, n in zip(lines, route["neighbours"]):
        assert (t.x[0], t.y[0]) == prompt and (t.x[1], t.y[1]) == tuple(coords[n["index"]])
        assert t.line.color == theme.domain_color(n["domain"])
    ring = next(t for t in fig.data if t.mode == "markers+text")
    assert list(ring.text) == ["1", "2", "3", "4"] and ring.marker.size >= 20
    assert "similarity 0.930" in ring.hovertext[0]


def test_the_route_lists_the_k_nearest_with_text_domain_and_similarity():
    _, _, _, route = _map_data(k=5)
    html = vmap.route_html(route)
    items = html.split("<li")[1:]
    assert len(items) == 5 and "<details class=\"route-why\" open>" in html
    for rank, (item, n) in enumerate(zip(items, route["neighbours"]), 1):
        assert f'<span class="why-rank">{rank}</span>' in item
        assert f"{n['similarity']:.2f}" in item and f"<b>{n['domain']}</b>" in item
        shown = n["text"] or f"(centroid of {n['domain']} prompts)"
        assert vmap.escape(shown) in item                             # the text, escaped
    assert "<b>{x}</b>" not in html and "&lt;b&gt;" in html
    assert "votes:" not in html                                       # unanimous: "5/5 votes" says it
    split = dict(route, votes={"math": 1.8, "sql": 0.9})
    assert "similarity-weighted votes: math 1.80 · sql 0.90" in vmap.route_html(split)
