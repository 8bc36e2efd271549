"""Temporary shim: the bench's metrics now live in ssd_core.tools.metrics.

Kept only for viz/handlers.py (`from ssd_core.tools.stats import first_difference`), owned by another
change; delete this file once that import reads `ssd_core.tools.metrics`.
"""
from .metrics import first_difference  # noqa: F401
