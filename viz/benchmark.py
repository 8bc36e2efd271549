"""Benchmark tab: the committed results (assets/bench/) as readable tables.

`read_bench` reads the folder: the headline run named in its index (assets/bench/README.md,
`<!-- headline: RUN -->`) first, then every other kept run's results.md, one entry per run.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from ssd_core.policies.registry import LABELS
from ssd_core.tools.specbench import load_answers

from .tokens import escape

log = logging.getLogger("knn-ssd-studio")
ROOT = Path(__file__).resolve().parent.parent
INDEX = "README.md"                                    # assets/bench/README.md: the runs kept, and why
HEADLINE = re.compile(r"<!--\s*headline:\s*([\w./-]+)\s*-->")

NOTHING = ('<div class="bench-empty">No benchmark committed yet. Run <code>python -m ssd_core.bench '
           "--questions assets/bench/sample_questions.jsonl --out assets/bench/my_run</code> and "
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
    names = {"generate": "transformers model.generate (short prompt, EOS off)",
             "core_ar": "ssd_core autoregressive (short prompt, EOS off)",
             "ssd": "ssd_core, the app's decoding (held-out prompts, EOS on)"}
    rows = "".join(f"<tr><th>{escape(names.get(k, k))}</th><td>{_num(v, '{:.1f}')}</td>"
                   f"<td>{_num(bw.get(k), '{:.1f}', ' GB/s') if k in bw else '–'}</td></tr>" for k, v in tps.items())
    held = core.get("heldout") or {}
    facts = (f"core AR vs generate: {_num(core.get('core_ar_vs_generate'), '{:.2f}', '×')} · "
             f"SSD vs core AR: {_num(core.get('ssd_vs_core_ar'), '{:.2f}', '×')}"
             + (f" (core AR on the same held-out prompts: {_num(held.get('core_ar'), '{:.1f}')} tok/s)" if held else "")
             + f" · τ {_num(core.get('ssd_tau'))}"
             f" · α {_num(core.get('ssd_alpha'))} · {core.get('threads', '?')} threads, "
             f"{core.get('max_new_tokens', '?')} new tokens, decode only (prefill excluded)"
             + (f", verifier kernel {core['kernel']}" if core.get("kernel") else ""))
    return (f'<h4>Engine speed ({escape(str(core.get("model", "")))})</h4><table class="bench-table">'
            f"<tr><th>decoder</th><th>tokens/s</th><th>weight bandwidth</th></tr>{rows}</table>"
            f'<p class="muted">{escape(facts)}</p>')


# --- reading assets/bench/ ---------------------------------------------------------------------------
def headline_name(folder: Path) -> str | None:
    """The run the index names as the headline (`<!-- headline: RUN -->`), or None."""
    try:
        m = HEADLINE.search((folder / INDEX).read_text(encoding="utf-8"))
    except OSError:
        return None
    return m.group(1) if m else None


def read_bench(folder: Path) -> dict:
    """The committed benchmark results under `folder` (nothing → empty entries).

    `summary` is the headline run's summary.json; without an index naming one, the first run folder
    in name order that has a summary. `markdown` lists (label, text): the headline run's results
    first, then the index, then one entry per other run (its results.md files joined, subfolders
    under their own heading), so the Benchmark tab shows one accordion per run.
    """
    out = {"summary": None, "summary_path": "", "answers": {}, "core": None, "scaling": None, "markdown": [],
           "headline": None}
    name = headline_name(folder)
    candidates = ([folder / name / "summary.json"] if name else []) + sorted(folder.glob("*/summary.json"))
    for path in candidates:
        summary = _read_json(path)
        if summary:
            out["summary"], out["headline"] = summary, path.parent.name
            out["summary_path"] = ("headline run: " if path.parent.name == name else "") + _rel(path)
            out["answers"] = {p.stem: a for p in sorted(path.parent.glob("*.jsonl")) if (a := _answers(p))}
            break
    out["core"] = _read_json(folder / "core.json")
    out["scaling"] = next((s for p in sorted(folder.glob("**/scaling.json")) if (s := _read_json(p))), None)
    out["markdown"] = _markdown_by_run(folder, out["headline"])
    return out


def runs_of_calibration(folder: Path, name: str, created: str | None) -> list[dict]:
    """The committed bench summaries made with calibration `name` as it is now (same `created`),
    the latest first."""
    runs = [s for p in sorted(folder.glob("**/summary.json")) if (s := _read_json(p))
            and Path(str(s.get("calibration", ""))).name == name and s.get("calibration_created") == created]
    return sorted(runs, key=lambda s: str(s.get("started", "")), reverse=True)


def _markdown_by_run(folder: Path, headline: str | None) -> list[tuple[str, str]]:
    runs: dict[str, list[Path]] = {}
    for p in sorted(folder.glob("**/*.md")):
        rel = p.relative_to(folder)
        runs.setdefault(rel.parts[0] if len(rel.parts) > 1 else rel.name, []).append(p)
    entries = []
    for run, paths in runs.items():
        if len(paths) == 1:
            label, text = _rel(paths[0]), paths[0].read_text(encoding="utf-8")
        else:
            label = _rel(folder / run) + "/"
            text = "\n\n".join(f"#### {p.relative_to(folder / run)}\n\n" + p.read_text(encoding="utf-8")
                               for p in paths)
        if run == headline:
            label = "Headline run: " + label
        entries.append((run, label, text))
    order = {headline: 0, INDEX: 1}
    entries.sort(key=lambda e: order.get(e[0], 2))    # stable: the rest stay in name order
    return [(label, text) for _, label, text in entries]


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _answers(path: Path) -> list:
    """Spec-Bench answer records (one JSON object a line with `choices`), or [] for other files."""
    try:
        rows = load_answers(path)
    except (OSError, ValueError):
        return []
    return rows if rows and all(isinstance(r, dict) and "choices" in r for r in rows) else []


def bench_plots(bench: dict) -> list:
    """The bench's own figures (viz.bench_figures), for whatever results exist."""
    try:
        from viz import bench_figures as bf
        figs = []
        if bench["summary"]:
            figs += [bf.speedup_figure(bench["summary"]), bf.tau_figure(bench["summary"])]
        if bench["answers"]:
            figs.append(bf.accept_length_figure(bench["answers"]))
        if bench["scaling"]:
            figs.append(bf.scaling_figure(bench["scaling"]))
        return figs
    except Exception as exc:      # results written by another version: show the tables, log the rest
        log.warning("benchmark figures unavailable: %s", exc)
        return []


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)
