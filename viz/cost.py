"""The cost panel: why the measured speedup is what it is, from the latency model.

speedup = E[tokens per step] / (γ·c + v): c is one draft step and v one verification pass, both
relative to one full autoregressive step, and E = (1 − α^(γ+1)) / (1 − α) for acceptance α.
Every number comes from the core's latency model (calibration.latency): the panel reads a
`LatencyModel.breakdown`, and the what-if chart evaluates `latency.speedup` over its grid.
"""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ssd_core.calibration.latency import acceptance_for_tau as effective_acceptance
from ssd_core.calibration.latency import speedup
from ssd_core.engine.device import same_device

from .theme import ACCEPTED, INK, MUTED, REJECTED, base_layout
from .tokens import escape

GPU_VERIFY = 1.03     # a large model on a GPU: verifying γ+1 tokens costs about one step (memory-bound)


def _row(label: str, value: str, note: str = "") -> str:
    return (f"<tr><th>{escape(label)}</th><td>{escape(value)}</td>"
            f'<td class="note">{escape(note)}</td></tr>')


def run_words(steps) -> str:
    """What a run did, in the terms the prediction uses: steps by who drafted, and drafts per step."""
    steps = list(steps)
    model = sum(s.source == "model" for s in steps)
    lookup = sum(s.source == "lookup" for s in steps)
    plain = sum(not s.speculative for s in steps)
    drafted = [len(s.drafted) for s in steps if s.speculative]
    mean = sum(drafted) / len(drafted) if drafted else 0.0
    return (f"{len(steps)} steps: {model} drafted by the model, {lookup} by prompt lookup (free), {plain} plain; "
            f"{mean:.1f} drafts per step on average")


def device_row(profiled_on: str, runs_on: str | None = None) -> str:
    """Which device the latency model was profiled on; a warning when the app runs on another."""
    if runs_on is None or same_device(profiled_on, runs_on):
        return _row("latency model", f"profiled on {profiled_on}",
                    f"this app runs on {runs_on} too" if runs_on else "")
    return _row("latency model", f"profiled on {profiled_on}",
                f"this app runs on {runs_on}: the predictions come from {profiled_on}, not from this device "
                f"(re-profile: python -m ssd_core.calibrate --reprofile --device {runs_on.split(':')[0].split()[0]})")


def cost_html(b: dict, *, strategy: str, skip_name: str, alpha: float | None, tau: float | None,
              measured_speedup: float | None = None, measured: dict | None = None,
              alpha_source: str = "this run", profiled_on: str = "cpu", runs_on: str | None = None,
              run_prediction: float | None = None, run_steps=(), provisional: bool = False) -> str:
    """b: LatencyModel.breakdown(...) for the set in use at this run's acceptance.

    run_prediction: LatencyModel.predicted_run_speedup of the run's steps — the latency model applied
    to what the run did (its drafts per step, lookup drafts, context): the headline when there is a run.
    measured: the run's own costs from a Race vs AR (engine.race.measured_costs), none from a model.
    profiled_on: the device the latency model was measured on (LatencyModel.device_words);
    runs_on: the device the app runs on (engine.device.device_label), None if unknown.
    provisional: the latency model is not this machine's yet (being measured).
    """
    g, c, v, e = b["gamma"], b["draft_cost"], b["verify_cost"], b["expected_tokens"]
    step, pred, best, be = b["step_cost"], b["predicted_speedup"], b["best_speedup"], b["break_even"]
    m = measured or {}
    headline = run_prediction if run_prediction is not None else pred
    race_note = "; press “Race vs AR” to measure this run's own"
    rows = [
        device_row(profiled_on, runs_on),
        _row("draft cost c", f"{c:.2f} of a full step",
             f"{b['draft_step_ms']:.1f} ms vs {b['full_step_ms']:.1f} ms per full step (latency model, {b['draft_kind']} "
             f"draft, context {b['context_len']})" + (f"; this run measured {m['c']:.2f} (model draft pass ÷ plain "
                                                      f"step, lookup drafts left out)" if m.get("c") else race_note)),
        _row("verify cost v", f"{v:.2f} full steps", f"one pass over {g + 1} tokens"
             + (f"; this run measured {m['v']:.2f} over {m['v_tokens']} tokens" if m.get("v") else "")),
        _row("one step costs", f"γ·c + v = {g}·{c:.2f} + {v:.2f} = {step:.2f}", "full steps of time"),
        _row("expected tokens per step", f"E = {e:.2f}",
             (f"at α = {alpha:.2f} ({alpha_source}), if every draft were accepted independently"
              + (f"; measured τ = {tau:.2f}: accepts come in runs, as if α were "
                 f"{effective_acceptance(tau, g):.2f}" if tau else "")) if alpha is not None else ""),
        _row("textbook prediction", f"E / (γ·c + v) = {pred:.2f}×", "every step drafts γ with the model, i.i.d. acceptance"),
    ]
    if run_prediction is not None:
        rows.append(_row("predicted for this run", f"{run_prediction:.2f}×",
                         "the latency model's time for plain decoding of these tokens ÷ its time for the steps as "
                         f"they ran — {run_words(run_steps)}"))
    rows += [
        _row("measured speedup", f"{measured_speedup:.2f}×" if measured_speedup is not None else "–",
             "Race vs AR: both laps in lockstep on the same prompt, decode phase, same process"
             if measured_speedup is not None else "press “Race vs AR” on the Generate tab to measure it"),
        _row("best case (every draft accepted)", f"{best:.2f}×",
             "break-even needs α ≥ " + f"{be:.2f}" if be is not None else "even α = 1 cannot beat autoregressive"),
    ]
    fixed = b["head_ms"] + b["overhead_ms"]
    on_cpu = profiled_on.startswith("cpu")
    why = (f"On {profiled_on} a full step is {b['full_step_ms']:.1f} ms, of which {fixed:.1f} ms "
           f"(lm_head {b['head_ms']:.1f} ms + per-forward overhead {b['overhead_ms']:.1f} ms) is paid by every "
           f"draft step no matter how many layers it skips; an attention sublayer costs {b['attn_ms']:.2f} ms and "
           f"an MLP {b['mlp_ms']:.2f} ms. Skipping part of a 135M model therefore saves little (c = {c:.2f}), "
           f"and checking {g + 1} tokens at once is not free {'on a CPU' if on_cpu else 'here'} (v = {v:.2f}). "
           "Prompt lookup drafts cost nothing, so a run that copies from its prompt beats the textbook formula. "
           "On a GPU a large model is memory-bound: verifying a few tokens costs about one step (v ≈ 1), "
           "and skipping half the layers nearly halves a draft step — that is where self-speculation wins.")
    verdict_cls = "good" if (measured_speedup or headline) >= 1 else "bad"
    if provisional:
        verdict_cls = "pending"
    tag = " (provisional: this machine's costs are still being measured)" if provisional else ""
    head = (f'<div class="cost-head {verdict_cls}">{escape(strategy)} with the {escape(skip_name)} set: '
            f"predicted {headline:.2f}×{escape(tag)}" + (f", measured {measured_speedup:.2f}×" if measured_speedup
                                                          is not None else "") + "</div>")
    return (f'<div class="cost">{head}<table class="cost-table">{"".join(rows)}</table>'
            f'<p class="cost-why">{escape(why)}</p></div>')


