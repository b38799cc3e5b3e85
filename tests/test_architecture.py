"""The house stays drawn (issue 21's "Done when"): small modules, a small composition root, and no
import cycle among gpuagent's modules, type-only imports included.

- No module over :data:`MODULE_LIMIT` lines, except the generated gRPC code in gpuagent/_proto/.
- No module of gpuagent/app/ (the composition root) over :data:`APP_LIMIT` lines.
- No cycle in the graph of gpuagent's imports as grimp (import-linter's graph) builds it: every
  import statement, inside functions and under ``if TYPE_CHECKING:`` too (checked below against
  the source's own ``TYPE_CHECKING`` blocks, so a grimp that skipped them would fail this file).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping, Set
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gpuagent"
MODULE_LIMIT = 450
APP_LIMIT = 250
#: Generated code, not ours to size (scripts/gen-protos writes it).
EXEMPT = (PACKAGE / "_proto",)


def modules() -> list[Path]:
    return sorted(
        path for path in PACKAGE.rglob("*.py") if not any(path.is_relative_to(e) for e in EXEMPT)
    )


def lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def oversized(paths: list[Path], limit: int, root: Path = ROOT) -> dict[str, int]:
    """The modules of ``paths`` over ``limit`` lines, with their sizes."""
    sizes = {str(path.relative_to(root)): lines(path) for path in paths}
    return {name: size for name, size in sizes.items() if size > limit}


def cycles(edges: Mapping[str, Set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing
    itself): each is at least one import cycle (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)

    for start in sorted(edges):
        if start in index:
            continue
        visit(start)
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(edges[start])))]
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    visit(nxt)
                    work.append((nxt, iter(sorted(edges.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component: list[str] = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in edges.get(node, ()):
                        found.append(sorted(component))
    return found


def import_edges(graph: grimp.ImportGraph) -> dict[str, set[str]]:
    return {module: graph.find_modules_directly_imported_by(module) for module in graph.modules}


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("gpuagent", cache_dir=None)


def type_checking_imports(path: Path) -> Iterator[tuple[str, ...]]:
    """The imports under ``if TYPE_CHECKING:`` in ``path`` (absolute ones), each as the modules
    it may name: ``from a import b`` imports ``a.b`` where that is a module, else ``a``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for statement in node.body:
                if (
                    isinstance(statement, ast.ImportFrom)
                    and statement.module
                    and not statement.level
                ):
                    module = statement.module
                    yield from ((f"{module}.{alias.name}", module) for alias in statement.names)
                elif isinstance(statement, ast.Import):
                    yield from ((alias.name,) for alias in statement.names)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_module_over_the_limit() -> None:
    assert oversized(modules(), MODULE_LIMIT) == {}


def test_the_composition_root_stays_small() -> None:
    app = [path for path in modules() if path.is_relative_to(PACKAGE / "app")]
    assert app, "gpuagent/app/ has no modules: the check would pass vacuously"
    assert oversized(app, APP_LIMIT) == {}


def test_the_size_checks_see_an_oversized_module(tmp_path: Path) -> None:
    big = tmp_path / "big.py"
    big.write_text("x = 1\n" * (MODULE_LIMIT + 1), encoding="utf-8")
    small = tmp_path / "small.py"
    small.write_text("x = 1\n" * MODULE_LIMIT, encoding="utf-8")
    assert oversized([big, small], MODULE_LIMIT, tmp_path) == {"big.py": MODULE_LIMIT + 1}


def test_no_import_cycle(graph: grimp.ImportGraph) -> None:
    assert len(graph.modules) == len(list(PACKAGE.rglob("*.py")))
    assert cycles(import_edges(graph)) == []


def test_the_graph_counts_type_only_imports(graph: grimp.ImportGraph) -> None:
    seen = 0
    for path in modules():
        importer = module_name(path)
        for names in type_checking_imports(path):
            if not names[0].startswith("gpuagent."):
                continue
            seen += 1
            imported = next(name for name in names if name in graph.modules)
            assert graph.direct_import_exists(importer=importer, imported=imported), (
                importer,
                imported,
            )
    assert seen > 0, "no TYPE_CHECKING import of gpuagent found: the check would pass vacuously"


@pytest.mark.parametrize(
    ("imports", "expected"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"a"}}, [["a"]]),
        ({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}, [["a", "b"], ["c", "d"]]),
    ],
)
def test_cycles_are_found(imports: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert sorted(cycles(imports)) == expected


def test_a_type_only_import_cycle_is_found() -> None:
    graph = grimp.ImportGraph()
    for module in ("pkg.a", "pkg.b"):
        graph.add_module(module)
    graph.add_import(importer="pkg.a", imported="pkg.b")
    graph.add_import(importer="pkg.b", imported="pkg.a")  # as under TYPE_CHECKING
    assert cycles(import_edges(graph)) == [["pkg.a", "pkg.b"]]
