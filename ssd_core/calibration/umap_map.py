"""DomainMap: a 2-D UMAP of the router's anchors, able to place a new prompt on it.

umap is imported inside functions: its first import compiles numba code (≈ 17 s cold), which
nothing that only routes or decodes should pay for. A fitted UMAP can only be saved by
pickling (joblib), and unpickling runs code, so `load` checks the file's SHA-256 against the
checksum recorded at calibration *before* unpickling it.
"""
from __future__ import annotations

import hmac
import threading
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from .files import sha256_file, staged_writes

COORDS_FILE = "domain_map.npz"
MODEL_FILE = "umap.joblib"
MIN_POINTS = 4          # UMAP's spectral start-up needs a handful of points


class DomainMapError(ValueError):
    """The map cannot be loaded or cannot place new points."""


def _import_umap():
    try:
        import umap
    except Exception as e:     # numba / llvmlite failures surface as many error types
        raise DomainMapError(f"umap-learn is not usable here ({e}); the map cannot place new "
                             "prompts. Install umap-learn or use DomainMap.coords_only.") from e
    return umap


def _fitted_rows(model) -> np.ndarray:
    # UMAP keeps its training data (transform needs it); it is the one record of the fitted width
    return model._raw_data


# numba's workqueue threading layer (viz.studio sets it) aborts the whole process when two threads enter it
# at once ("Concurrent access has been detected"): the app places prompts from several lanes (a Generate
# beside replays), so every transform goes through this one lock. Placing a point takes ~1 ms.
_NUMBA = threading.Lock()


@contextmanager
def _single_threaded():
    """Run numba code on this thread only, restoring its setting afterwards.

    Placing one point is microseconds of work; numba's parallel fork/join costs ≈ 85 ms on a
    busy 2-core machine (measured: 87 ms with 2 threads vs 1.4 ms with 1). numba's thread
    count is per calling thread, so this does not change other threads' setting.
    """
    import numba      # lazy: umap's dependency, imported only where umap is (module docstring)
    before = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        yield
    finally:
        numba.set_num_threads(before)


def _as_row(embedding) -> np.ndarray:
    if hasattr(embedding, "detach"):
        embedding = embedding.detach().float().cpu().numpy()
    return np.asarray(embedding, dtype=np.float32).reshape(1, -1)


class DomainMap:
    """Anchor coordinates (same row order as the fitted vectors) and, if fitted, the UMAP."""

    def __init__(self, coords: np.ndarray, model=None):
        coords = np.asarray(coords, dtype=np.float32)
        if coords.ndim != 2 or coords.shape[1] != 2:
            raise DomainMapError(f"map coordinates must be an (N, 2) array, got {coords.shape}")
        self.coords = coords
        self.model = model

    @classmethod
    def fit(cls, vectors: np.ndarray, seed: int = 0, n_neighbors: int = 15,
            min_dist: float = 0.1) -> "DomainMap":
        vectors = np.asarray(vectors, dtype=np.float32)
        if vectors.ndim != 2 or len(vectors) < MIN_POINTS:
            raise DomainMapError(f"a map needs an (N, D) array with N ≥ {MIN_POINTS}, "
                                 f"got {vectors.shape}")
        umap = _import_umap()
        # n_neighbors must stay below the number of points or UMAP refuses small anchor sets
        model = umap.UMAP(n_components=2, metric="cosine", random_state=seed,
                          n_neighbors=max(2, min(n_neighbors, len(vectors) - 1)), min_dist=min_dist)
        with warnings.catch_warnings():
            # a fixed seed makes UMAP single-threaded and it says so; that is what we want
            warnings.filterwarnings("ignore", message=".*n_jobs.*")
            coords = model.fit_transform(vectors)
        return cls(coords, model)

    @classmethod
    def coords_only(cls, coords: np.ndarray) -> "DomainMap":
        """A map that shows the anchors but cannot place new prompts."""
        return cls(coords, None)

    @property
    def can_transform(self) -> bool:
        return self.model is not None

    def transform(self, embedding) -> tuple[float, float]:
        """Where UMAP places one new vector on the map."""
        if self.model is None:
            raise DomainMapError("this map has coordinates only; it cannot place new prompts")
        row = _as_row(embedding)
        expected = _fitted_rows(self.model).shape[1]
        if row.shape[1] != expected:
            raise DomainMapError(f"embedding has {row.shape[1]} values, the map was fitted on "
                                 f"{expected}")
        with _NUMBA, _single_threaded():
            x, y = self.model.transform(row)[0]
        return float(x), float(y)

    def warm(self) -> float:
        """Run one transform so numba compiles it now, not on a visitor's first prompt."""
        t0 = time.perf_counter()
        if self.model is not None:
            self.transform(_fitted_rows(self.model)[0])
        return time.perf_counter() - t0

    def save(self, folder, stage=None) -> dict:
        """Write the coordinates (npz) and the fitted UMAP (joblib); return names and checksum.

        Both files are written atomically (temporary + os.replace). With `stage` (a
        files.StagedWrites) they are only staged, and go into place when it commits.
        """
        if stage is None:
            with staged_writes(folder) as own:
                return self.save(folder, stage=own)
        with stage.open(COORDS_FILE) as f:
            np.savez(f, coords=self.coords)
        if self.model is None:
            return {"umap_sha256": None, "coords_file": COORDS_FILE, "model_file": None}
        import joblib     # lazy: only saving / loading the fitted UMAP needs it
        with stage.open(MODEL_FILE) as f:
            joblib.dump(self.model, f)
        return {"umap_sha256": sha256_file(stage.path(MODEL_FILE)), "coords_file": COORDS_FILE,
                "model_file": MODEL_FILE}

    @staticmethod
    def load_coords(folder) -> "DomainMap":
        """Only the saved coordinates (no unpickling): for when umap or its file is unusable."""
        path = Path(folder) / COORDS_FILE
        if not path.is_file():
            raise DomainMapError(f"no map coordinates at {path}")
        with np.load(path, allow_pickle=False) as data:
            return DomainMap.coords_only(data["coords"])

    @classmethod
    def load(cls, folder, expected_sha256: str) -> "DomainMap":
        """Load a saved map; the UMAP file is unpickled only if its SHA-256 matches."""
        folder = Path(folder)
        path = folder / MODEL_FILE
        if not expected_sha256:
            raise DomainMapError(f"no checksum given for {path}; refusing to unpickle it")
        if not path.is_file():
            raise DomainMapError(f"no fitted UMAP at {path}; re-run calibration")
        actual = sha256_file(path)
        if not hmac.compare_digest(actual, str(expected_sha256).lower()):
            raise DomainMapError(f"{path} has SHA-256 {actual}, expected {expected_sha256}: the "
                                 "file changed since calibration; refusing to unpickle it")
        coords = cls.load_coords(folder).coords
        umap = _import_umap()
        import joblib     # lazy: only saving / loading the fitted UMAP needs it
        model = joblib.load(path)
        if not isinstance(model, umap.UMAP):
            raise DomainMapError(f"{path} holds a {type(model).__name__}, not a fitted UMAP")
        if _fitted_rows(model).shape[0] != len(coords):
            raise DomainMapError(f"{COORDS_FILE} has {len(coords)} points but the UMAP was fitted "
                                 f"on {_fitted_rows(model).shape[0]}: files from different runs")
        return cls(coords, model)
