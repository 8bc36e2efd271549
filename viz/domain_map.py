"""The domain map: a UMAP of the router's anchors coloured by domain, with the prompt as a star and
lines to its K nearest anchors, and the routing decision in words."""
from __future__ import annotations

import textwrap

import plotly.graph_objects as go

from .theme import INK, base_layout, domain_color, domain_symbol
from .tokens import escape

PROMPT_COLOR = "#111827"


def _wrap(text: str, width: int = 64, lines: int = 4) -> str:
    text = " ".join(str(text).split())
    parts = textwrap.wrap(text, width)[:lines]
    if len(textwrap.wrap(text, width)) > lines:
        parts[-1] = parts[-1][: width - 1] + "…"
    return "<br>".join(escape(p) for p in parts)


def anchor_traces(coords, domains, texts, kinds) -> list[go.Scatter]:
    """One trace per domain (legend entry); centroids are bigger open markers."""
    order = list(dict.fromkeys(domains))
    traces = []
    for i, d in enumerate(order):
        # prompts first: the legend shows a trace's first marker
        rows = sorted((r for r, dom in enumerate(domains) if dom == d), key=lambda r: kinds[r] == "centroid")
        hover = [(f"<b>{escape(d)}</b> · centroid (mean of a cluster)" if kinds[r] == "centroid"
                  else f"<b>{escape(d)}</b> · calibration prompt<br>{_wrap(texts[r])}") for r in rows]
        sym = domain_symbol(d)
        hollow = sym if sym.endswith("-open") or sym in ("cross", "x") else sym + "-open"
        traces.append(go.Scatter(
            x=[float(coords[r][0]) for r in rows], y=[float(coords[r][1]) for r in rows],
            mode="markers", name=d, legendgroup=d, text=hover, hovertemplate="%{text}<extra></extra>",
            marker=dict(color=domain_color(d, i), size=[11 if kinds[r] == "centroid" else 6 for r in rows],
                        symbol=[hollow if kinds[r] == "centroid" else sym for r in rows],
                        opacity=0.8, line=dict(width=0))))
    return traces


def domain_map(anchors: list, coords=None, prompt_xy=None, route: dict | None = None,
               prompt_text: str = "", height: int = 300, title: str | None = None) -> go.Figure:
    """The map with the prompt (star) and lines to its K nearest anchors (from route['neighbours'])."""
    fig = go.Figure(data=list(anchors))
    neighbours = (route or {}).get("neighbours", [])
    if prompt_xy is not None and coords is not None and neighbours:
        px, py = prompt_xy
        lx, ly, nx, ny, ntext, ncolor = [], [], [], [], [], []
        for rank, n in enumerate(neighbours, 1):
            x, y = (float(v) for v in coords[n["index"]])
            lx += [px, x, None]
            ly += [py, y, None]
            nx.append(x), ny.append(y), ncolor.append(domain_color(n["domain"]))
            what = _wrap(n["text"]) if n.get("text") else "cluster centroid"
            ntext.append(f"<b>neighbour {rank}</b> · {escape(n['domain'])} · similarity "
                         f"{n['similarity']:.3f}<br>{what}")
        fig.add_trace(go.Scatter(x=lx, y=ly, mode="lines", hoverinfo="skip", showlegend=False,
                                 line=dict(color="#52606d", width=1.2, dash="dot")))
        fig.add_trace(go.Scatter(x=nx, y=ny, mode="markers", text=ntext, showlegend=False,
                                 hovertemplate="%{text}<extra></extra>",
                                 marker=dict(size=13, color="rgba(0,0,0,0)",
                                             line=dict(color=ncolor, width=2.5))))
    if prompt_xy is not None:
        fig.add_trace(go.Scatter(
            x=[prompt_xy[0]], y=[prompt_xy[1]], mode="markers", name="your prompt",
            text=[f"<b>your prompt</b><br>{_wrap(prompt_text)}"], hovertemplate="%{text}<extra></extra>",
            marker=dict(symbol="star", size=20, color=PROMPT_COLOR, line=dict(color="#ffffff", width=1.5))))
    if title is None:
        title = ("Domain map · UMAP of the router's anchors" if prompt_xy is None
                 else "Domain map · ★ your prompt · lines to its K nearest")
    layout = base_layout(title, height, showlegend=True)
    layout["legend"] = dict(orientation="v", x=1, xanchor="right", y=1, yanchor="top", font=dict(size=10, color=INK),
                            bgcolor="rgba(255,255,255,0.8)", itemclick="toggleothers", itemsizing="constant",
                            tracegroupgap=0)
    fig.update_layout(**layout)
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    if coords is not None and len(coords):
        xs = [float(c[0]) for c in coords]
        lo, hi = min(xs), max(xs)
        pad = (hi - lo) or 1.0
        fig.update_xaxes(range=[lo - 0.05 * pad, hi + 0.42 * pad])     # room for the legend on the right
    return fig


def route_html(route: dict | None, strategy: str = "knn", used: bool = True) -> str:
    """The routing decision in words; used=False: what KNN would have chosen (for comparison)."""
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
            f"<b>{escape(d)}</b> · {agree}/{len(route['neighbours'])} neighbour votes · "
            f"nearest similarity {route['similarity']:.2f}")
    return f'<div class="route known">{head}{aside}{_votes(route)}{_why(route)}</div>'


def _why(route: dict, width: int = 90) -> str:
    """Why this domain: the K nearest anchors (their prompts, domains and cosine similarities)."""
    rows = []
    for n in route.get("neighbours", []):
        text = n.get("text") or f"(centroid of {n['domain']} prompts)"
        text = text if len(text) <= width else text[:width - 1].rstrip() + "…"
        rows.append(f'<li><span class="dom-dot" style="background:{domain_color(n["domain"])}"></span>'
                    f'<b>{escape(n["domain"])}</b> {n["similarity"]:.2f} · '
                    f'<span class="why-text">{escape(text)}</span></li>')
    if not rows:
        return ""
    return (f'<details class="route-why"><summary>why this domain: the {len(rows)} nearest anchor '
            f'prompts</summary><ol>{"".join(rows)}</ol></details>')


def _votes(route: dict) -> str:
    votes = sorted(route.get("votes", {}).items(), key=lambda kv: -kv[1])
    if not votes:
        return ""
    unit = "votes" if route.get("vote") == "majority" else "similarity-weighted votes"
    parts = " · ".join(f"{escape(d)} {v:.2f}" if unit != "votes" else f"{escape(d)} {v:.0f}" for d, v in votes)
    return f'<div class="route-votes">{unit}: {parts}</div>'

