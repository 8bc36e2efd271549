"""The plain API (`/generate_text`), without Gradio: one whole answer and its stats for gradio_client, the
load test and the tests; and the one sentence every handler shows when the model fails on a request."""
from __future__ import annotations

import logging

from ssd_core.engine.generate import generate as core_generate
from viz.studio import (DEFAULT_DRAFT_LABEL, STRATEGY_OF_LABEL, Studio, clean_prompt, make_config, make_strategy,
                        problem, public_message)

log = logging.getLogger("knn-ssd-studio")


def generate_text(studio: Studio, prompt: str, strategy: str = "KNN-SSD", max_new_tokens: float = 64,
                  gamma: float = 4, threshold: float = 0.0, temperature: float = 0.0,
                  top_p: float = 1.0, draft: str = DEFAULT_DRAFT_LABEL, seed=None, calibration: str = "") -> dict:
    """The plain API: one whole answer and its stats (gradio_client, the load test and tests).

    calibration: one of Studio.choices by name (blank: the served one).
    Bad input never raises: the answer is {"error": message} and the server keeps serving.
    """
    if calibration and calibration not in studio.choices:
        return {"error": f"unknown calibration {str(calibration)[:60]!r}; choose from {', '.join(studio.choices)}"}
    studio = studio.for_visitor(calibration or None)
    err, cfg = problem(prompt, lambda: make_config(max_new_tokens, gamma, threshold, temperature, top_p, draft,
                                                   seed, max_new_cap=studio.limits.max_new_tokens))
    if err:
        return {"error": err}
    name = STRATEGY_OF_LABEL.get(strategy, strategy if strategy in STRATEGY_OF_LABEL.values() else None)
    if name is None:
        return {"error": f"unknown strategy {str(strategy)[:40]!r}; choose from {', '.join(STRATEGY_OF_LABEL)}"}
    if studio.calibration is None:
        name = "ar"
    try:
        with studio.quiet.job():
            g = core_generate(studio.backbone, clean_prompt(prompt).strip(),
                              make_strategy(studio, name, cfg.gamma, 5, None, cfg.draft), cfg)
    except Exception as exc:        # the model failed on this request: say so, keep serving
        log.exception("generate_text failed")
        return {"error": model_failed(exc)}
    st = g.stats
    return {"text": g.text, "strategy": name, "new_tokens": st.new_tokens, "tau": round(st.tau, 3),
            "alpha": round(st.alpha, 3), "tokens_per_s": round(st.tokens_per_s, 2),
            "truncated": g.start.truncated, "domain": g.start.domain, "seed": cfg.seed,
            "calibration": studio.cal_folder.name if studio.calibration is not None else None}


def model_failed(exc: Exception) -> str:
    """What a visitor reads when decoding raised: the error in one line, no traceback, no server paths."""
    return f"The model failed on this request ({type(exc).__name__}: {public_message(str(exc))[:300]})."
