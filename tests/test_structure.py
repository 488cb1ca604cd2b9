"""The package's shape: floors that import only downward, no import cycle, and no module too long to read in one sitting."""

import ast
import shutil
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ulysses_lc"
MAX_LINES = 400  # a module is one idea, read in one sitting


def _module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, package: Path = PACKAGE) -> set[str]:
    """ulysses_lc modules `path` imports anywhere (module level or inside functions)."""
    name = _module_name(path, package)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "ulysses_lc":
                continue
            if node.module:
                found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)  # `from . import x` imports x
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "ulysses_lc")
    return found


def _graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    modules = {_module_name(p, package): p for p in package.rglob("*.py")}
    return {name: {t for t in _imports(path, package) if t in modules and t != name} for name, path in modules.items()}


def _cycle(graph):
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle():
    graph = _graph()
    assert "ulysses_lc.levers.checkpointing" in graph["ulysses_lc.plan.memory"]  # the parse sees the package's imports
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_modules_are_short():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by concern): {long}"


# The floors, lowest first (the package docstring draws the same map). A module imports its own part and the parts on
# lower floors only; two parts on one floor (mixers and levers, plan and data) never import each other.
FLOORS = {
    "ground": 0,  # the top-level modules below: import nothing of the package but each other
    "parallel": 1,
    "mixers": 2,
    "levers": 2,
    "objectives": 3,
    "plan": 4,
    "data": 4,
    "model": 5,  # model.py
    "integrations": 6,
    "eval": 6,  # evaluation at length: the main job runs it
    "train": 7,
    "eval_command": 8,  # ulysses-lc-eval: the evaluation of model folders, loading them as the main job does
}
GROUND = {"constants", "handle", "layers", "shape", "composite", "recompute", "tiny", "peft_support", "moved"}
# Modules standing on a floor of their own, above their folder's: the command of a part the main job also uses.
COMMANDS = {"eval.cli": "eval_command", "eval.__main__": "eval_command"}


def _part(module: str) -> str | None:
    """The part a module belongs to; None for the package's face (ulysses_lc/__init__.py hands names on)."""
    parts = module.split(".")[1:]
    if not parts:
        return None
    if len(parts) == 1 and parts[0] in GROUND:
        return "ground"
    if ".".join(parts) in COMMANDS:
        return COMMANDS[".".join(parts)]
    if parts == ["model"]:
        return "model"
    if parts[0] in FLOORS and parts[0] not in ("ground", "model"):
        return parts[0]
    raise AssertionError(f"{module} stands on no floor: put it in a subpackage, or add it to FLOORS / GROUND here")


def _imports_up(graph) -> list[str]:
    bad = []
    for a, targets in sorted(graph.items()):
        pa = _part(a)
        for b in sorted(targets):
            pb = _part(b)
            if pa is None or pb is None or pa == pb:
                continue  # the face may import anything; nothing may import the face (caught as a cycle)
            if FLOORS[pb] >= FLOORS[pa]:
                bad.append(f"{a} ({pa}, floor {FLOORS[pa]}) imports {b} ({pb}, floor {FLOORS[pb]})")
    return bad


def test_floors_import_only_downward():
    graph = _graph()
    assert "ulysses_lc.parallel.layout" in graph["ulysses_lc.parallel.exchange"]  # the parse sees the imports
    assert not _imports_up(graph), "imports that run up or sideways:\n" + "\n".join(_imports_up(graph))


def test_a_planted_upward_import_is_caught(tmp_path):
    """The rule is read from the source: plant imports that run up and sideways in a copy of the package."""
    copy = tmp_path / "ulysses_lc"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    exchange = copy / "parallel" / "exchange.py"
    exchange.write_text(exchange.read_text() + "\n\ndef _planted():\n    from ..plan import memory  # noqa: F401\n")
    kernels = copy / "mixers" / "kernels.py"
    kernels.write_text(kernels.read_text() + "\nfrom ..levers.yarn import apply_yarn  # noqa: F401,E402\n")
    bad = _imports_up(_graph(copy))
    assert any(b.startswith("ulysses_lc.parallel.exchange (parallel") and "ulysses_lc.plan.memory" in b for b in bad), bad
    assert any(b.startswith("ulysses_lc.mixers.kernels (mixers") and "levers.yarn" in b for b in bad), bad
    assert all(b.startswith(("ulysses_lc.parallel.exchange ", "ulysses_lc.mixers.kernels ")) for b in bad), bad


def test_every_module_stands_on_a_floor():
    for module in _graph():
        _part(module)  # raises for a module placed nowhere


def test_each_subpackage_says_what_it_holds_and_may_import():
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert doc, f"{init.relative_to(PACKAGE.parent)} has no docstring saying what it holds"
        if init.parent.name in ("parallel", "mixers", "levers", "objectives", "plan", "integrations"):
            assert "Imports:" in doc, f"{init.relative_to(PACKAGE.parent)} does not say what it may import"
