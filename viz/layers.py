"""Layer maps: which attention / MLP sublayers a skip set leaves out, for the set in use and for
every domain side by side, plus a per-step strip when the set changes during a run (KnapSpec)."""
from __future__ import annotations

import plotly.graph_objects as go

from .theme import INK, MUTED, RUN, SKIPPED, base_layout, domain_color


def _discrete_scale(colors: list[str]) -> list:
    """A colorscale where integer z = i shows colors[i] (z in 0..len-1)."""
    n = max(1, len(colors) - 1)
    scale = []
    for i, c in enumerate(colors):
        lo, hi = max(0.0, (i - 0.5) / n), min(1.0, (i + 0.5) / n)
        scale += [[lo, c], [hi, c]]
    return scale


def _tint(color: str, alpha: float = 0.4) -> str:
    """A hex colour at `alpha` opacity: an MLP the draft runs with only part of its channels."""
    h = color.lstrip("#")
    if len(h) != 6:
        return color
    r, g, b = (int(h[i:i + 2], 16) for i in (0, 2, 4))
    return f"rgba({r},{g},{b},{alpha})"


def _rows(named_sets, n_layers: int):
    """Heatmap rows (attn, mlp per set, top to bottom), their colour codes, labels and hover text.

    A skipped sublayer takes the set's colour; an MLP cut to part of its channels (a channel set,
    SkipSet.channels) takes a light tint of it and the row label says the share kept.
    """
    z, text, labels = [], [], []
    colors = [RUN]
    for name, skip, color in named_sets:
        colors.append(color)
        code = len(colors) - 1
        cut = None
        if skip.channels:
            colors.append(_tint(color))
            cut = len(colors) - 1
        for kind, idx, word in (("attn", skip.attn, "attention"), ("mlp", skip.mlp, "MLP")):
            partial = cut is not None and kind == "mlp"
            z.append([code if i in idx else (cut if partial else 0) for i in range(n_layers)])
            text.append([f"{name} set · layer {i} {word} · "
                         + ("skipped by the draft" if i in idx else
                            f"runs in the draft with {skip.keep:.0%} of its channels "
                            f"({skip.channels} ranking)" if partial else "runs in the draft")
                         for i in range(n_layers)])
            share = f"{len(idx)}/{n_layers}"
            if kind == "attn":
                labels.append(f"<b>{name}</b> attn {share}")
            else:
                labels.append(f"mlp {share}" + (f" · {skip.keep:.0%} ch" if partial else ""))
    return z, text, labels, colors


def _heatmap(named_sets, n_layers: int, yaxis: str = "y", opacity: float = 1.0) -> go.Heatmap:
    z, text, labels, colors = _rows(named_sets, n_layers)
    return go.Heatmap(z=z, x=list(range(n_layers)), y=list(range(len(z))), text=text,
                      hovertemplate="%{text}<extra></extra>", colorscale=_discrete_scale(colors),
                      zmin=0, zmax=len(colors) - 1, showscale=False, xgap=2, ygap=1,
                      opacity=opacity, yaxis=yaxis), labels


def set_list(domain_sets: dict, static) -> list[tuple[str, object, str]]:
    """(name, SkipSet, colour) for every domain in order, then the static set."""
    out = [(d, s, domain_color(d, i)) for i, (d, s) in enumerate(domain_sets.items())]
    if static is not None:
        out.append(("static", static, domain_color("static")))
    return out


