"""Pure views for KNN-SSD Studio: decode events and results → HTML strings and plotly figures.

No Gradio here; every function takes plain data (ssd_core events, dicts, arrays) and returns a view,
so the app, the tests and the benchmark page share them. Import the submodules directly.
"""
