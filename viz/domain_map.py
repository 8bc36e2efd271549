"""The domain map: a UMAP of the router's anchors coloured and labelled by domain, with the prompt as a
star, its K nearest anchors ringed and numbered, and the routing decision in words (with the same
neighbours listed by number, prompt text and cosine similarity)."""
from __future__ import annotations

import textwrap
from statistics import median

import plotly.graph_objects as go

from .theme import FONT, INK, base_layout, contrast_ratio, domain_color, domain_symbol
from .tokens import escape

PROMPT_COLOR = "#111827"


def _wrap(text: str, width: int = 64, lines: int = 4) -> str:
    text = " ".join(str(text).split())
    parts = textwrap.wrap(text, width)[:lines]
    if len(textwrap.wrap(text, width)) > lines:
        parts[-1] = parts[-1][: width - 1] + "…"
    return "<br>".join(escape(p) for p in parts)


def anchor_traces(coords, domains, texts, kinds) -> list[go.Scatter]:
    """One trace per domain (named after it); centroids are bigger open markers."""
    order = list(dict.fromkeys(domains))
    traces = []
    for i, d in enumerate(order):
        # prompts first, then the centroids, drawn on top
        rows = sorted((r for r, dom in enumerate(domains) if dom == d), key=lambda r: kinds[r] == "centroid")
        hover = [(f"<b>{escape(d)}</b> · centroid (mean of a cluster)" if kinds[r] == "centroid"
                  else f"<b>{escape(d)}</b> · calibration prompt<br>{_wrap(texts[r])}") for r in rows]
        sym = domain_symbol(d)
        hollow = sym if sym.endswith("-open") or sym in ("cross", "x") else sym + "-open"
        traces.append(go.Scatter(
            x=[float(coords[r][0]) for r in rows], y=[float(coords[r][1]) for r in rows],
            mode="markers", name=d, legendgroup=d, text=hover, hovertemplate="%{text}<extra></extra>",
            marker=dict(color=domain_color(d, i), size=[13 if kinds[r] == "centroid" else 8 for r in rows],
                        symbol=[hollow if kinds[r] == "centroid" else sym for r in rows],
                        opacity=0.8, line=dict(width=0))))
    return traces


def domain_map(anchors: list, coords=None, prompt_xy=None, route: dict | None = None,
               prompt_text: str = "", height: int = 300, title: str | None = None,
               whole: bool = False) -> go.Figure:
    """The map with the prompt (star), its K nearest anchors (route['neighbours']) ringed, numbered as in
    the route's list and joined to it by lines, and each domain's name on its cluster.

    After a run the axes zoom to the prompt's neighbourhood; whole=True shows the whole map."""
    fig = go.Figure(data=list(anchors))
    neighbours = (route or {}).get("neighbours", []) if prompt_xy is not None and coords is not None else []
    near = [tuple(float(v) for v in coords[n["index"]]) for n in neighbours]
    for n, (x, y) in zip(neighbours, near):          # under the markers: one line per neighbour
        fig.add_trace(go.Scatter(x=[prompt_xy[0], x], y=[prompt_xy[1], y], mode="lines", hoverinfo="skip",
                                 showlegend=False, line=dict(color=domain_color(n["domain"]), width=3)))
    if near:
        hover = [f"<b>neighbour {rank}</b> · {escape(n['domain'])} · similarity {n['similarity']:.3f}<br>"
                 + (_wrap(n["text"]) if n.get("text") else "cluster centroid") for rank, n in enumerate(neighbours, 1)]
        fig.add_trace(go.Scatter(
            x=[x for x, _ in near], y=[y for _, y in near], mode="markers+text", showlegend=False,
            text=[str(r) for r in range(1, len(near) + 1)], hovertext=hover, hovertemplate="%{hovertext}<extra></extra>",
            textposition=[("top" if y >= prompt_xy[1] else "bottom") + (" right" if x >= prompt_xy[0] else " left")
                          for x, y in near],            # away from the prompt: off the line to it
            textfont=dict(size=14, color=INK, family=FONT),
            marker=dict(size=22, symbol="circle-open", color=[domain_color(n["domain"]) for n in neighbours],
                        line=dict(width=3))))
    if prompt_xy is not None:
        fig.add_trace(go.Scatter(
            x=[prompt_xy[0]], y=[prompt_xy[1]], mode="markers", name="your prompt",
            text=[f"<b>your prompt</b><br>{_wrap(prompt_text)}"], hovertemplate="%{text}<extra></extra>",
            marker=dict(symbol="star", size=24, color=PROMPT_COLOR, line=dict(color="#ffffff", width=2))))
    if title is None:
        title = "Domain map · UMAP" if prompt_xy is None else "Domain map · ★ your prompt"
    layout = base_layout(title, height)
    layout["title"]["font"]["size"] = 14
    layout["margin"] = dict(l=6, r=6, t=32, b=6)
    fig.update_layout(**layout)
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    if coords is None or not len(coords):
        return fig
    points = [tuple(float(v) for v in c) for c in coords] + ([tuple(prompt_xy)] if prompt_xy is not None else [])
    full = _box(points, 0.06)
    view = full if whole or not near else neighbourhood(prompt_xy, near, full)
    fig.update_xaxes(range=list(view[0]))
    fig.update_yaxes(range=list(view[1]))
    avoid = []
    if near:                 # labels keep off the prompt, the rings and the lines between them
        px, py = prompt_xy
        avoid = [(px, py)] + [(px + f * (x - px), py + f * (y - py)) for x, y in near for f in (0.25, 0.5, 0.75, 1)]
    fig.update_layout(annotations=cluster_labels(anchors, view, avoid, plot_px=(420, height - 38)))
    return fig


