"""The embedded SmolLM2-135M: loads offline, generates, speculation is lossless."""
import pytest

from ssd_core.bench_core import example_skip
from ssd_core.decode import DecodeConfig
from ssd_core.generate import generate
from ssd_core.strategies import Autoregressive, Static

pytestmark = pytest.mark.real


def test_default_model_loads_offline(real_model):
    assert real_model.n_layers == 30
    assert real_model.hidden == 576
    assert real_model.vocab == 49152


def test_default_model_speculation_is_lossless(real_model):
    cfg = DecodeConfig(max_new_tokens=48, gamma=4)
    prompt = "Give three tips for learning a new language."
    ar = generate(real_model, prompt, Autoregressive(), cfg)
    spec = generate(real_model, prompt, Static(example_skip(real_model.n_layers)), cfg)
    assert len(ar.text.split()) > 5
    assert spec.token_ids == ar.token_ids
    assert spec.stats.accepted > 0
