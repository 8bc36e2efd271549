"""The embedded SmolLM2-135M: loads offline, generates, speculation is lossless."""
import pytest

from ssd_core.engine.decode import DecodeConfig
from ssd_core.engine.generate import generate
from ssd_core.policies.ar import Autoregressive
from ssd_core.policies.registry import build as build_strategy
from ssd_core.policies.static import Static
from ssd_core.tools.microbench import example_skip

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


# --- transformers as an independent reference (issue 9, item 3) --------------------------------------
HF_NEW_TOKENS = 64


@pytest.fixture(scope="module")
def held_out_prompts(real_model):
    """One held-out prompt per domain (the last of each domain's held-out split), chat-templated."""
    from ssd_core.calibration.domains import load_prompts, split
    return {d: real_model.encode(split(ps)[1][-1]) for d, ps in load_prompts().items()}


@pytest.fixture(scope="module")
def hf_references(real_model, held_out_prompts):
    """transformers' greedy generate on each held-out prompt, shared by every strategy below."""
    from hf_reference import hf_greedy, processors_are_plain
    assert processors_are_plain(real_model)
    return {d: hf_greedy(real_model, ids, HF_NEW_TOKENS) for d, ids in held_out_prompts.items()}


@pytest.fixture(scope="module")
def committed_calibration(real_model):
    from ssd_core import calibration as cal_io
    return cal_io.load(cal_io.default_folder(None), real_model)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ar", "static", "knn", "oracle", "knapspec", "auto"])
def test_greedy_output_equals_transformers_generate(real_model, held_out_prompts, hf_references,
                                                    committed_calibration, name):
    """7 held-out prompts (one per domain) × 64 new tokens: token for token what generate gives."""
    from ssd_core.tools.reference import cut_at_eos
    cal = committed_calibration
    gamma = int(cal.meta.get("settings", {}).get("gamma", 4))
    cfg = DecodeConfig(max_new_tokens=HF_NEW_TOKENS, gamma=gamma)
    diffs = []
    drafted = 0
    for domain, ids in held_out_prompts.items():
        strat = build_strategy(cal, name, gamma=gamma, domain=domain if name == "oracle" else None)
        g = generate(real_model, ids, strat, cfg)
        ref = hf_references[domain]
        drafted += g.stats.drafted
        assert cut_at_eos(g.token_ids, real_model.eos_ids) == g.token_ids   # the core stops at EOS
        if g.token_ids != ref:
            at = next((i for i, (a, b) in enumerate(zip(g.token_ids, ref)) if a != b),
                      min(len(g.token_ids), len(ref)))
            diffs.append(f"{domain}: first difference at token {at} "
                         f"(ours {g.token_ids[at:at + 3]}, generate {ref[at:at + 3]}; "
                         f"lengths {len(g.token_ids)} / {len(ref)})")
    assert not diffs, f"{name} differs from transformers' generate:\n" + "\n".join(diffs)
    if name in ("static", "knn", "oracle", "knapspec"):
        assert drafted > 0, f"{name} never speculated: the comparison would say nothing about drafts"


def test_forward_logits_match_transformers(real_model, held_out_prompts):
    """Prefill, single-token steps (T = 1, no mask) and a cropped multi-token verify vs transformers."""
    from hf_reference import RTOL, compare_forward
    worst = compare_forward(real_model, held_out_prompts["math"], steps=8, verify_len=5,
                            draft_skip=example_skip(real_model.n_layers), full_every=4)
    assert worst <= RTOL
