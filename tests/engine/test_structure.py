"""The engine's structure, read from its source: the base layer imports nothing else of ours, the
subfolders import each other without a cycle (imports inside functions counted, type-checking
ones not), and an import of our own modules inside a function says why."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "engine"


def modules(folder: Path = ENGINE) -> dict[str, ast.Module]:
    return {".".join(path.relative_to(ENGINE.parent).with_suffix("").parts).removesuffix(".__init__"):
            ast.parse(path.read_text(), str(path)) for path in sorted(folder.rglob("*.py"))}


def group(module: str) -> str:
    """A subfolder of engine/ (``engine.serve.api`` → ``serve``), or a top-level module itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "engine"


def imports(tree: ast.Module) -> list[tuple[ast.stmt, str, bool]]:
    """(statement, module imported, inside a function) for each import of ours that runs
    (those under ``if TYPE_CHECKING:`` never do)."""
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
               for n in ast.walk(node)}
    inner = {id(n) for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(node) if n is not node}
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] if node.module != "engine" else [f"engine.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found += [(node, name, id(node) in inner) for name in names
                  if name in ("engine", "app") or name.startswith(("engine.", "app."))]
    return found


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one node (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def test_the_base_layer_imports_nothing_of_ours_but_itself():
    outside = [(name, target) for name, tree in modules().items() if group(name) == "base"
               for _, target, _ in imports(tree) if not target.startswith("engine.base")]
    assert not outside


def test_no_import_cycle_between_the_engines_parts():
    edges: dict[str, set[str]] = {}
    for name, tree in modules().items():
        for _, target, _ in imports(tree):
            if group(target) != group(name):
                edges.setdefault(group(name), set()).add(group(target))
    assert cycles(edges) == []
    assert "base" not in edges  # and everything may import it
    # the command line is a client, never a part
    assert not [part for part, targets in edges.items() if "cli" in targets]
    assert edges["models"].isdisjoint({"generation", "serve", "measure"})  # a loaded model is plain data


def test_an_import_of_ours_inside_a_function_says_why():
    """In the engine and the app alike: the usual reason is start-up (the window opens without
    torch, the command line without Qt)."""
    unexplained = []
    for name, tree in (modules() | modules(ENGINE.parent / "app")).items():
        lines = (ENGINE.parent / (name.replace(".", "/") + ".py")).read_text().splitlines() \
            if (ENGINE.parent / (name.replace(".", "/") + ".py")).exists() else \
            (ENGINE.parent / name.replace(".", "/") / "__init__.py").read_text().splitlines()
        for node, target, inside in imports(tree):
            said = "#" in lines[node.end_lineno - 1] or lines[node.lineno - 2].strip().startswith("#")
            if inside and not said:
                unexplained.append(f"{name}:{node.lineno} imports {target}")
    assert not unexplained


def core_drivers(tree: ast.Module) -> list[str]:
    """Calls that make an engine core or step, run, submit to or lend one."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        called = ast.unparse(node.func)
        if called == "EngineCore" or (isinstance(node.func, ast.Attribute) and node.func.attr in DRIVING
                                      and re.search(r"(^|\.)core$", ast.unparse(node.func.value))):
            found.append(called)
    return found


DRIVING = ("step", "stepping", "run", "submit", "borrowed", "reconfigure")


def test_one_road_only_the_engine_service_drives_a_core():
    """Every client of a loaded model (the window served or not, comparison lanes, bench and
    generate, sweeps, speculative runs, the HTTP server) submits to its engine service
    (engine/generation/service.py); nothing else makes, steps or lends an engine core."""
    found = {name: calls for folder in (ENGINE, ENGINE.parent / "app") for name, tree in modules(folder).items()
             if name not in ("engine.generation.service", "engine.generation.core")
             and (calls := core_drivers(tree))}
    assert not found
    sample = ast.parse("core = EngineCore(m)\ncore.step()\nservice.core.borrowed()\nservice.turn()\nrun()")
    assert core_drivers(sample) == ["EngineCore", "core.step", "service.core.borrowed"]


def test_the_window_imports_no_command_line():
    """What the window and the command line both need lives in the layer they share; only the
    launcher, which hands ``inference-workbench bench …`` to the command line, names it."""
    found = [(name, target) for name, tree in modules(ENGINE.parent / "app").items() if name != "app.main"
             for _, target, _ in imports(tree) if target == "engine.cli" or target.startswith("engine.cli.")]
    assert not found


def test_the_checks_see_a_cycle_and_an_unexplained_import():  # the checks above can fail
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    tree = ast.parse("import os\ndef f():\n    from engine.models import loading\n")
    assert [(target, inside) for _, target, inside in imports(tree)] == [("engine.models", True)]
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from engine.serve import api\n")
    assert imports(tree) == []


def test_speculation_is_a_proposer_not_a_branch_of_the_core():
    """The scheduler and the core know a proposer (engine/generation/proposer.py), never
    speculation itself: no name of it in their code, no import of its module."""
    for name in ("core.py", "scheduler.py"):
        tree = ast.parse((ENGINE / "generation" / name).read_text())
        names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
        names |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
        names |= {node.arg for node in ast.walk(tree) if isinstance(node, ast.arg)}
        modules = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not {n for n in names if "speculat" in n.lower() or "draft" in n.lower()}, name
        assert "engine.generation.speculative" not in modules, name


def test_every_dependency_is_pinned_where_the_app_is_installed_and_bundled_from():
    """constraints.txt pins every package the install brings (a release of one can't change the app
    underneath its users, or break the bundle), and the install and CI commands use it."""
    import re
    import tomllib

    root = Path(__file__).resolve().parents[2]
    project = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    wanted = project["dependencies"] + [d for extra in project["optional-dependencies"].values() for d in extra]
    names = {re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0].lower().replace("_", "-") for d in wanted}
    pins = {}
    for line in (root / "constraints.txt").read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not pinned to one version"
            pins[name.lower().replace("_", "-")] = version
    assert not names - pins.keys(), f"not pinned: {sorted(names - pins.keys())}"
    assert "kernels" in pins  # what transformers imports, pinned with it
    assert "-c constraints.txt" in (root / ".ci" / "run").read_text(encoding="utf-8")
    assert (root / "README.md").read_text(encoding="utf-8").count("-c constraints.txt") >= 2


PROCESS_WORDS = re.compile(r"\b(stop|issue|session|sprint|iteration) #?\d+\b|\b(lent|borrowed) (gpu|machine|box)\b"
                           r"|\bwork(ing)? periods?\b", re.IGNORECASE)
"""How the project was made, not what it is: numbered work periods, issue numbers, borrowed machines."""
TEXT = (".py", ".md", ".h", ".cpp", ".sh", ".toml", ".cfg", ".desktop", ".qss", ".txt", ".spec")


def process_words(text: str) -> list[str]:
    return [m.group(0) for m in PROCESS_WORDS.finditer(text)]


def test_the_tree_speaks_only_of_the_product():
    """No file speaks of how the project is developed; the README stays for users (≤ 400 lines,
    the two set-up commands), reference material in docs/."""
    root = ENGINE.parent
    found = {}
    for path in sorted(p for folder in ("engine", "app", "tests", "benchmarks", "docs", "packaging", "resources")
                       for p in (root / folder).rglob("*") if p.suffix in TEXT and p.is_file()):
        if path == Path(__file__).resolve():
            continue
        words = process_words(path.read_text(encoding="utf-8", errors="replace"))
        if words:
            found[str(path.relative_to(root))] = words
    readme = (root / "README.md").read_text(encoding="utf-8")
    assert not found and not process_words(readme), found
    assert len(readme.splitlines()) <= 400
    assert sum(line.startswith("python3 -m venv .venv") for line in readme.splitlines()) == 2  # the two set-up commands
    for doc in ("windows", "cli", "serving", "library", "architecture", "benchmarks"):
        assert f"(docs/{doc}.md)" in readme and (root / "docs" / f"{doc}.md").exists()
    # the check finds what it looks for (samples made from its words, so no file holds them)
    made = [f"{word} {n}" for n, word in enumerate(("Stop", "issue", "session"), 3)] + [" ".join(("borrowed", "GPU"))]
    assert process_words("; ".join(made)) == made


TIMING = re.compile(r"(?<![\w.])~?\d+(?:[.,]\d+)?(?:\s?(?:[-–]|→|to)\s?~?\d+(?:[.,]\d+)?)?\s?"
                    r"(?:ms|µs|us|s|tok/s|tokens/s|GB/s|GiB/s)(?![\w/])")


def timings(doc: str) -> list[str]:
    """Durations and rates a docstring states, leaving out quoted examples of what a window shows."""
    return TIMING.findall(re.sub(r'"[^"\n]*"', "", doc))


def test_no_docstring_quotes_one_runs_timings():
    """A figure measured once goes stale with the next CPU or change: a docstring says why and
    names the benchmark that measures it (docs/benchmarks.md holds the current figures)."""
    found = {}
    for folder in ("engine", "app", "tests"):
        for path in sorted((ENGINE.parent / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    if said := timings(ast.get_docstring(node, clean=False) or ""):
                        found[f"{path.relative_to(ENGINE.parent)}:{getattr(node, 'lineno', 1)}"] = said
    assert not found, found
    assert timings("took ~0.12 ms of a 7.7 ms step; 28 → 17.5 tokens/s, 20-26 µs") == ["~0.12 ms", "7.7 ms",
                                                                                      "28 → 17.5 tokens/s", "20-26 µs"]
    assert timings('the title reads "184 ms"; a 2 × 2 grid, 1.8× as long') == []
