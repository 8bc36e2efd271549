"""The Space's load test as a marked test (`pytest -m load`): the real app with SPACE_ID set, on loopback,
through its own events (tests/loadtest.py). Shorter windows than the committed run; the same checks."""
import os

import pytest

import loadtest


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.load
def test_a_space_under_mixed_load_keeps_serving_its_generating_visitors():
    report = loadtest.run(duration=float(os.environ.get("SSD_LOAD_S", 60)),
                          baseline=float(os.environ.get("SSD_LOAD_BASELINE_S", 30)), log=lambda *a: None)
    assert report["baseline"]["requests"] >= 4 and report["mixed"]["requests"] >= 4, report
    failed = [name for name, ok in report["checks"].items() if not ok]
    assert not failed, (failed, report)
