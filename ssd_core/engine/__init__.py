"""The engine: weights (weights.py), the KV cache, the forward (backbone.py), loading, prompt encoding,
skip sets, cheap drafts behind one factory (draft.py, drafts.py), the strategy interface (strategy.py),
the decode loop and its events. It imports nothing from calibration, policies, tools or viz
(tests/test_imports.py); it knows the strategy interface, not any strategy."""
