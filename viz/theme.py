"""The one place for colours: token kinds, domains, strategies, and the plotly look shared by every figure.

Each token kind has a key colour (swatches, strike-through line, underline, plot marks) on a tint,
and a darker ink of the same hue for text on that tint, because the key colours on their tints
reach only ≈ 3.0–4.4 : 1 while WCAG AA asks 4.5 : 1 for body text.
`contrast_ratio` lets the tests check that.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Kind:
    name: str
    key: str       # the palette colour: swatch, decoration, plot marks
    tint: str      # background behind the token
    ink: str       # text colour on the tint (AA)
    label: str     # words for the legend
    mark: str      # how it differs beyond hue


ACCEPTED = Kind("accepted", "#2e9d5b", "#e3f5ea", "#1f7a45", "accepted draft", "no line")
REJECTED = Kind("rejected", "#c0392b", "#fbe3e0", "#a93226", "rejected draft", "struck through")
VERIFIER = Kind("verifier", "#2f6db5", "#e3ecf8", "#25599a", "verifier token", "underlined")
KINDS = {k.name: k for k in (ACCEPTED, REJECTED, VERIFIER)}

INK = "#1f2933"          # body text
MUTED = "#52606d"        # secondary text (AA on white: 6.4 : 1)
GRID = "#e4e7eb"
RUN = "rgba(120,135,150,0.14)"  # a sublayer that runs (layer map): light grey on white, dark grey on dark
SKIPPED = "#37474f"      # a skipped sublayer when no domain colour applies
PAPER = "rgba(0,0,0,0)"  # figures are transparent: they take the page's background, light or dark

# Gradio's dark theme (`?__theme=dark` puts class "dark" on <body>): the same hues, lighter inks on darker
# tints (AA on the tint, and on the dark page for text), so tokens, panels and plot text stay legible.
DARK_BODY = "#0b0f19"    # Gradio's dark page background
DARK_BLOCK = "#1f2937"   # and its block (panel) background
DARK_KINDS = {"accepted": Kind("accepted", "#3fbf75", "#173f2a", "#8ee3b1", "accepted draft", "no line"),
              "rejected": Kind("rejected", "#e5604f", "#4d2220", "#f6aaa0", "rejected draft", "struck through"),
              "verifier": Kind("verifier", "#5b93da", "#1c3354", "#a8c7f0", "verifier token", "underlined")}
DARK = {"ink": "#e4e7eb", "muted": "#a3adb8", "grid": "#3e4c59", "run": "#2b3642", "skipped": "#9aa5b1"}

# One qualitative palette (Okabe–Ito based, colour-blind friendly) for the UMAP and the layer grid.
DOMAIN_COLORS = {
    "summarization": "#0072b2",
    "math": "#e69f00",
    "translation": "#009e73",
    "story": "#cc79a7",
    "sql": "#d55e00",
    "code": "#56b4e9",
    "qa": "#6a3d9a",
    "static": "#7b8794",
    "knapspec": "#37474f",
}
# A second cue besides colour in the UMAP.
DOMAIN_SYMBOLS = {
    "summarization": "circle", "math": "square", "translation": "diamond", "story": "triangle-up",
    "sql": "cross", "code": "x", "qa": "triangle-down", "static": "circle-open",
}
# Strategies in the benchmark's figures, keyed by name (policies.registry.STRATEGIES), and the
# transformers model.generate reference.
STRATEGY_COLOURS = {
    "ar": "#7f7f7f",
    "static": "#ff7f0e",
    "knn": "#2ca02c",
    "oracle": "#9467bd",
    "knapspec": "#1f77b4",
    "auto": "#8c564b",
    "hf_generate": "#17becf",
}
FALLBACK_COLORS = ("#8e6c8a", "#3f7f6f", "#9c6644", "#5f6caf", "#b5651d", "#4d7ea8")

FONT = "Inter, ui-sans-serif, system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif"
MONO = "ui-monospace, 'SF Mono', Menlo, Consolas, 'DejaVu Sans Mono', monospace"


def domain_color(domain: str | None, order: int = 0) -> str:
    if domain in DOMAIN_COLORS:
        return DOMAIN_COLORS[domain]
    return FALLBACK_COLORS[order % len(FALLBACK_COLORS)]


def domain_symbol(domain: str | None) -> str:
    return DOMAIN_SYMBOLS.get(domain, "circle")


def base_layout(title: str = "", height: int = 300, **extra) -> dict:
    """The common plotly layout: plain, small margins, readable hover labels."""
    layout = dict(
        title=dict(text=title, x=0.01, xanchor="left", y=0.98, yanchor="top",
                   font=dict(size=13, color=INK)),
        height=height, autosize=True,
        margin=dict(l=8, r=8, t=34 if title else 8, b=8),
        paper_bgcolor=PAPER, plot_bgcolor=PAPER,
        font=dict(family=FONT, size=11, color=INK),
        hoverlabel=dict(bgcolor="#ffffff", bordercolor="#9aa5b1", font=dict(family=FONT, size=12, color=INK),
                        align="left"),
        showlegend=False,
    )
    layout.update(extra)
    return layout


# --- contrast (WCAG 2.x) ----------------------------------------------------------------------
def _channel(c: int) -> float:
    s = c / 255
    return s / 12.92 if s <= 0.04045 else ((s + 0.055) / 1.055) ** 2.4


def luminance(hex_color: str) -> float:
    h = hex_color.lstrip("#")
    r, g, b = (int(h[i:i + 2], 16) for i in (0, 2, 4))
    return 0.2126 * _channel(r) + 0.7152 * _channel(g) + 0.0722 * _channel(b)


def contrast_ratio(fg: str, bg: str) -> float:
    a, b = sorted((luminance(fg), luminance(bg)), reverse=True)
    return (a + 0.05) / (b + 0.05)


def css_variables() -> str:
    """CSS custom properties and token classes generated from this palette (app.css uses them)."""
    lines = [":root {"]
    for k in KINDS.values():
        lines += [f"  --{k.name}-key: {k.key};", f"  --{k.name}-tint: {k.tint};", f"  --{k.name}-ink: {k.ink};"]
    lines += [f"  --ink: {INK};", f"  --muted: {MUTED};", f"  --grid: {GRID};", f"  --run: {RUN};",
              f"  --skipped: {SKIPPED};"]
    lines += [f"  --domain-{d}: {c};" for d, c in DOMAIN_COLORS.items()]
    lines.append("}")
    lines.append(".dark {")
    for k in DARK_KINDS.values():
        lines += [f"  --{k.name}-key: {k.key};", f"  --{k.name}-tint: {k.tint};", f"  --{k.name}-ink: {k.ink};"]
    lines += [f"  --{name}: {c};" for name, c in DARK.items()]
    lines.append("}")
    for cls, k in (("acc", ACCEPTED), ("rej", REJECTED), ("ver", VERIFIER)):
        lines.append(f".tok.{cls} {{ color: var(--{k.name}-ink); background: var(--{k.name}-tint); }}")
    lines.append(".tok.rej { text-decoration: line-through 2px var(--rejected-key); }")
    lines.append(".tok.ver { text-decoration: underline 2px var(--verifier-key); text-underline-offset: 3px; }")
    lines.append(".tok.look { outline: 1.5px dashed currentColor; outline-offset: -1.5px; }")
    return "\n".join(lines) + "\n"
