"""Calibration artefacts: what `python -m ssd_core.calibrate` writes and the app / bench load.

assets/calibration/<slug>/
    calibration.json   meta (model, layers, domain-file hash, machine, timings), latency model,
                       per-domain skip sets, the static set, matchness matrix, routing report,
                       KnapSpec κ, sha256 of every other file
    router.npz         anchor vectors (centroids + calibration prompts)
    domain_map.npz     UMAP coordinates of the anchors
    umap.joblib        the fitted UMAP (unpickled only after its sha256 matches calibration.json)
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .domain_map import _sha256 as sha256_file  # one checksum function for every artefact
from .domains import DOMAIN_DIR, domains_hash
from .latency import Auto, LatencyModel
from .skipset import SkipSet

FORMAT_VERSION = 1
CALIBRATION_ROOT = Path(__file__).resolve().parent.parent / "assets" / "calibration"
STRATEGIES = ("ar", "static", "knn", "oracle", "knapspec", "auto")


class CalibrationError(ValueError):
    """A calibration is missing, corrupt, or made for another model / other domain files."""


@dataclass
class Calibration:
    meta: dict
    latency: LatencyModel
    domain_sets: dict[str, SkipSet]
    static: SkipSet
    router: object                        # ssd_core.router.Router
    matchness: dict[str, dict[str, float]]   # set name → domain → held-out matchness
    routing: dict = field(default_factory=dict)
    knapspec: dict = field(default_factory=dict)
    folder: Path | None = None
    domain_map: object | None = None       # ssd_core.domain_map.DomainMap (loaded lazily)

    # --- what strategies need ---------------------------------------------------------------------
    def acceptance(self) -> dict[str, float]:
        """Each set's held-out matchness on its own domain (static: mean over domains)."""
        out = {d: self.matchness.get(d, {}).get(d, 0.5) for d in self.domain_sets}
        m = self.matchness.get("static", {})
        out["static"] = float(np.mean(list(m.values()))) if m else 0.5
        return out

    def strategy(self, name: str, *, gamma: int = 4, k: int | None = None, vote: str | None = None,
                 threshold: float | None = None, domain: str | None = None, category: str | None = None,
                 inner: str = "knn", every: int = 32):
        """A fresh Strategy object (one per request: strategies hold per-request state)."""
        from .knapspec import KnapSpec
        from .router import KnnStrategy
        from .strategies import Autoregressive, Oracle, Static

        if name == "ar":
            return Autoregressive()
        if name == "static":
            return Static(self.static)
        if name == "knn":
            return KnnStrategy(self.router, k=k, vote=vote, threshold=threshold)
        if name == "oracle":
            oracle = Oracle(self.domain_sets, self.static, domain)
            return oracle.for_category(category) if category is not None else oracle
        if name == "knapspec":
            return KnapSpec(self.latency, gamma, kappa=self.knapspec.get("kappa", 8.0), every=every)
        if name == "auto":
            base = self.strategy(inner, gamma=gamma, k=k, vote=vote, threshold=threshold, domain=domain)
            return Auto(base, self.latency, self.acceptance(), gamma)
        raise ValueError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")

    def load_domain_map(self):
        """The fitted UMAP, checksum-verified (raises DomainMapError on any mismatch)."""
        from .domain_map import DomainMap
        if self.domain_map is None:
            self.domain_map = DomainMap.load(self.folder, self.meta["files"]["umap.joblib"])
        return self.domain_map


# --- save / load ---------------------------------------------------------------------------------
def save(cal: Calibration, folder: Path | str, domain_map=None) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    arrays, router_meta = cal.router.to_arrays()
    np.savez(folder / "router.npz", **arrays)
    if domain_map is not None:
        domain_map.save(folder)
    files = {name: sha256_file(folder / name) for name in ("router.npz", "domain_map.npz", "umap.joblib")
             if (folder / name).exists()}
    doc = {
        "format_version": FORMAT_VERSION,
        "meta": {**cal.meta, "files": files},
        "latency": cal.latency.to_dict(),
        "domain_sets": {d: s.to_dict() for d, s in cal.domain_sets.items()},
        "static": cal.static.to_dict(),
        "matchness": cal.matchness,
        "routing": cal.routing,
        "knapspec": cal.knapspec,
        "router": router_meta,
    }
    tmp = folder / "calibration.json.tmp"
    tmp.write_text(json.dumps(doc, indent=1, ensure_ascii=False), encoding="utf-8")
    tmp.replace(folder / "calibration.json")
    return folder


def load(folder: Path | str, backbone=None, domain_dir: Path | str | None = DOMAIN_DIR) -> Calibration:
    """Load and check a calibration; every failure is a CalibrationError that says what to do."""
    from .router import Router

    folder = Path(folder)
    path = folder / "calibration.json"
    if not path.exists():
        raise CalibrationError(f"no calibration at {folder}. Build one with: "
                               f"python -m ssd_core.calibrate --out {folder}")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        meta = doc["meta"]
    except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as exc:
        raise CalibrationError(f"{path} is corrupt ({exc}); rebuild it with python -m ssd_core.calibrate") from exc
    if doc.get("format_version") != FORMAT_VERSION:
        raise CalibrationError(f"{path} has format {doc.get('format_version')}, expected {FORMAT_VERSION}")
    _check_files(folder, meta.get("files", {}))
    if backbone is not None:
        _check_model(meta, backbone)
    if domain_dir is not None and meta.get("domains_hash") != domains_hash(domain_dir):
        raise CalibrationError(f"calibration at {folder} was made from other domain prompt files "
                               f"(hash mismatch); rebuild it with python -m ssd_core.calibrate")
    try:
        with np.load(folder / "router.npz", allow_pickle=False) as z:
            router = Router.from_arrays({k: z[k] for k in z.files}, doc["router"])
        return Calibration(
            meta=meta, latency=LatencyModel.from_dict(doc["latency"]),
            domain_sets={d: SkipSet.from_dict(s) for d, s in doc["domain_sets"].items()},
            static=SkipSet.from_dict(doc["static"]), router=router, matchness=doc["matchness"],
            routing=doc.get("routing", {}), knapspec=doc.get("knapspec", {}), folder=folder)
    except (KeyError, TypeError, ValueError, OSError) as exc:
        raise CalibrationError(f"calibration at {folder} is incomplete or corrupt: {exc}") from exc


def _check_files(folder: Path, files: dict) -> None:
    if "router.npz" not in files:
        raise CalibrationError(f"{folder}/calibration.json lists no router.npz checksum")
    for name, digest in files.items():
        p = folder / name
        if not p.exists():
            raise CalibrationError(f"calibration file missing: {p}")
        if sha256_file(p) != digest:
            raise CalibrationError(f"checksum mismatch for {p}: the file changed after calibration")


def _check_model(meta: dict, backbone) -> None:
    want = (meta.get("model"), meta.get("n_layers"), meta.get("hidden"))
    have = (backbone.name, backbone.n_layers, backbone.hidden)
    if want != have:
        raise CalibrationError(
            f"calibration was made for {want[0]} ({want[1]} layers, hidden {want[2]}), "
            f"but the loaded model is {have[0]} ({have[1]} layers, hidden {have[2]})")


def default_folder(spec: str | None) -> Path:
    from .backbone import model_slug
    return CALIBRATION_ROOT / model_slug(spec)
