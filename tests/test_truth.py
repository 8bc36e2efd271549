"""The numbers a visitor reads agree with what happens (tests/truth.py): a fresh Space and a restart, the
cost panel's prediction against measured races, and races of the same draft against each other. Minutes of
timing on a quiet machine: `make test-load` (-m load), not `make test`."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.mark.load
@pytest.mark.real
def test_the_cost_panel_and_the_races_tell_the_truth_on_a_fresh_space_and_after_a_restart(tmp_path):
    import truth
    assert truth.main(["--out", str(tmp_path / "truth.json")]) == 0, (tmp_path / "truth.json").read_text()