def layer_map(n_layers: int, domain_sets: dict | None = None, static=None, in_use=None,
              in_use_name: str = "", in_use_domain: str | None = None, history=None,
              height: int = 280, title: str | None = None, draft: str = "") -> go.Figure:
    """The Generate tab's layer map: the set drafting now above every domain's set.

    in_use: the SkipSet drafting now (None: autoregressive — nothing skipped, nothing drafted).
    history: [(step, SkipSet)] of the sets used; if the set changed during the run (KnapSpec) the
    map shows the set in use above a per-step strip instead of the domain sets.
    draft: the draft's weights in words ("int8 draft"), named in the title.
    """
    top = []
    if in_use is not None:
        top = [(f"in use: {in_use_name or in_use.name or 'set'}", in_use,
                domain_color(in_use_domain or in_use.name or "knapspec"))]
    changes = _changes(history)
    if changes and top:
        return _strip_map(n_layers, top, changes, height, title)
    others = set_list(domain_sets or {}, static)
    rows = top + others
    if not rows:
        fig = go.Figure(layout=base_layout(title or "Layer map", height))
        fig.add_annotation(text="autoregressive: every layer runs, nothing is drafted", showarrow=False,
                           font=dict(color=MUTED, size=12), x=0.5, y=0.5, xref="paper", yref="paper")
        fig.update_xaxes(visible=False)
        fig.update_yaxes(visible=False)
        return fig
    labels = _rows(rows, n_layers)[2]
    if top and others:
        # dim the sets not in use so the eye lands on the one drafting now
        hm_top, _ = _heatmap(top, n_layers)
        hm_rest, _ = _heatmap(others, n_layers, opacity=0.75)
        hm_rest.update(y=list(range(2 * len(top), len(labels))))
        traces = [hm_top, hm_rest]
    else:
        traces = [_heatmap(rows, n_layers)[0]]
    subtitle = title is None and in_use is not None and bool(draft)
    if title is None:
        skipped = [f"{len(in_use.attn)} attn + {len(in_use.mlp)} MLP skipped"] \
            if in_use is not None and (in_use.attn or in_use.mlp or not in_use.channels) else []
        kept = [f"MLPs keep {in_use.keep:.0%} of channels"] if in_use is not None and in_use.channels else []
        title = ("Layer map · coloured = skipped by each domain's draft" if in_use is None else
                 "Layer map · " + ", ".join(skipped + kept))
    fig = go.Figure(data=traces, layout=base_layout(title, height))
    fig.update_layout(yaxis=_label_axis(labels), xaxis=_layer_axis(n_layers),
                      margin=dict(l=8, r=8, t=58 if subtitle else 44, b=8))
    if subtitle:                     # the draft's words under the title: a channel set's can be long
        fig.add_annotation(text=draft, xref="paper", yref="paper", x=1, y=1, xanchor="right", yanchor="bottom",
                           yshift=14, showarrow=False, font=dict(size=10, color=INK))
    if top and others:
        fig.add_hline(y=2 * len(top) - 0.5, line=dict(color=INK, width=1.5))
    return fig


def _label_axis(labels, domain=(0, 1)) -> dict:
    return dict(tickmode="array", tickvals=list(range(len(labels))), ticktext=labels, autorange="reversed",
                tickfont=dict(size=9, color=INK), showgrid=False, domain=list(domain), fixedrange=True)


def _layer_axis(n_layers: int) -> dict:
    return dict(title=None, dtick=5, showgrid=False, tickfont=dict(size=9, color=MUTED), side="top",
                fixedrange=True, range=[-0.5, n_layers - 0.5])


def _strip_map(n_layers: int, top, changes, height: int, title: str | None) -> go.Figure:
    """The set in use (top) and, below, which sublayers were skipped from each re-optimisation on."""
    hm, labels = _heatmap(top, n_layers)
    strip = _timeline_trace(changes, n_layers)
    title = title or f"Layer map · KnapSpec re-chose its set {len(changes) - 1}× as the context grew"
    fig = go.Figure(data=[hm, strip], layout=base_layout(title, height))
    fig.update_layout(
        yaxis=_label_axis(labels, (0.80, 1.0)), xaxis=_layer_axis(n_layers),
        xaxis2=dict(anchor="y2", showgrid=False, tickfont=dict(size=9, color=MUTED), fixedrange=True,
                    title=dict(text="from step", font=dict(size=10, color=MUTED), standoff=2)),
        yaxis2=dict(domain=[0.0, 0.66], anchor="x2", tickmode="array", showgrid=False, fixedrange=True,
                    tickvals=[(n_layers - 1) / 2, n_layers + (n_layers - 1) / 2],
                    ticktext=["attn<br>layers", "MLP<br>layers"], tickfont=dict(size=9), autorange="reversed"),
        margin=dict(l=8, r=8, t=44, b=30))
    fig.add_annotation(text="skip set per step (dark = skipped)", x=0, y=0.70, xref="paper", yref="paper",
                       showarrow=False, xanchor="left", yanchor="bottom", font=dict(size=10, color=MUTED))
    return fig


def _changes(history) -> list:
    """history → [(step, SkipSet)] if the set changed at least once, else []."""
    if not history:
        return []
    sets = {s for _, s in history}
    return list(history) if len(sets) > 1 else []


