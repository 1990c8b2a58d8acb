"""The code's shape, checked: the layers import downwards only (``flows -> tasks -> captioning``), no import cycle at
any level (imports inside functions and ``if TYPE_CHECKING:`` blocks count), and no module over the size bound but
the named exception (in ARCHITECTURE.md, with its reason)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYERS = ("captioning", "tasks", "flows")  # each may import the ones before it, never the ones after
MAX_LINES = 600
#: the modules allowed over the bound (each named in ARCHITECTURE.md's "Large modules" with its reason)
OVER_THE_BOUND = {"captioning/config.py"}


def _modules(root: Path = REPO) -> dict[str, Path]:
    out = {}
    for pkg in LAYERS:
        for p in sorted((root / pkg).rglob("*.py")):
            parts = list(p.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = p
    return out


def _imports(path: Path, name: str, module_level: bool) -> set[str]:
    """Modules ``path`` imports (``from a.b import c`` counts ``a.b`` and ``a.b.c``): at module level only (what
    runs on import; ``if TYPE_CHECKING:`` blocks excluded), or everywhere, function bodies included."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()

    def add(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            add(node)
            if isinstance(node, ast.If | ast.Try | ast.With):
                visit(node.body)
                for h in getattr(node, "handlers", []):
                    visit(h.body)
                visit(getattr(node, "orelse", []) or [])
                visit(getattr(node, "finalbody", []) or [])

    if module_level:
        visit(tree.body)
    else:
        for node in ast.walk(tree):
            add(node)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def _graph(mods: dict[str, Path], module_level: bool) -> dict[str, set[str]]:
    return {m: {i for i in _imports(p, m, module_level) if i in mods and i != m} for m, p in mods.items()}


def _too_long(root: Path = REPO) -> dict[str, int]:
    """Modules of the three layers over :data:`MAX_LINES` lines: relative path -> lines."""
    out = {}
    for p in _modules(root).values():
        n = len(p.read_text(encoding="utf-8").splitlines())
        if n > MAX_LINES:
            out[str(p.relative_to(root))] = n
    return out


def test_cycle_finder_finds_a_planted_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_a_planted_function_level_and_type_checking_circle_is_found(tmp_path):
    """Circles hidden in a function body or a ``TYPE_CHECKING`` block are circles: the module-level graph misses
    them, the graph of every import finds them."""
    lib = tmp_path / "captioning"
    lib.mkdir()
    (lib / "__init__.py").write_text("")
    (lib / "a.py").write_text("def f():\n    from captioning.b import g\n    return g\n")
    (lib / "b.py").write_text("def g():\n    return 1\n\ndef h():\n    from captioning import a\n    return a\n")
    (lib / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from captioning.d import D\n")
    (lib / "d.py").write_text("from captioning.c import x\n")
    mods = _modules(tmp_path)
    assert _cycles(_graph(mods, module_level=True)) == []
    assert _cycles(_graph(mods, module_level=False)) == [["captioning.a", "captioning.b"],
                                                         ["captioning.c", "captioning.d"]]


def test_no_import_cycle_at_any_level():
    assert _cycles(_graph(_modules(), module_level=False)) == []


def test_layers_import_downwards_only():
    """The library never imports tasks or flows, tasks never import flows - not even inside a function."""
    bad = []
    for m, p in _modules().items():
        layer = LAYERS.index(m.split(".")[0])
        for i in _imports(p, m, module_level=False):
            top = i.split(".")[0]
            if top in LAYERS and LAYERS.index(top) > layer:
                bad.append(f"{m} imports {i}")
    assert bad == []


def test_the_size_bound_catches_a_planted_large_module(tmp_path):
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "big.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "tasks" / "small.py").write_text("x = 1\n" * MAX_LINES)
    assert _too_long(tmp_path) == {"tasks/big.py": MAX_LINES + 1}


def test_no_module_over_the_bound_but_the_named_exception():
    text = (REPO / "ARCHITECTURE.md").read_text(encoding="utf-8")
    section = text.split("## Large modules", 1)[1].split("\n## ", 1)[0]
    named = dict(re.findall(r"^- `((?:captioning|tasks|flows)/[^`]+\.py)`: (\S.+)$", section, flags=re.M))
    assert set(named) == OVER_THE_BOUND, "ARCHITECTURE.md's Large modules names the allowed exceptions"
    over = _too_long()
    assert sorted(set(over) - OVER_THE_BOUND) == [], f"modules over {MAX_LINES} lines: {over}"


def test_the_data_stages_do_not_import_torch():
    """Ingest, the vocabulary and the stores are numpy/zarr work: importing them must not load torch (~460 MB of
    resident memory in every data-stage process, measured by `capflow bench scale`)."""
    import subprocess
    import sys

    code = ("import sys, captioning.data.prepare, captioning.data.stores, captioning.data.karpathy, "
            "captioning.data.text, captioning.config; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]", out.stdout


#: where the library may read the pipeline config: the config itself, the plan builders, the workdir layout, the
#: store naming, and the benchmarks (scripts that build their own configs)
CONFIG_READERS = ("captioning/config.py", "captioning/training/recipe.py", "captioning/data/plans.py",
                  "captioning/workdir.py", "captioning/bench/")
CONFIG_NAMING = {("captioning/features/naming.py", "store_uri")}


def test_library_stage_functions_take_plans_not_the_pipeline_config():
    """The config is turned into typed plans in one place (`training/recipe.py`, `data/plans.py`); no other library
    function takes a `PipelineConfig` (by annotation) or a parameter named `cfg` that is one."""
    offenders = []
    for p in sorted((REPO / "captioning").rglob("*.py")):
        rel = str(p.relative_to(REPO))
        if rel.startswith(CONFIG_READERS):
            continue
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or (rel, node.name) in CONFIG_NAMING:
                continue
            for a in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]:
                ann = ast.unparse(a.annotation) if a.annotation is not None else ""
                if "PipelineConfig" in ann or (a.arg == "cfg" and not ann):
                    offenders.append(f"{rel}:{node.lineno} {node.name}({a.arg}: {ann or '?'})")
    assert offenders == []


def test_the_recipe_dag_is_composed_by_jobs_only():
    """Teacher -> SeqKD -> students is put together in one layer: the jobs of `tasks/` (which the flow, `capflow
    train` and `capflow bench learning` call). No library module outside `captioning/training` calls the training
    stages - a benchmark that did would be a second copy of the recipe."""
    offenders = []
    for name, p in _modules().items():
        if not name.startswith("captioning.") or name.startswith("captioning.training"):
            continue
        if any(m.startswith("captioning.training.stages") for m in _imports(p, name, module_level=False)):
            offenders.append(name)
    assert offenders == []


def test_prefect_stays_in_the_orchestration_layer():
    """Only `flows/` imports Prefect (function bodies included): the library and the jobs run without the
    orchestrator. The flow wraps the jobs in its tasks; `capflow train`/`evaluate` and a Dask worker's student job
    (`tasks.fanout.student_on_worker`) import no Prefect."""
    import subprocess
    import sys

    bad = [f"{m} imports {i}" for m, p in _modules().items() if not m.startswith("flows.") and m != "flows"
           for i in _imports(p, m, module_level=False) if i.split(".")[0] == "prefect"]
    assert bad == []
    code = ("import contextlib, io, sys, tasks.training, tasks.fanout, tasks.data, tasks.report, tasks.bench_learning\n"
            "from flows.cli import main\n"
            "for argv in (['train', '--help'], ['evaluate', '--help']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "        main(argv)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'prefect')[:3])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]", out.stdout
