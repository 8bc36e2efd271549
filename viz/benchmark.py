"""Benchmark tab: the committed results (assets/bench/) as readable tables."""
from __future__ import annotations

from ssd_core.policies.registry import LABELS

from .tokens import escape

NOTHING = ('<div class="bench-empty">No benchmark committed yet. Run <code>python -m ssd_core.bench '
           "--questions assets/bench/sample_questions.jsonl --out assets/bench/sample_run</code> and "
           "<code>python -m ssd_core.tools.microbench</code>, then restart the app.</div>")


def _num(x, fmt: str = "{:.2f}", suffix: str = "") -> str:
    return fmt.format(x) + suffix if isinstance(x, (int, float)) else "–"


def summary_html(summary: dict | None, source: str = "") -> str:
    """summary.json of `python -m ssd_core.bench` → strategy table, per-category speedups, routing."""
    if not summary:
        return NOTHING
    strategies = summary.get("strategies", {})
    rows = []
    for name, s in strategies.items():
        sp = s.get("speedup")
        cls = "good" if isinstance(sp, (int, float)) and sp >= 1 else "bad" if sp is not None else ""
        rows.append(f"<tr><th>{escape(LABELS.get(name, name))}</th><td>{_num(s.get('tokens_per_s'), '{:.1f}')}</td>"
                    f'<td class="{cls}">{_num(sp, "{:.2f}", "×")}</td><td>{_num(s.get("tau"))}</td>'
                    f"<td>{_num(s.get('alpha'))}</td></tr>")
    lossless = summary.get("lossless")
    hf = summary.get("lossless_vs_hf")
    badge = (('<span class="good">✓ every strategy\'s greedy text identical to autoregressive'
              + (" and to transformers' generate" if hf else "") + "</span>")
             if lossless else '<span class="bad">✗ some outputs differ from autoregressive or from '
                              "transformers' generate</span>"
             if lossless is not None else "")
    draft = summary.get("settings", {}).get("draft_label")
    if draft:
        badge += f' · <span class="muted">{escape(draft)}{" + prompt lookup" if summary["settings"].get("lookup") else ""}</span>'
    badge += f' · <span class="muted">on {escape(str(summary.get("device") or "cpu"))}</span>'   # older runs: CPU
    head = (f'<div class="bench-head">model <b>{escape(str(summary.get("model", "?")))}</b> · {badge}'
            + (f' · <span class="muted">{escape(source)}</span>' if source else "") + "</div>")
    table = ('<table class="bench-table"><tr><th>strategy</th><th>tokens/s</th><th>speedup vs AR</th>'
             f'<th>τ</th><th>α</th></tr>{"".join(rows)}</table>')
    return head + table + _per_category(strategies) + _routing(summary.get("routing"))


def _per_category(strategies: dict) -> str:
    cats = []
    for s in strategies.values():
        for c in (s.get("per_category") or {}):
            if c not in cats:
                cats.append(c)
    if not cats:
        return ""
    head = "".join(f"<th>{escape(c)}</th>" for c in cats)
    rows = []
    for name, s in strategies.items():
        per = s.get("per_category") or {}
        cells = "".join(f"<td>{_num((per.get(c) or {}).get('speedup'), '{:.2f}', '×')}</td>" for c in cats)
        rows.append(f"<tr><th>{escape(LABELS.get(name, name))}</th>{cells}</tr>")
    return (f'<h4>Speedup per category</h4><table class="bench-table"><tr><th>strategy</th>{head}</tr>'
            f'{"".join(rows)}</table>')


def _routing(routing) -> str:
    if not routing:
        return ""
    domains = []
    for counts in routing.values():
        for d in (counts or {}):
            if d not in domains:
                domains.append(d)
    head = "".join(f"<th>{escape(str(d))}</th>" for d in domains)
    rows = "".join(f"<tr><th>{escape(c)}</th>" + "".join(f"<td>{(counts or {}).get(d, '')}</td>" for d in domains)
                   + "</tr>" for c, counts in routing.items())
    return (f'<h4>Where the KNN router sent each category</h4><table class="bench-table"><tr><th>category</th>'
            f"{head}</tr>{rows}</table>")


def core_html(core: dict | None) -> str:
    """core.json of `python -m ssd_core.tools.microbench` → the engine's speed in one table."""
    if not core:
        return ""
    tps = core.get("tokens_per_s", {})
    bw = core.get("bandwidth_gb_s", {})
    names = {"generate": "transformers model.generate", "core_ar": "ssd_core autoregressive",
             "ssd": "ssd_core self-speculative (example set)"}
    rows = "".join(f"<tr><th>{escape(names.get(k, k))}</th><td>{_num(v, '{:.1f}')}</td>"
                   f"<td>{_num(bw.get(k), '{:.1f}', ' GB/s') if k in bw else '–'}</td></tr>" for k, v in tps.items())
    facts = (f"core AR vs generate: {_num(core.get('core_ar_vs_generate'), '{:.2f}', '×')} · "
             f"SSD vs core AR: {_num(core.get('ssd_vs_core_ar'), '{:.2f}', '×')} · τ {_num(core.get('ssd_tau'))}"
             f" · α {_num(core.get('ssd_alpha'))} · {core.get('threads', '?')} threads, "
             f"{core.get('max_new_tokens', '?')} new tokens")
    return (f'<h4>Engine speed ({escape(str(core.get("model", "")))})</h4><table class="bench-table">'
            f"<tr><th>decoder</th><th>tokens/s</th><th>weight bandwidth</th></tr>{rows}</table>"
            f'<p class="muted">{escape(facts)}</p>')
