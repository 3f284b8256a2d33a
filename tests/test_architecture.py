"""The package's shape, checked from its source: no import cycle between subpackages (imports inside
functions and under TYPE_CHECKING included), command-line code only in `piattn.commands` / `piattn.cli`, and
nothing but the CLI imports the commands (the experiments and benchmarks included)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import piattn

SRC = Path(piattn.__file__).parent
ROOT = Path(__file__).resolve().parents[1]
# Scripts outside the package that use it as a library.
SCRIPT_FOLDERS = ("experiments", "benchmarks")
# Modules of the package root that sit above every subpackage (entry points), and the root itself.
TOP = {"cli", "__main__"}


def module_name(path: Path) -> str:
    parts = ["piattn", *path.relative_to(SRC).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    """Whether the dotted name is a module or package of piattn."""
    rel = Path(*name.split(".")[1:])
    return name.startswith("piattn.") and ((SRC / rel).is_dir() or (SRC / rel).with_suffix(".py").is_file())


def imported_modules(path: Path) -> set[str]:
    """Every piattn module `path` (a module of the package or a script) imports, anywhere in the file, as
    absolute dotted names."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: only inside the package
                name = module_name(path)
                base = (name if path.name == "__init__.py" else name.rsplit(".", 1)[0]).split(".")
                base = base[: len(base) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module
            # `from pkg import sub` imports the submodule when there is one, else a name defined in pkg
            found |= {f"{origin}.{alias.name}" if is_module(f"{origin}.{alias.name}") else origin
                      for alias in node.names}
    return {m for m in found if m == "piattn" or m.startswith("piattn.")}


def unit(module: str) -> str | None:
    """The node of the graph a module belongs to: its first-level subpackage or root module."""
    parts = module.split(".")
    if len(parts) == 1:
        return "piattn"
    first = parts[1]
    if (SRC / first).is_dir() or (SRC / f"{first}.py").is_file():
        return first
    return "piattn"  # a name defined in piattn/__init__.py


def dependency_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        source = unit(module_name(path))
        targets = {unit(m) for m in imported_modules(path)} - {source, None}
        graph.setdefault(source, set()).update(targets)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on_stack, result, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                result.append(component)

    for v in list(graph):
        if v not in index:
            visit(v)
    return result


def test_the_checker_sees_a_cycle_when_there_is_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert cycles({"a": {"b"}, "b": set()}) == []


def module_graph() -> dict[str, set[str]]:
    """Module -> the modules of piattn it imports (anywhere in the file), a name resolved to its module."""
    modules = {module_name(path): path for path in SRC.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in imported_modules(path):
            parts = imported.split(".")
            while ".".join(parts) not in modules:
                parts.pop()
            targets.add(".".join(parts))
        graph[name] = targets - {name}
    return graph


def test_modules_import_each_other_without_cycles():
    """Not even through an import inside a function: a circle between modules is one module in two files."""
    assert cycles(module_graph()) == []


def test_subpackages_import_each_other_without_cycles():
    graph = dependency_graph()
    assert {"ops", "layers", "models", "train", "tasks", "commands", "config"} <= set(graph)
    assert cycles(graph) == []


# The packages at the bottom: pure functions of their arguments, importing nothing of piattn above them.
FOUNDATIONS = {"checks": set(), "safe_files": set(), "masks": {"checks"},
               "analysis": {"masks", "checks", "safe_files"}}


def test_configuration_stands_on_the_foundations_only():
    """The configuration may import the foundations (the period schedules live in the reach analysis) and
    nothing above them, so any config works whatever else was imported."""
    graph = dependency_graph()
    assert graph["config"] <= set(FOUNDATIONS)
    for package, below in FOUNDATIONS.items():
        assert graph[package] <= below, package


def test_a_bare_configuration_resolves_every_period_form():
    """In a fresh interpreter that imports only the configuration: per-head, per-layer and scheduled periods."""
    code = ("from piattn.config import GPTConfig\n"
            "assert GPTConfig(n_layer=2, n_head=4, period=[8, 16, 32, 64]).period == [8, 16, 32, 64]\n"
            "assert GPTConfig(n_layer=2, n_head=4, period=[[8] * 4, [16] * 4]).period == [[8] * 4, [16] * 4]\n"
            "assert len(GPTConfig(n_layer=2, n_head=4, period='geometric:8').period) == 4\n"
            "import sys; assert 'piattn.models' not in sys.modules and 'piattn.layers' not in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_nothing_but_the_cli_imports_the_commands():
    """The commands parse and print; what they compute lives in library modules, which the package's other
    modules, the experiments and the benchmarks import instead (a command's own tests may import it)."""
    library = [path for path in SRC.rglob("*.py") if unit(module_name(path)) not in {"commands", *TOP}]
    scripts = [path for folder in SCRIPT_FOLDERS for path in sorted((ROOT / folder).rglob("*.py"))]
    assert scripts, f"no scripts found under {ROOT}"
    importers = [str(path) for path in library + scripts
                 if any(m == "piattn.commands" or m.startswith("piattn.commands.") for m in imported_modules(path))]
    assert importers == []


def test_command_line_code_lives_in_commands_only():
    """No library module defines a subcommand (`add_arguments` + `run`) or parses a command line. (The
    training flags are declared in `piattn.config`, which builds parser arguments from them but parses
    nothing.)"""
    offenders = []
    for path in SRC.rglob("*.py"):
        if unit(module_name(path)) in {"commands", *TOP}:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        calls = {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
        if {"add_arguments", "run"} <= names or "parse_args" in calls:
            offenders.append(str(path.relative_to(SRC)))
    assert offenders == []
