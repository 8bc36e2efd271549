"""Any device (CPU-only tests): `--device auto|cpu|cuda`, nothing in the core hard-codes the CPU, the
latency model says where it was profiled and the cost panel says so too.

No test here touches CUDA: "is CUDA available" is monkeypatched where a CUDA answer is needed, and the
core's tensors are checked to be created with an explicit device (the model's), which on a CUDA
machine is what keeps them off the CPU.
"""
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.overrides import TorchFunctionMode

from ssd_core.calibration.latency import LatencyModel, profile
from ssd_core.engine.backbone import Backbone
from ssd_core.engine import rows as decode_module      # the one decode loop: where PromptLookup is made
from ssd_core.engine.decode import DecodeConfig
from ssd_core.engine.device import device_label, resolve_device, same_device
from ssd_core.engine.draft import DraftWeights
from ssd_core.engine.generate import generate
from ssd_core.engine.lookup import PromptLookup
from ssd_core.engine.skipset import SkipSet
from ssd_core.policies.ar import Autoregressive
from ssd_core.policies.knapspec import prompt_similarity
from ssd_core.policies.static import Static
from tiny import tiny_backbone

CORE = str(Path(__file__).resolve().parents[1] / "ssd_core")
# tensor factories: without `device=` they make a CPU tensor whatever device the model is on
# (the *_like factories and one_hot follow their input's device, so they are not listed)
FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.tensor, torch.as_tensor,
             torch.rand, torch.randn, torch.randint, torch.randperm, torch.eye, torch.linspace,
             torch.logspace, torch.empty_strided, torch.scalar_tensor}
ALWAYS_CPU = {torch.from_numpy}          # never on the model's device: the core must move it or not use it
PROMPT = "Summarize: the bridge was closed. The bridge was closed for repairs, said the council."
SKIP = SkipSet(frozenset({1}), frozenset({2, 3}), name="test")


class FactoryAudit(TorchFunctionMode):
    """Records every tensor factory the core (ssd_core/) calls without an explicit device."""

    def __init__(self):
        super().__init__()
        self.missing: list[str] = []
        self.checked = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES or func in ALWAYS_CPU:
            caller = sys._getframe(1)             # the Python frame that called the factory
            if caller.f_code.co_filename.startswith(CORE):
                self.checked += 1
                if func in ALWAYS_CPU or kwargs.get("device") is None:
                    where = f"{Path(caller.f_code.co_filename).name}:{caller.f_lineno}"
                    self.missing.append(f"torch.{func.__name__} at {where}")
        return func(*args, **kwargs)


@pytest.fixture()
def audited_generators(monkeypatch):
    """torch.Generator made without a device is a CPU generator: record such calls from the core."""
    made, real = [], torch.Generator

    def generator(*args, **kwargs):
        caller = sys._getframe(1).f_code.co_filename
        if caller.startswith(CORE) and kwargs.get("device") is None and not args:
            made.append(caller)
        return real(*args, **kwargs)
    monkeypatch.setattr(torch, "Generator", generator)
    return made


class EagerLookup(PromptLookup):
    """Always proposes (the last token again): every step is a lookup draft, whatever the tiny model says."""

    def propose(self, k):
        return super().propose(k) or tuple(self.tokens[-1:]) * max(k, 0)


