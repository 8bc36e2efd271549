"""Calibration artefacts: what `python -m ssd_core.calibrate` writes and the app / bench load.

assets/calibration/<slug>/
    calibration.json   meta (model, layers, domain-file hash, machine, timings), latency model,
                       per-domain skip sets, the static set, matchness matrix, routing report,
                       KnapSpec κ, sha256 of every other file
    router.npz         anchor vectors (centroids + calibration prompts)
    domain_map.npz     UMAP coordinates of the anchors
    umap.joblib        the fitted UMAP (unpickled only after its sha256 matches calibration.json)
    search_history.json  every search trial (informational; written by calibrate)

Every file is written atomically (files.py: `staged_writes`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..engine.backbone import EMBEDDING
from ..engine.loading import model_slug
from ..engine.skipset import SkipSet
from .domains import DOMAIN_DIR, domains_hash
from .files import (TMP_MARK, StagedWrites, atomic_write, remove_stale_temporaries,  # noqa: F401 (the package's API)
                    sha256_file, staged_writes)
from .latency import LatencyModel
from .router import Router
from .umap_map import DomainMap

FORMAT_VERSION = 1
CALIBRATION_ROOT = Path(__file__).resolve().parents[2] / "assets" / "calibration"


class CalibrationError(ValueError):
    """A calibration is missing, corrupt, or made for another model / other domain files."""


@dataclass
class Calibration:
    meta: dict
    latency: LatencyModel
    domain_sets: dict[str, SkipSet]
    static: SkipSet
    router: object                        # calibration.router.Router
    matchness: dict[str, dict[str, float]]   # set name → domain → held-out matchness
    routing: dict = field(default_factory=dict)
    knapspec: dict = field(default_factory=dict)
    folder: Path | None = None
    domain_map: object | None = None       # calibration.umap_map.DomainMap (loaded lazily)
    # the cheap drafts (draft_calibration.py): {"head": {ids, size, coverage…}, "acceptance": {kind: {set: α}}}
    drafts: dict = field(default_factory=dict)
    # MLP channel rankings of sets that keep part of each MLP ({name: (layers, channels) ids}; channels.py)
    channel_ranks: dict | None = None
    # their mean activations, for rankings whose cut drafts add the dropped channels' mean (channels.py)
    channel_means: dict | None = None

    # --- what strategies need ---------------------------------------------------------------------
    def acceptance(self, kind: str = "fp32") -> dict[str, float]:
        """Each set's held-out matchness on its own domain (static: mean over domains).

        kind: the draft weights (draft.py); measured per kind when the calibration has draft numbers.
        """
        measured = self.drafts.get("acceptance", {}).get(kind)
        if measured:
            return dict(measured)
        out = {d: self.matchness.get(d, {}).get(d, 0.5) for d in self.domain_sets}
        m = self.matchness.get("static", {})
        out["static"] = float(np.mean(list(m.values()))) if m else 0.5
        return out

    @property
    def embedding(self) -> str:
        """The prompt embedding the router's anchors were made with (engine.backbone.EMBEDDING for any
        calibration that loads); one that records none was made with the user-token mean."""
        return self.meta.get("embedding", OLD_EMBEDDING)

    def load_domain_map(self):
        """The fitted UMAP, checksum-verified (raises DomainMapError on any mismatch)."""
        if self.domain_map is None:
            self.domain_map = DomainMap.load(self.folder, self.meta["files"]["umap.joblib"])
        return self.domain_map


# --- save / load ---------------------------------------------------------------------------------
OLD_EMBEDDING = "user_mean"     # what a calibration that records no embedding kind was made with (routing/#31)
CHECKSUMMED = ("router.npz", "domain_map.npz", "umap.joblib", "channels.npz", "channel_means.npz")


def save(cal: Calibration, folder: Path | str, domain_map=None, extra_json: dict | None = None) -> Path:
    """Write the artefacts atomically, calibration.json last.

    Every file is staged first; only when all of them are written are they moved into place
    (data files, then calibration.json with their checksums). An error or interrupt while
    staging leaves the folder as it was. extra_json: {file name: JSON-able object} written
    alongside (e.g. search_history.json), not checksummed.
    """
    folder = Path(folder)
    with staged_writes(folder) as stage:
        arrays, router_meta = cal.router.to_arrays()
        with stage.open("router.npz") as f:
            np.savez(f, **arrays)
        if domain_map is not None:
            domain_map.save(folder, stage=stage)
        if cal.channel_ranks:
            with stage.open("channels.npz") as f:
                np.savez_compressed(f, **{k: np.asarray(v.cpu() if hasattr(v, "cpu") else v, dtype=np.int16)
                                          for k, v in cal.channel_ranks.items()})
        if cal.channel_means:
            with stage.open("channel_means.npz") as f:
                np.savez_compressed(f, **{k: np.asarray(v.cpu() if hasattr(v, "cpu") else v, dtype=np.float32)
                                          for k, v in cal.channel_means.items()})
        for name, obj in (extra_json or {}).items():
            with stage.open(name, "w", encoding="utf-8") as f:
                json.dump(obj, f)
        files = {}
        for name in CHECKSUMMED:
            if name in stage:
                files[name] = sha256_file(stage.path(name))
            elif (folder / name).exists():
                files[name] = sha256_file(folder / name)
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
            "drafts": cal.drafts,
        }
        with stage.open("calibration.json", "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, ensure_ascii=False)
    return folder


def load(folder: Path | str, backbone=None, domain_dir: Path | str | None = DOMAIN_DIR,
         install: bool = True, any_embedding: bool = False) -> Calibration:
    """Load and check a calibration; every failure is a CalibrationError that says what to do.

    backbone: the model it must fit. install: also make it the backbone's calibration (`install`);
    False loads one beside the installed one (see `shares_backbone`). any_embedding: load one whose
    router reads a prompt embedding this version does not compute (only to rebuild that router)."""
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
    embedding = meta.get("embedding", OLD_EMBEDDING)
    if embedding != EMBEDDING and not any_embedding:
        raise CalibrationError(f"calibration at {folder} routes on the {embedding!r} prompt embedding, which "
                               f"this version no longer computes (only {EMBEDDING!r}); rebuild its router with "
                               f"python -m ssd_core.calibrate --rebuild-router --out {folder}")
    if domain_dir is not None and meta.get("domains_hash") != domains_hash(domain_dir):
        raise CalibrationError(f"calibration at {folder} was made from other domain prompt files "
                               f"(hash mismatch); rebuild it with python -m ssd_core.calibrate")
    try:
        with np.load(folder / "router.npz", allow_pickle=False) as z:
            router = Router.from_arrays({k: z[k] for k in z.files}, doc["router"])
        ranks = means = None
        if "channels.npz" in meta.get("files", {}):
            with np.load(folder / "channels.npz", allow_pickle=False) as z:
                ranks = {k: z[k].astype(np.int64) for k in z.files}
        if "channel_means.npz" in meta.get("files", {}):
            with np.load(folder / "channel_means.npz", allow_pickle=False) as z:
                means = {k: z[k] for k in z.files}
        cal = Calibration(
            meta=meta, latency=LatencyModel.from_dict(doc["latency"]),
            domain_sets={d: SkipSet.from_dict(s) for d, s in doc["domain_sets"].items()},
            static=SkipSet.from_dict(doc["static"]), router=router, matchness=doc["matchness"],
            routing=doc.get("routing", {}), knapspec=doc.get("knapspec", {}), folder=folder,
            drafts=doc.get("drafts", {}), channel_ranks=ranks, channel_means=means)
        missing = sorted({s.channels for s in [*cal.domain_sets.values(), cal.static]
                          if s.channels and s.channels not in (ranks or {})})
        if missing:
            raise ValueError(f"sets keep MLP channels by rankings {missing} that channels.npz lacks")
        if backbone is not None and install:
            install_on(cal, backbone)
        return cal
    except (KeyError, TypeError, ValueError, OSError) as exc:
        raise CalibrationError(f"calibration at {folder} is incomplete or corrupt: {exc}") from exc


def model_slug_of(cal: Calibration) -> str:
    """The slug of the model a calibration was made for (its default folder's name)."""
    return model_slug(cal.meta.get("model"))


def head_ids(cal: Calibration):
    """The calibration's small draft head (token ids, sorted), or None for the whole vocabulary."""
    ids = cal.drafts.get("head", {}).get("ids")
    return None if ids is None else tuple(sorted({int(i) for i in ids}))


def install_on(cal: Calibration, backbone) -> None:
    """Make `cal` the backbone's calibration: its small draft head and its MLP channel rankings."""
    backbone.drafts.set_head(head_ids(cal))
    backbone.drafts.install_channels(cal.channel_ranks, cal.channel_means)


def shares_backbone(cal: Calibration, backbone) -> str | None:
    """Whether `cal` can serve beside the backbone's installed calibration, drafting from the same
    backbone at once: None when it can (its channel rankings are added to the draft factory), else
    why not (another draft head, or a channel ranking of the same name that differs). Every calibration
    that loads embeds prompts as backbone.EMBEDDING."""
    if head_ids(cal) != backbone.drafts.head_ids:
        return "its small draft head differs from the served calibration's"
    try:
        backbone.drafts.add_channels(cal.channel_ranks, cal.channel_means)
    except ValueError as exc:
        return str(exc)
    return None


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
    return CALIBRATION_ROOT / model_slug(spec)
