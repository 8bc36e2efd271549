"""The import graph: no circles among the project's modules, the engine at the bottom, no UI in the core.

A static scan (ast) of every import statement, function-level ones included (a lazy import must not
hide a circle), plus one fresh interpreter that imports every module.
"""
import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ssd_core", "viz")
# circles another change is removing (viz/studio.py ↔ viz/handlers.py, Space-safety work): delete the
# entry when it lands; any other circle fails
KNOWN_CIRCLES: list[set] = []


def modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imported(name: str, path: Path, known: dict) -> set[str]:
    """The project modules `name` imports anywhere in its file (`from a import b`: a.b when b is a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
                break
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported(name, path, known) for name, path in known.items()}


def circles(edges: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative enough for ~80 nodes)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_the_scan_finds_a_circle_and_reads_relative_imports():
    """The checks below can fail: a made-up circle is found, and `from ..a import b` resolves."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    edges = graph()
    assert "ssd_core.engine.skipset" in edges["ssd_core.engine.backbone"]           # from .skipset import …
    assert "ssd_core.engine.loading" in edges["ssd_core.calibration.artifact"]     # from ..engine.loading …


def test_no_import_circles():
    found = [c for c in circles(graph()) if c not in KNOWN_CIRCLES]
    assert not found, f"import circles: {found}"


def test_the_engine_imports_nothing_above_it():
    above = ("ssd_core.calibration", "ssd_core.policies", "ssd_core.tools", "viz")
    bad = {m: sorted(t for t in ts if t.startswith(above))
           for m, ts in graph().items() if m.startswith("ssd_core.engine")}
    assert not any(bad.values()), {m: t for m, t in bad.items() if t}


def test_the_core_imports_no_ui_and_every_module_imports():
    """Statically: no gradio / plotly import in ssd_core. Then a fresh interpreter imports every module
    of ssd_core (still no gradio / plotly loaded) and then every module of viz."""
    for name, path in modules().items():
        if name.startswith("ssd_core"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                assert not [n for n in names if n.split(".")[0] in ("gradio", "plotly")], (name, names)
    core = [m for m in modules() if m.startswith("ssd_core")]
    views = [m for m in modules() if m.startswith("viz")]
    code = ("import importlib, sys\n"
            f"for m in {core!r}: importlib.import_module(m)\n"
            "ui = sorted(m for m in ('gradio', 'plotly') if m in sys.modules)\n"
            "assert not ui, f'the core loaded {ui}'\n"
            f"for m in {views!r}: importlib.import_module(m)\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


FAKE_IPYTHON = "import os\nwith open(os.environ['IPYTHON_IMPORTS'], 'a') as f:\n    f.write('IPython\\n')\n"


def test_the_app_script_keeps_gradio_from_importing_ipython(tmp_path):
    """`python app.py` marks IPython absent before gradio would import it for notebook magics (0.6 s of
    a warm start-up where IPython is installed); gradio's ImportError fallbacks take over. A stand-in
    IPython package first on the path records every import of it, whether IPython is installed or not:
    a plain `import gradio` imports it (else the trick in app.py is pointless: remove it), `python
    app.py` does not."""
    (tmp_path / "site" / "IPython").mkdir(parents=True)
    (tmp_path / "site" / "IPython" / "__init__.py").write_text(FAKE_IPYTHON)
    imports = tmp_path / "imports.txt"
    env = {**os.environ, "IPYTHON_IMPORTS": str(imports),
           "PYTHONPATH": os.pathsep.join(p for p in (str(tmp_path / "site"), os.environ.get("PYTHONPATH")) if p)}

    def imported_ipython(code: str) -> bool:
        imports.unlink(missing_ok=True)
        run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        return imports.exists()

    assert imported_ipython("import gradio"), "gradio no longer imports IPython: drop the trick in app.py"
    assert not imported_ipython("import runpy, sys\n"
                                "sys.argv = ['app.py', '--help']\n"
                                "try:\n    runpy.run_path('app.py', run_name='__main__')\nexcept SystemExit:\n    pass\n"
                                "assert 'gradio' in sys.modules\n"), "python app.py imported IPython"