def _box(points, pad: float) -> tuple[tuple[float, float], tuple[float, float]]:
    """((x0, x1), (y0, y1)) around the points, widened by `pad` of the span on each side."""
    out = []
    for axis in (0, 1):
        lo, hi = min(p[axis] for p in points), max(p[axis] for p in points)
        span = (hi - lo) or 1.0
        out.append((lo - pad * span, hi + pad * span))
    return tuple(out)


def neighbourhood(prompt_xy, near, full, margin: float = 0.5, least: float = 0.06):
    """Axis ranges around the prompt and its neighbours: their box plus `margin` of its span on each
    side, at least `least` of the whole map's span wide, never wider than the whole map."""
    box = _box([tuple(prompt_xy), *near], 0.0)
    out = []
    for (lo, hi), (f0, f1) in zip(box, full):
        half = max((hi - lo) * (0.5 + margin), least * (f1 - f0) / 2)
        mid = (lo + hi) / 2
        out.append((max(mid - half, f0), min(mid + half, f1)) if 2 * half < f1 - f0 else (f0, f1))
    return tuple(out)


def cluster_labels(anchors, view, avoid=(), plot_px=(420, 150), lift_px: int = 16) -> list[dict]:
    """Each domain's name on its cluster, in its colour: above the anchor nearest the median of the
    domain's anchors inside the view (a zoomed map labels what it shows), preferring spots where the
    whole label stays inside the view and covers neither the `avoid` points (the prompt, its rings and
    the lines between them) nor a label placed before. plot_px: the plot's rough size in pixels."""
    (x0, x1), (y0, y1) = view
    w, h = (x1 - x0) or 1.0, (y1 - y0) or 1.0
    unit = [((ax - x0) / w, (ay - y0) / h) for ax, ay in avoid]
    half_h = 12 / plot_px[1]                                    # the label's half height
    labels, placed = [], []                                     # placed: (centre x, centre y, half width)
    for tr in anchors:
        pts = [((x - x0) / w, (y - y0) / h) for x, y in zip(tr.x, tr.y) if x0 <= x <= x1 and y0 <= y <= y1]
        if not pts or not tr.name:
            continue
        mx, my = median(p[0] for p in pts), median(p[1] for p in pts)
        half_w = (4.2 * len(tr.name) + 8) / plot_px[0]

        def spots(shift):               # anchors where a label `shift` px above fits and hides nothing
            lift = shift / plot_px[1]
            return [p for p in pts if half_w <= p[0] <= 1 - half_w and half_h <= p[1] + lift <= 1 - half_h
                    and not any(abs(p[0] - u) < half_w + 0.03 and abs(p[1] + lift - v) < half_h + 0.12
                                for u, v in unit)
                    and not any(abs(p[0] - cx) < half_w + hw + 0.01 and abs(p[1] + lift - cy) < 2 * half_h + 0.01
                                for cx, cy, hw in placed)]
        # above the cluster, else below it, else higher up; crowded everywhere: above the median anyway
        shift, free = next(((s, f) for s in (lift_px, -lift_px, 2.5 * lift_px) if (f := spots(s))), (lift_px, pts))
        nx, ny = min(free, key=lambda p: (p[0] - mx) ** 2 + (p[1] - my) ** 2)
        placed.append((nx, ny + shift / plot_px[1], half_w))
        color = tr.marker.color if isinstance(tr.marker.color, str) else domain_color(tr.name)
        labels.append(dict(x=x0 + nx * w, y=y0 + ny * h, xref="x", yref="y", text=f"<b>{escape(tr.name)}</b>",
                           showarrow=False, yshift=shift, bgcolor=color, opacity=0.9, borderpad=2,
                           font=dict(size=13, family=FONT, color=label_ink(color))))
    return labels