def what_if_figure(gamma: int, c_here: float, v_here: float, alpha_here: float | None = None,
                   v_big: float = GPU_VERIFY, c_big: float | None = None, height: int = 380,
                   label: str = "this run", here: str = "this machine") -> go.Figure:
    """alpha_here: where the star sits (best: the effective acceptance of the run's τ).
    c_big: the same skip set's draft cost on a memory-bound GPU (≈ share of weights still read).
    here: where v_here was measured, for the left panel's title ("this CPU", "this GPU")."""
    alphas = np.linspace(0, 1, 51)
    cs = np.linspace(0.05, 1.0, 40)
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.08, subplot_titles=(
        f"this model on {here} · v = {v_here:.2f}", f"large model on a GPU · v ≈ {v_big:.2f}"))
    scale = [[0.0, "#e8a59c"], [1 / 3, REJECTED.tint], [1 / 3 + 1e-3, ACCEPTED.tint], [1.0, ACCEPTED.key]]
    for col, v in ((1, v_here), (2, v_big)):
        z = np.array([[speedup(a, c, v, gamma) for a in alphas] for c in cs])
        fig.add_trace(go.Contour(
            x=alphas, y=cs, z=np.round(z, 3).tolist(), zmin=0, zmax=3, colorscale=scale,
            contours=dict(start=0.25, end=3.0, size=0.25, showlabels=True,
                          labelfont=dict(size=9, color=INK)),
            line=dict(width=0.5, color="rgba(31,41,51,0.25)"), showscale=col == 2,
            colorbar=dict(title=dict(text="speedup ×", side="right"), thickness=10, len=0.85),
            hovertemplate="acceptance %{x:.2f}<br>draft cost c %{y:.2f}<br>predicted %{z:.2f}×<extra></extra>"),
            row=1, col=col)
        fig.add_trace(go.Contour(
            x=alphas, y=cs, z=np.round(z, 3).tolist(), contours=dict(start=1, end=1, size=1, coloring="none",
                                                                     showlabels=False),
            line=dict(width=2.5, color=INK), showscale=False, hoverinfo="skip"), row=1, col=col)
    if alpha_here is not None:
        points = ((1, c_here, v_here, label),
                  (2, c_big if c_big is not None else c_here, v_big, "same set, big model"))
        for col, c, v, text in points:
            fig.add_trace(go.Scatter(
                x=[alpha_here], y=[c], mode="markers+text", text=[text],
                textposition=("bottom" if c > 0.8 else "top") + (" left" if alpha_here > 0.75 else " center"), textfont=dict(size=10, color=INK),
                marker=dict(symbol="star", size=15, color=INK, line=dict(color="#fff", width=1)),
                hovertemplate=(f"acceptance {alpha_here:.2f}, c {c:.2f}<br>predicted "
                               f"{speedup(alpha_here, c, v, gamma):.2f}×<extra></extra>")), row=1, col=col)
    fig.update_layout(**base_layout(f"What if? Predicted speedup at γ = {gamma} · black line = break-even (1×)",
                                    height))
    fig.update_layout(margin=dict(l=50, r=10, t=60, b=45))
    for col in (1, 2):
        fig.update_xaxes(title_text="acceptance α", range=[0, 1], row=1, col=col, fixedrange=True)
        fig.update_yaxes(title_text="draft cost c" if col == 1 else None, range=[0.05, 1], row=1, col=col,
                         fixedrange=True)
    for a in fig.layout.annotations:
        a.font = dict(size=11, color=MUTED)
    return fig
