"""Calibration: everything measured offline for a model, and the artefacts that hold it.

The latency model (latency), teacher-forced matchness (matchness), the skip-set search (candidates,
search, search_memo), the KNN router (router), the domains and their UMAP (domains, umap_map), the
cheap drafts' calibration (draft_calibration), the artefact format (artifact, files) and the CLI that builds
it all (build: `python -m ssd_core.calibrate`).

The artefact API is available here (`cal_io.load(...)` after `from ssd_core import calibration as
cal_io`), imported on first use: importing one submodule does not import the others (the views need
only the latency model, and `python -m ssd_core.calibration.domains` must not import itself twice).
"""
__all__ = ["CALIBRATION_ROOT", "CHECKSUMMED", "FORMAT_VERSION", "TMP_MARK", "Calibration", "CalibrationError",
           "StagedWrites", "atomic_write", "default_folder", "head_ids", "install_on", "load", "model_slug_of",
           "remove_stale_temporaries", "save", "shares_backbone", "staged_writes"]


def __getattr__(name: str):
    if name in __all__:
        from . import artifact
        return getattr(artifact, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
