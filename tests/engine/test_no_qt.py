import subprocess
import sys

CHECK = """
import importlib, pkgutil, sys
import engine
for module in pkgutil.walk_packages(engine.__path__, "engine."):
    importlib.import_module(module.name)
qt = sorted(m for m in sys.modules if m.split('.')[0] in ('PySide6', 'PyQt5', 'PyQt6', 'shiboken6', 'pyqtgraph'))
print(','.join(qt))
"""


def test_importing_the_engine_loads_no_qt():
    result = subprocess.run([sys.executable, "-c", CHECK],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""


def test_a_generation_loads_no_qt(tiny_llama):
    code = (
        "import sys\n"
        "from engine.models.loading import LoadRequest, load_model\n"
        "from engine.base.request import GenerationRequest\n"
        "from engine.generation.generate import generate\n"
        f"m = load_model(LoadRequest({str(tiny_llama)!r}, 'fp32', 'cpu'))\n"
        "list(generate(m, GenerationRequest('fox', mode='raw', max_new_tokens=2)))\n"
        "print(','.join(sorted(n for n in sys.modules if n.split('.')[0] in ('PySide6', 'shiboken6', 'pyqtgraph'))))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1:] in ([], [""])


def _imports(package: str = "engine") -> dict[str, set[str]]:
    """module of ``package`` → the modules (and top-level packages) it imports anywhere in its
    code (function-level imports too), leaving out ``if TYPE_CHECKING:`` blocks, which never run."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / package
    graph: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        name = ".".join((package,) + path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING"
                   for n in ast.walk(node)}
        found: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                if node.module in ("engine", "app"):
                    found |= {f"{node.module}.{alias.name}" for alias in node.names}
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
        graph[name] = found
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    """The modules of ``graph`` that import themselves through others."""
    edges = {name: {d for d in deps if d in graph and d != name} for name, deps in graph.items()}

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            for nxt in edges[todo.pop()]:
                if nxt == goal:
                    return True
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return False

    return sorted(name for name in graph if reaches(name, name))


def test_engine_imports_neither_the_app_nor_itself_in_a_cycle():
    graph = _imports("engine")
    outside = {name: sorted(m for m in deps if m.split(".")[0] in ("app", "PySide6", "pyqtgraph", "shiboken6"))
               for name, deps in graph.items()}
    assert not any(outside.values()), {k: v for k, v in outside.items() if v}
    cycles = _cycles(graph)
    assert not cycles, f"engine modules in an import cycle: {cycles}"


def test_the_app_has_no_import_cycles():
    cycles = _cycles(_imports("app"))
    assert not cycles, f"app modules in an import cycle: {cycles}"