def test_the_core_creates_every_tensor_on_the_models_device(audited_generators, monkeypatch):
    """Build, draft (int8 kernel, int8 dequantised, fp32; small head), decode greedy and sampling with
    model and prompt-lookup drafts, profile the latency and measure KnapSpec's similarity, all under
    the audit."""
    hf = tiny_backbone()                            # the HF model is built outside: torch's own init
    audit = FactoryAudit()
    sources = set()
    with audit:
        bb = Backbone(hf.hf_model, hf.tokenizer, name="tiny-audit")
        bb.drafts.set_head(range(0, bb.vocab, 2))     # the small draft head (scattered logits)
        for lookup in (PromptLookup, EagerLookup):
            monkeypatch.setattr(decode_module, "PromptLookup", lookup)
            for draft in ("int8", "fp32"):
                for temperature in (0.0, 0.8):
                    cfg = DecodeConfig(max_new_tokens=12, gamma=3, temperature=temperature, draft=draft,
                                       lookup=True, seed=1)
                    g = generate(bb, PROMPT, Static(SKIP), cfg)
                    sources |= {(s.source, temperature > 0) for s in g.steps}
        generate(bb, PROMPT, Autoregressive(), DecodeConfig(max_new_tokens=4))
        bb.drafts.int8_kernel = False                 # the dequantised int8 draft (the path for CUDA)
        bb.drafts.clear()
        generate(bb, PROMPT, Static(SKIP), DecodeConfig(max_new_tokens=8, gamma=3, temperature=0.8))
        profile(bb, contexts=(8, 16), verify_ks=(1, 2), repeats=1, progress=False)
        prompt_similarity(bb, bb.encode(PROMPT).ids)
    assert {("model", False), ("model", True), ("lookup", False), ("lookup", True)} <= sources
    assert audit.checked > 0, "the audit saw no factory call: it is not watching the core"
    assert not audit.missing, "tensors created without the model's device: " + "; ".join(sorted(set(audit.missing)))
    assert not audited_generators, f"torch.Generator without a device in {audited_generators}"


def test_the_dequantised_int8_draft_the_cuda_path_uses_is_lossless_and_labelled(tiny):
    bb = Backbone(tiny.hf_model, tiny.tokenizer, name="tiny-dequant")
    kernel, dequant = DraftWeights(bb, "int8"), DraftWeights(bb, "int8", int8_kernel=False)
    assert kernel.kernel and not dequant.kernel and "no int8 kernel" in dequant.label
    assert "no int8 kernel" not in kernel.label
    ids = bb.encode(PROMPT).ids
    out = {}
    for name, d in (("fp32", None), ("kernel", kernel), ("dequant", dequant)):
        out[name] = bb.forward(ids, bb.new_cache(len(ids)), SkipSet.empty(), logits="all", draft=d)
    # the same int8 weight rounding; the CPU kernel also quantises activations, so it strays further
    err_k = (out["kernel"] - out["fp32"]).abs().mean()
    err_d = (out["dequant"] - out["fp32"]).abs().mean()
    assert 0 < err_d < 0.15 * out["fp32"].abs().mean() and err_d <= err_k
    agree = (out["dequant"].argmax(-1) == out["fp32"].argmax(-1)).float().mean()
    assert agree >= (out["kernel"].argmax(-1) == out["fp32"].argmax(-1)).float().mean() - 0.05
    assert dequant.extra_bytes() > kernel.extra_bytes()           # a full-precision copy, said honestly
    bb.drafts.int8_kernel = False
    bb.drafts.clear()
    cfg = DecodeConfig(max_new_tokens=16, gamma=3, small_head=False)
    ar = generate(bb, PROMPT, Autoregressive(), cfg).token_ids
    spec = generate(bb, PROMPT, Static(SKIP), cfg)
    assert spec.token_ids == ar and spec.start.draft == dequant.label
    assert bb.drafts.get("int8", small_head=False).kernel is False


def test_timings_wait_for_the_device(tiny, monkeypatch):
    calls = []
    bb = Backbone(tiny.hf_model, tiny.tokenizer, name="tiny-sync")
    monkeypatch.setattr(bb, "sync", lambda: calls.append(1))
    profile(bb, contexts=(8, 16), verify_ks=(1, 2), repeats=1, progress=False, drafts=())
    n_profile = len(calls)
    assert n_profile >= 2 * 4 * 2                   # before and after every timed forward
    generate(bb, PROMPT, Static(SKIP), DecodeConfig(max_new_tokens=6, gamma=2, lookup=False))
    assert len(calls) > n_profile                   # each verify pass before its clock is read
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    Backbone.sync(SimpleNamespace(device=torch.device("cpu")))
    assert synced == []                              # nothing to wait for on the CPU
    Backbone.sync(SimpleNamespace(device=torch.device("cuda")))
    assert synced == [torch.device("cuda")]