def label_ink(background: str) -> str:
    """White or near-black text on a domain colour, whichever contrasts more (not INK: the dark theme's
    CSS lightens INK-coloured plot text, and these labels sit on their own colour in both themes)."""
    return max(("#ffffff", PROMPT_COLOR), key=lambda ink: contrast_ratio(ink, background))


SAME_AS_STATIC = ("same draft as static: this domain's own set did not beat the static set at calibration, "
                  "so routing changes nothing here (Race vs static shows it)")


def route_html(route: dict | None, strategy: str = "knn", used: bool = True, same_as_static: bool = False) -> str:
    """The routing decision in words; used=False: what KNN would have chosen (for comparison);
    same_as_static: the routed domain drafts with the static set (its own did not beat it)."""
    if route is None:
        words = {"static": "static set: the same skip set for every prompt (no routing)",
                 "knapspec": "KnapSpec: no routing; a knapsack picks sublayers from live costs",
                 "oracle": "oracle: the domain you picked, no routing",
                 "ar": "autoregressive: no drafts, no routing"}.get(strategy, "")
        body = escape(words or "the routing decision appears after the prompt's prefill")
        return f'<div class="route idle">{body}</div>'
    lead = "routed to" if used else "KNN would route it to"
    aside = "" if used else ' <span class="route-aside">(not used by this strategy)</span>'
    if route.get("unknown"):
        head = (f"{'unknown → static set' if used else 'KNN: unknown domain → static set'} · best similarity "
                f"{route['similarity']:.2f} is below the threshold {route['threshold']:.2f}")
        return f'<div class="route unknown">{escape(head)}{aside}{_votes(route)}{_why(route)}</div>'
    d = route["domain"]
    agree = sum(n["domain"] == d for n in route["neighbours"])
    head = (f'<span class="dom-dot" style="background:{domain_color(d)}"></span>{lead} '
            f"<b>{escape(d)}</b> · {agree}/{len(route['neighbours'])} votes · "
            f"nearest similarity {route['similarity']:.2f}")
    same = f'<div class="route-same">{escape(SAME_AS_STATIC)}</div>' if same_as_static else ""
    return f'<div class="route known">{head}{aside}{same}{_votes(route)}{_why(route)}</div>'


def _why(route: dict, width: int = 90) -> str:
    """Why this domain: the K nearest anchors (their prompts, domains and cosine similarities), numbered
    as on the domain map; open, so that the map's points and their texts are seen together."""
    rows = []
    for rank, n in enumerate(route.get("neighbours", []), 1):
        full = n.get("text") or f"(centroid of {n['domain']} prompts)"
        text = full if len(full) <= width else full[:width - 1].rstrip() + "…"
        rows.append(f'<li title="{escape(full)}"><span class="why-rank">{rank}</span><span class="dom-dot" style="background:'
                    f'{domain_color(n["domain"])}"></span><b>{escape(n["domain"])}</b> '
                    f'<span class="why-sim">{n["similarity"]:.2f}</span> · '
                    f'<span class="why-text">{escape(text)}</span></li>')
    if not rows:
        return ""
    return (f'<details class="route-why" open><summary>why this domain: its {len(rows)} nearest anchors '
            f'(numbered as on the map)</summary><ol>{"".join(rows)}</ol></details>')


def _votes(route: dict) -> str:
    """The vote tally, when the neighbours disagree (a unanimous vote is already "K/K votes")."""
    votes = sorted(route.get("votes", {}).items(), key=lambda kv: -kv[1])
    if len(votes) < 2 and not route.get("unknown"):
        return ""
    unit = "votes" if route.get("vote") == "majority" else "similarity-weighted votes"
    parts = " · ".join(f"{escape(d)} {v:.2f}" if unit != "votes" else f"{escape(d)} {v:.0f}" for d, v in votes)
    return f'<div class="route-votes">{unit}: {parts}</div>'

