"""Gradio's side of the handlers: the one adapter from their named outputs to Gradio's positional ones
(`wired`), and the queue's door (`gate_per_visitor`, `upload_forgetter`). app.py declares the layout and
connects every event through `wired`; the handlers themselves (viz.*handlers) never import Gradio.
"""
from __future__ import annotations

import inspect
from functools import partial

import gradio as gr
from gradio import processing_utils

from viz.limits import UPLOAD_GRACE_S, LaterDelete, busy_message, forget_upload
from viz import api_handlers as api
from viz.studio import DEFAULT_DRAFT_LABEL, Update


def outputs(named: dict, names) -> tuple | object:
    """The values for `names` in order: a name not given stays as it is (gr.skip()), an Update becomes
    gr.update(...). One name gives the bare value, as Gradio expects for a single output."""
    def one(name):
        if name not in named:
            return gr.skip()
        value = named[name]
        return gr.update(**value.changes()) if isinstance(value, Update) else value
    values = tuple(one(n) for n in names)
    return values[0] if len(values) == 1 else values


def _call(handler, names, *args, **kwargs):
    return outputs(handler(*args, **kwargs), names)


def _stream(handler, names, *args, **kwargs):
    for named in handler(*args, **kwargs):
        yield outputs(named, names)


def wired(handler, names, *args, **kwargs):
    """`handler` (with `args`/`kwargs` bound first) as a Gradio event function for the outputs `names`."""
    fn = partial(_stream if inspect.isgeneratorfunction(handler) else _call, handler, tuple(names), *args,
                 **kwargs)
    if args or kwargs or inspect.isgeneratorfunction(handler):
        return fn

    def named(*a, **kw):
        return fn(*a, **kw)
    named.__name__ = handler.__name__        # an unbound handler keeps its name as the event's API name
    return named



# --- what a public server must not let one visitor do -------------------------------------------------
def upload_forgetter(delay_s: float = UPLOAD_GRACE_S):
    """For an uploaded trace once read: delete Gradio's copy (its folder is named by Gradio's hash of the
    bytes) `delay_s` later; 0 deletes at once."""
    later = LaterDelete(delay_s) if delay_s > 0 else forget_upload
    return lambda content: later(processing_utils.hash_bytes(content))


def gate_per_visitor(queue, cap: int) -> None:
    """At most `cap` events of one visitor (a browser session or an API client) queued or running at once;
    one more is refused at the queue's door with a sentence (HTTP 400 to an API client, a toast in the page)."""
    push = queue.push

    async def gated(body, request, username=None):
        mine = body.session_hash
        held = sum(e.session_hash == mine for q in queue.event_queue_per_concurrency_id.values() for e in q.queue)
        held += sum(e.session_hash == mine for jobs in queue.active_jobs if jobs for e in jobs)
        if mine is not None and held >= cap:
            return False, busy_message(held, cap), "error"
        return await push(body, request, username)
    queue.push = gated


def register_apis(studio, rows: int) -> None:
    """The plain API beside the page's events: `/generate_text` (one whole answer, in the model's lane of
    `rows`) and `/engine_status` (the serving engine's rows, queue and KV memory, outside the queue: the load
    tests read it). Gradio reads each endpoint's inputs and output from its signature."""
    def generate_text_api(prompt: str, strategy: str = "KNN-SSD", max_new_tokens: float = 64, gamma: float = 4,
                          threshold: float = 0.0, temperature: float = 0.0, top_p: float = 1.0,
                          draft: str = DEFAULT_DRAFT_LABEL, seed: float | None = None, calibration: str = "") -> dict:
        return api.generate_text(studio, prompt, strategy, max_new_tokens, gamma, threshold, temperature, top_p,
                                 draft, seed, calibration)
    gr.api(generate_text_api, api_name="generate_text", concurrency_limit=rows, concurrency_id="model")

    def engine_status() -> dict:
        engine = studio.engine
        return engine.status() if engine is not None else {}
    gr.api(engine_status, api_name="engine_status", queue=False, api_visibility="undocumented")
