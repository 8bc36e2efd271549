import os
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tiny import tiny_backbone  # noqa: E402


@pytest.fixture(scope="session")
def tiny():
    return tiny_backbone()


@pytest.fixture(scope="session")
def real_model():
    """The embedded default model (marked tests only)."""
    from ssd_core.backbone import load_backbone
    return load_backbone(threads=2)