# --- resolving --device ------------------------------------------------------------------------------
def test_auto_picks_cuda_only_when_it_is_there(monkeypatch):
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu") and resolve_device(None).type in ("cpu", "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cuda") == torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")


def test_cuda_without_cuda_and_unknown_devices_are_refused_clearly(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="CUDA is not available.*--device cpu or --device auto"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="unknown device 'tpu'; choose one of auto, cpu, cuda"):
        resolve_device("tpu")
    from ssd_core.engine.loading import load_backbone
    with pytest.raises(ValueError, match="CUDA is not available"):   # before any model is read
        load_backbone("/nonexistent/model.gguf", device="cuda")


def test_device_labels():
    n = torch.get_num_threads()
    assert device_label("cpu") == f"cpu ({n} thread{'' if n == 1 else 's'})"
    assert same_device("cpu (2 threads)", "cpu (8 threads)") and same_device(None, "cpu (1 thread)")
    assert not same_device("cpu (2 threads)", "cuda: NVIDIA H100")
    assert tiny_backbone().describe()["device"].startswith("cpu (")


# --- the command lines accept --device (argparse only: no model is loaded) --------------------------
class Loaded(Exception):
    """Raised instead of loading a model: carries the device the CLI asked for."""


def _stop_loading(*args, device=None, **kwargs):
    raise Loaded(device)


def _cli(main, argv, capsys):
    with pytest.raises((Loaded, SystemExit)) as exc:
        main(argv)
    return exc.value, capsys.readouterr().err


@pytest.fixture()
def cli_setup(monkeypatch, tmp_path):
    import ssd_core.calibration.build as build
    import ssd_core.engine.loading as loading
    import ssd_core.tools.bench as bench
    import ssd_core.tools.scaling as scaling
    for module in (loading, build, bench, scaling):      # every module that binds load_backbone at import
        monkeypatch.setattr(module, "load_backbone", _stop_loading)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)    # the CLIs set threads; not in tests
    q = tmp_path / "q.jsonl"
    q.write_text('{"question_id": 1, "category": "qa", "turns": ["Why?"]}\n')
    return SimpleNamespace(questions=str(q), out=str(tmp_path / "out"))


def _clis(setup):
    import app
    from ssd_core.calibration.build import main as calibrate_main
    from ssd_core.tools.bench import main as bench_main
    from ssd_core.tools.scaling import main as scaling_main
    return {
        "app": (lambda argv: app.main(argv), []),
        "calibrate": (calibrate_main, ["--out", setup.out]),
        "calibrate --reprofile": (calibrate_main, ["--out", setup.out, "--reprofile"]),
        "bench": (bench_main, ["--questions", setup.questions, "--out", setup.out]),
        "scaling": (scaling_main, ["--out", setup.out]),
    }


def test_every_cli_takes_device_and_defaults_to_auto(cli_setup, capsys, monkeypatch):
    import app
    monkeypatch.setattr(app.startup, "load_studio", lambda *a, device=None, **k: _stop_loading(device=device))
    auto = resolve_device("auto")
    for name, (main, argv) in _clis(cli_setup).items():
        got, _ = _cli(main, argv, capsys)
        assert isinstance(got, Loaded) and got.args[0] == auto, name
        got, _ = _cli(main, argv + ["--device", "cpu"], capsys)
        assert isinstance(got, Loaded) and got.args[0] == torch.device("cpu"), name


