"""The layering the README's architecture paragraph describes, checked on the source: the three
services are peers on top of the shared `tandem` package, none importing another, and `tandem`
imports none of them. Inside `tandem`, the engine and the speculation rules import no service
plumbing or cluster code."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
SERVICES = ("gateway", "draft_worker", "verify_worker")


def imported(package: str) -> dict[str, set[str]]:
    """Top-level names each module of `package` imports (absolute imports, also inside functions)."""
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
        out[str(path.relative_to(ROOT))] = names
    return out


def offenders(package: str, forbidden: tuple[str, ...]) -> list[str]:
    return [f"{module} imports {name}" for module, names in imported(package).items() for name in sorted(names)
            if name.split(".")[0] in forbidden or name.startswith(tuple(f + "." for f in forbidden))]


@pytest.mark.parametrize("service", SERVICES)
def test_services_do_not_import_each_other(service):
    assert offenders(service, tuple(s for s in SERVICES if s != service)) == []


def test_the_shared_package_imports_no_service():
    assert offenders("tandem", SERVICES) == []


@pytest.mark.parametrize("layer", ["tandem/engine", "tandem/speculation"])
def test_engine_and_speculation_import_no_plumbing(layer):
    assert offenders(layer, ("tandem.service", "tandem.cluster")) == []


def test_the_check_sees_imports():
    """The checks above can fail: this module's own imports are seen."""
    assert "ast" in imported("tests")["tests/test_architecture.py"]


LONG = 300


def test_long_modules_say_why():
    """A module over 300 lines says in its docstring why it is longer (generated code aside)."""
    silent = []
    for package in (*SERVICES, "tandem", "bench"):
        for path in sorted((ROOT / package).rglob("*.py")):
            text = path.read_text()
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")) or text.count("\n") <= LONG:
                continue
            doc = ast.get_docstring(ast.parse(text)) or ""
            if f"Longer than {LONG} lines because" not in doc:
                silent.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines")
    assert silent == []


def module_graph() -> dict[str, set[str]]:
    """Module name -> the house's modules it imports (TYPE_CHECKING imports included: a cycle hidden
    from the interpreter is still a circle in the design)."""
    names = {}
    for package in (*SERVICES, "tandem"):
        for module, imports in imported(package).items():
            names[module.removesuffix(".py").removesuffix("/__init__").replace("/", ".")] = imports
    return {m: {i for i in imports if i in names and i != m} for m, imports in names.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle, found by depth-first search (each reported once, from its least module)."""
    found, path = [], []

    def visit(node: str) -> None:
        if node in path:
            cycle = path[path.index(node):] + [node]
            if cycle[0] == min(cycle) and cycle not in found:
                found.append(cycle)
            return
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt >= path[0]:
                visit(nxt)
        path.pop()

    for start in sorted(graph):
        visit(start)
    return found


def test_no_module_imports_itself_through_others():
    assert cycles(module_graph()) == []


def test_the_cycle_check_can_fail():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
