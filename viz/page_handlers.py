"""Page load and the calibration chooser, without Gradio: what a freshly opened page shows of the shared
state (a calibration installed after the layout was built, a domain map loaded since, the draft weights
built so far), and each visitor's own pick of calibration. No model runs here."""
from __future__ import annotations

from viz.session import batch_view, cost_view, domains_views, get_session, layer_fig, map_fig, route_view, visitor
from viz.studio import Studio, Update
from viz.tokens import escape

# what a page load may update: a calibration installed after the layout was built, the chooser's line
PAGE_OUTPUTS = ("session", "cal_row", "banner", "strategy", "k", "domain_plot", "layer_plot", "cost",
                "what_if", "batch_plot", "domains_md", "sets_plot", "match_plot", "wi_verify", "cal_info")
# what picking a calibration updates
CHOOSE_OUTPUTS = ("session", "route", "domain_plot", "layer_plot", "cost", "what_if", "batch_plot", "domains_md",
                  "sets_plot", "match_plot", "k", "cal_info")


def page_load(studio: Studio, built_with, session) -> dict:
    """On page load: this visitor's own state (which also opens the event stream before the first
    click), the chooser's line as it is now (the layout's was written before any draft was built) and, if a
    calibration was installed after the layout was built, everything that shows it."""
    studio, session = visitor(studio, session)
    cal = studio.calibration
    now = cal_info(studio, session) if studio.choices else {}
    if cal is built_with:
        # the UMAP may have finished loading in the background since the layout was built, and this machine's
        # latency model and batched pass costs may have been measured (the layout's panels said "provisional")
        out = dict(session=session, **now, **({"domain_plot": map_fig(studio, None)} if studio.domain_map is not None
                                              else {}))
        if cal is not None:
            cost, what_if_fig = cost_view(studio, None, None)
            out.update(cost=cost, what_if=what_if_fig, wi_verify=Update(value=what_if_verify(cal)),
                       batch_plot=batch_view(studio, None))
        return out
    text, sets, match = domains_views(studio)
    cost, what_if_fig = cost_view(studio, None, None)
    out = dict(session=session, cal_row=Update(visible=cal is None),
               strategy=Update(value="KNN-SSD" if cal else "autoregressive"),
               domain_plot=map_fig(studio, None), layer_plot=layer_fig(studio, None), cost=cost,
               what_if=what_if_fig, batch_plot=batch_view(studio, None), domains_md=text,
               sets_plot=Update(value=sets, visible=cal is not None),
               match_plot=Update(value=match, visible=cal is not None), **now)
    if cal:
        out.update(k=Update(value=cal.router.k), wi_verify=Update(value=what_if_verify(cal)))
    return out


def what_if_verify(cal) -> float:
    """The what-if chart's verify-cost slider starts at the latency model's v for γ = 4 (its range: 1–2.5)."""
    return min(2.5, max(1.0, round(cal.latency.verify_cost(5), 2))) if cal is not None else 1.3


def choose_calibration(studio: Studio, session, name) -> dict:
    """This visitor's calibration (Studio.choices): their next runs route and draft with it, and every
    view of the calibration shows it; other visitors keep theirs. No model runs."""
    session = get_session(session)
    if name not in studio.choices:
        return dict(session=session, cal_info=calibration_info(studio, session.calibration))
    session.calibration = None if studio.choices[name].calibration is studio.calibration else name
    view = studio.for_visitor(session.calibration)
    cal = view.calibration
    text, sets, match = domains_views(view)
    cost, what_if_fig = cost_view(view, None, None)
    return dict(session=session, route=route_view(None), domain_plot=map_fig(view, None),
                layer_plot=layer_fig(view, None), cost=cost, what_if=what_if_fig, batch_plot=batch_view(view, None),
                domains_md=text,
                sets_plot=sets, match_plot=match, k=Update(value=cal.router.k),
                cal_info=calibration_info(studio, name))


def cal_info(studio: Studio, session) -> dict:
    """The chooser's line for this visitor's pick as it is now (after a run built a draft, say)."""
    return dict(cal_info=calibration_info(studio, get_session(session).calibration))


def calibration_info(studio: Studio, name: str | None) -> str:
    """The line under the chooser: what the picked calibration's domains draft with, and bench speed."""
    c = studio.choices.get(name) if name else next(iter(studio.choices.values()), None)
    if c is None:
        return ""
    return (f'<div class="cal-info">{escape(c.line)}<br><span class="cal-mem">Every calibration here drafts '
            f'from the one model: {escape(studio.draft_memory())}.</span></div>')