def test_every_cli_refuses_cuda_without_cuda_before_loading(cli_setup, capsys, monkeypatch):
    import app
    monkeypatch.setattr(app.startup, "load_studio", lambda *a, device=None, **k: _stop_loading(device=device))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name, (main, argv) in _clis(cli_setup).items():
        for bad, words in (("cuda", "CUDA is not available"), ("tpu", "unknown device")):
            got, err = _cli(main, argv + ["--device", bad], capsys)
            assert isinstance(got, SystemExit) and got.code == 2 and words in err, (name, err)


# --- the latency model and the cost panel say where the costs were measured -------------------------
def _latency(**kw) -> LatencyModel:
    return LatencyModel(n_layers=4, attn_a=1e-3, attn_b=1e-6, mlp=2e-3, head=3e-3, overhead=1e-3,
                        verify={1: 1.0, 2: 1.1, 5: 1.4}, machine={"threads": 2}, **kw)


def test_latency_model_round_trips_its_device_and_old_profiles_are_cpu(tiny):
    lat = _latency(device="cuda: NVIDIA H100 80GB HBM3")
    back = LatencyModel.from_dict(lat.to_dict())
    assert back == lat and back.device_words == "cuda: NVIDIA H100 80GB HBM3"
    old = lat.to_dict()
    del old["device"]                                   # a profile written before devices were recorded
    assert LatencyModel.from_dict(old).device == "cpu"
    assert LatencyModel.from_dict(old).device_words == "cpu (2 threads)"
    measured = profile(tiny, contexts=(8, 16), verify_ks=(1, 2), repeats=1, progress=False, drafts=())
    assert measured.device == device_label(tiny.device)


def test_cost_panel_and_header_name_the_device(tiny):
    from viz import cost as vcost
    from viz.session import cost_view, header_html
    b = _latency().breakdown(SkipSet.empty(), 0.6, 4, 64)
    same = vcost.cost_html(b, strategy="static set", skip_name="static", alpha=0.6, tau=None,
                           profiled_on="cpu (2 threads)", runs_on="cpu (2 threads)")
    assert "profiled on cpu (2 threads)" in same and "come from" not in same
    other = vcost.cost_html(b, strategy="static set", skip_name="static", alpha=0.6, tau=None,
                            profiled_on="cpu (2 threads)", runs_on="cuda: NVIDIA H100")
    assert "this app runs on cuda: NVIDIA H100: the predictions come from cpu (2 threads)" in other
    assert "--reprofile --device cuda" in other
    for lat, words in ((_latency(device="cuda: Fake GPU"), "predictions come from cuda: Fake GPU"),
                       (_latency(), "profiled on cpu (2 threads)")):
        cal = SimpleNamespace(latency=lat, static=SkipSet.empty(), acceptance=lambda kind: {"static": 0.5})
        html, fig = cost_view(SimpleNamespace(calibration=cal, backbone=tiny), None, None)
        assert words in html
        assert ("this GPU" if "cuda" in lat.device else "this CPU") in fig.layout.annotations[0].text
    assert "CPU (" in header_html(SimpleNamespace(backbone=tiny))


def test_the_bench_records_its_device(tiny, tiny_calibration):
    from ssd_core.tools import bench
    from ssd_core.tools.specbench import Question
    from viz import bench_figures
    from viz import benchmark as vbench
    run = bench.run_bench(tiny, tiny_calibration, [Question(1, "qa", "What is the capital of France?")],
                          "ar,static", max_new_tokens=4, hf_generate_every=0, warmup=False, progress=False)
    summary = run.summary
    assert summary["device"] == device_label(tiny.device) and summary["device"].startswith("cpu (")
    assert f"device: **{summary['device']}**" in bench_figures.markdown_report(summary)
    assert f"on {summary['device']}" in vbench.summary_html(summary)
    summary["settings"]["latency_profiled_on"] = "cuda: Fake GPU"     # as `python -m ssd_core.bench` records it
    assert "latency model profiled on: cuda: Fake GPU" in bench_figures.markdown_report(summary)
    del summary["device"]                               # a run from before the device was recorded
    assert "device: **cpu**" in bench_figures.markdown_report(summary)
