"""Measurement tools: the Spec-Bench benchmark, context scaling, the core and kernel micro-benchmarks.

They write data (JSON, JSONL) only; `python -m viz.bench_figures DIR` renders tables and figures.
"""
