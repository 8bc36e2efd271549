"""DomainMap: UMAP of anchors, placing new prompts, and a checksum-guarded load."""
import os
import pickle
import time

import numpy as np
import pytest

from ssd_core.calibration.domain_map import MODEL_FILE, DomainMap, DomainMapError

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


def test_fit_gives_one_point_per_vector(fitted):
    dm, vectors, *_ = fitted
    assert dm.coords.shape == (len(vectors), 2)
    assert np.all(np.isfinite(dm.coords))


def test_transform_lands_near_its_cluster(fitted):
    dm, *_ = fitted
    centroids = _cluster_centroids(dm.coords)
    rng = np.random.default_rng(1)
    for c, pts in enumerate(_points(rng, 2)):
        for p in pts:
            xy = np.array(dm.transform(p))
            assert int(np.argmin(np.linalg.norm(centroids - xy, axis=1))) == c


def test_transform_is_fast_after_warm(fitted):
    dm, vectors, warm_s, _ = fitted
    q = vectors[7] + 0.01
    t0 = time.perf_counter()
    dm.transform(q)
    assert time.perf_counter() - t0 < 0.2


def test_transform_rejects_wrong_width(fitted):
    with pytest.raises(DomainMapError, match="fitted on"):
        fitted[0].transform(np.ones(DIM + 2))


def test_save_load_round_trip(fitted, tmp_path):
    dm, vectors, *_ = fitted
    info = dm.save(tmp_path)
    assert info["coords_file"] == "domain_map.npz" and info["model_file"] == MODEL_FILE
    again = DomainMap.load(tmp_path, info["umap_sha256"])
    np.testing.assert_array_equal(again.coords, dm.coords)
    np.testing.assert_allclose(again.transform(vectors[3]), dm.transform(vectors[3]), atol=1e-4)


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