def _timeline_trace(history, n_layers: int) -> go.Heatmap:
    """x = step, y = sublayer (attention rows, then MLP rows), dark = skipped from that step on."""
    steps = [s for s, _ in history]
    z = [[0] * len(steps) for _ in range(2 * n_layers)]
    text = [[""] * len(steps) for _ in range(2 * n_layers)]
    for j, (step, skip) in enumerate(history):
        for i in range(n_layers):
            for row, idx, word in ((i, skip.attn, "attention"), (n_layers + i, skip.mlp, "MLP")):
                z[row][j] = 1 if i in idx else 0
                text[row][j] = (f"from step {step}: layer {i} {word} "
                                f"{'skipped' if i in idx else 'runs'}")
    return go.Heatmap(z=z, x=[str(s) for s in steps], y=list(range(2 * n_layers)), text=text,
                      hovertemplate="%{text}<extra></extra>", colorscale=_discrete_scale([RUN, SKIPPED]),
                      zmin=0, zmax=1, showscale=False, xgap=2, ygap=0, xaxis="x2", yaxis="y2")


def sets_grid(n_layers: int, domain_sets: dict, static=None, highlight: str | None = None,
              height: int = 420) -> go.Figure:
    """Every domain's set side by side (the Domains & layer sets tab)."""
    fig = layer_map(n_layers, domain_sets, static, height=height,
                    title="Each domain's skip set · coloured = skipped by the draft · pale = MLP "
                          "channels cut · grey = runs")
    if highlight:
        fig.update_layout(title_text=f"Each domain's skip set · this prompt was routed to {highlight}")
    return fig


def matchness_heatmap(matchness: dict[str, dict[str, float]], domains: list[str],
                      height: int = 360) -> go.Figure:
    """Held-out matchness of each set (rows) on each domain (columns): the KNN-SSD premise."""
    sets = [s for s in list(domains) + ["static"] if s in matchness]
    z = [[matchness[s].get(d) for d in domains] for s in sets]
    text = [[f"{s} set on {d} prompts: {v:.2f} of draft tokens match the full model"
             if v is not None else "" for d, v in zip(domains, row)] for s, row in zip(sets, z)]
    fig = go.Figure(go.Heatmap(
        z=z, x=domains, y=[f"{s} set" for s in sets], text=text, hovertemplate="%{text}<extra></extra>",
        colorscale=[[0, "#f5f7fa"], [1, "#1f7a45"]], zmin=0, zmax=1, xgap=2, ygap=2,
        texttemplate="%{z:.2f}", textfont=dict(size=10),
        colorbar=dict(title=dict(text="matchness", side="right"), thickness=10, len=0.8)))
    fig.update_layout(**base_layout("Matchness: each set (row) on each domain's held-out prompts · "
                                    "the diagonal should win its column", height))
    fig.update_xaxes(side="bottom", title="prompts from domain", tickfont=dict(size=10), fixedrange=True)
    fig.update_yaxes(autorange="reversed", tickfont=dict(size=10), fixedrange=True)
    fig.update_layout(margin=dict(l=8, r=8, t=40, b=40))
    for i, s in enumerate(sets):
        if s in domains:
            j = domains.index(s)
            fig.add_shape(type="rect", x0=j - 0.5, x1=j + 0.5, y0=i - 0.5, y1=i + 0.5,
                          line=dict(color=INK, width=1.5))
    return fig



def domain_check_md(check: dict | None, margin: float | None, mode: str | None = None,
                    lookup_aware: bool = False) -> str:
    """The calibration's domain check as a markdown table: does each set beat static at home?

    check: calibrate's meta["check"] (domain → own, static, other, gain, passed). Failing domains
    are named in bold above the table: they route to the static set. lookup_aware: the matchness
    was scored only where prompt lookup would not draft (calibrate --lookup-aware).
    """
    if not check:
        return ("*This calibration predates the domain check (re-run `python -m ssd_core.calibrate`).*")
    failed = [d for d, c in check.items() if not c["passed"]]
    how = f" (search mode: {mode})" if mode else ""
    lead = (f"**Every domain set beats the static set on its own held-out prompts by ≥ {margin:.2f}{how}.**"
            if not failed else
            f"**⚠ {len(failed)} of {len(check)} domain searches did not beat the static set on their own "
            f"held-out prompts by {margin:.2f}{how}: {', '.join(failed)}. Those domains route to the "
            "static set.**")
    rows = ["| domain | own set, own prompts | static set, own prompts | gain | own set, other domains | kept |",
            "|---|---|---|---|---|---|"]
    for d, c in check.items():
        other = "–" if c.get("other") is None else f"{c['other']:.2f}"
        rows.append(f"| {d} | {c['own']:.2f} | {c['static']:.2f} | {c['gain']:+.2f} | {other} | "
                    f"{'yes' if c['passed'] else '**no → static**'} |")
    where = ("\n\n*Matchness counted only at positions where prompt lookup would not draft: the "
             "positions a skip set drafts when lookup is on.*" if lookup_aware else "")
    return lead + "\n\n" + "\n".join(rows) + where
