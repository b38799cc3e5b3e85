"""The house stays drawn (issue 21's "Done when"): small modules, a small composition root, and no
import cycle among gpuagent's modules, type-only imports included; and issue 33's measurable parts.

- No module over :data:`MODULE_LIMIT` lines, except the generated gRPC code in gpuagent/_proto/.
- No module of gpuagent/app/ (the composition root) over :data:`APP_LIMIT` lines.
- No function of gpuagent/ over :data:`FUNCTION_LIMIT` lines, counted from its ``def`` to its
  last line; at most :data:`ROOT_MODULE_LIMIT` loose modules at the package root (the rest lives
  in the rooms); no module of the suite over :data:`TEST_MODULE_LIMIT` (tests, conftests and their
  helpers alike). None of them has an exception.
- No import circle among the scripts' modules, and no script in Python that ruff and mypy skip
  (a name without ``.py``).
- No cycle in the graph of gpuagent's imports as grimp (import-linter's graph) builds it: every
  import statement, inside functions and under ``if TYPE_CHECKING:`` too (checked below against
  the source's own ``TYPE_CHECKING`` blocks, so a grimp that skipped them would fail this file).
- One way to wait for a change or a time (issue 33): a store watch with a deadline
  (``Watch.next``). No ``repeat_after`` or ``next_change`` (the variants it replaced), and no
  ``anext()`` of a watch under ``asyncio.timeout``/``timeout_at``/``wait_for`` (a second way).
- One backoff (issue 33): ``domain/backoff.py``'s :class:`Backoff`, the only class of that name,
  and the only code that doubles a wait: no ``2 ** n``, ``x *= 2`` or ``min(... x * 2 ...)``
  elsewhere (looked for in the code, not its words).
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
#: The one backoff, and where it lives.
BACKOFF = PACKAGE / "domain" / "backoff.py"
#: Names of the ways to wait that the store watch's deadline replaced.
RETIRED_WAITS = frozenset({"repeat_after", "next_change"})
_TIMEOUTS = frozenset({"timeout", "timeout_at", "wait_for"})


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


# ----- functions, test modules, root modules, scripts (issue 33) ---------------------------------
FUNCTION_LIMIT = 60
TEST_MODULE_LIMIT = 600
ROOT_MODULE_LIMIT = 4
TESTS = ROOT / "tests"
SCRIPTS = ROOT / "scripts"


def functions(
    node: ast.AST, prefix: str = ""
) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function under ``node`` with its qualified name (``Class.method``, ``outer.inner``)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            yield prefix + child.name, child
            yield from functions(child, f"{prefix}{child.name}.")
        elif isinstance(child, ast.ClassDef):
            yield from functions(child, f"{prefix}{child.name}.")
        else:
            yield from functions(child, prefix)


def long_functions(paths: list[Path], limit: int, root: Path = ROOT) -> dict[str, int]:
    """``path:qualified.name`` of each function of ``paths`` over ``limit`` lines, from its
    ``def`` (below its decorators) to its last line, with its length."""
    found = {}
    for path in paths:
        for name, node in functions(ast.parse(path.read_text(encoding="utf-8"))):
            size = (node.end_lineno or node.lineno) - node.lineno + 1
            if size > limit:
                found[f"{path.relative_to(root)}:{name}"] = size
    return found


def test_no_function_over_the_limit() -> None:
    assert long_functions(modules(), FUNCTION_LIMIT) == {}, "split it by what each step owns"


def test_the_function_check_sees_a_long_function(tmp_path: Path) -> None:
    """Counted from the ``def``, not the decorator; methods and nested functions by name."""
    body = "        x = 1\n"
    source = (
        "class A:\n    @staticmethod\n    def long() -> None:\n" + body * FUNCTION_LIMIT
        + "    @staticmethod\n    def fits() -> None:\n" + body * (FUNCTION_LIMIT - 1)
        + "async def outer() -> None:\n    def inner() -> None:\n" + body * FUNCTION_LIMIT
    )  # fmt: skip
    (tmp_path / "m.py").write_text(source, encoding="utf-8")
    assert long_functions([tmp_path / "m.py"], FUNCTION_LIMIT, tmp_path) == {
        "m.py:A.long": FUNCTION_LIMIT + 1,
        "m.py:outer": FUNCTION_LIMIT + 2,
        "m.py:outer.inner": FUNCTION_LIMIT + 1,
    }


def suite_modules(tests: Path = TESTS) -> list[Path]:
    """Every Python module of the suite: the tests, the conftests and the helpers they share
    (support/, a folder's own helpers)."""
    return sorted(tests.rglob("*.py"))


def test_no_test_module_over_the_limit() -> None:
    suite = suite_modules()
    assert len(suite) > 200, "the suite's modules were not found: the check would pass vacuously"
    assert oversized(suite, TEST_MODULE_LIMIT) == {}, (
        "split it by what it tests (a helper by what it owns), mirroring the packages"
    )


def test_the_test_module_check_sees_a_long_helper(tmp_path: Path) -> None:
    (tmp_path / "support").mkdir()
    helper = tmp_path / "support" / "fake_server.py"
    helper.write_text("x = 1\n" * (TEST_MODULE_LIMIT + 1), encoding="utf-8")
    (tmp_path / "test_fits.py").write_text("x = 1\n" * TEST_MODULE_LIMIT, encoding="utf-8")
    suite = suite_modules(tmp_path)
    assert oversized(suite, TEST_MODULE_LIMIT, tmp_path) == {
        "support/fake_server.py": TEST_MODULE_LIMIT + 1
    }


def test_few_loose_modules_at_the_package_root() -> None:
    """A module at gpuagent's root belongs to no room (``__init__`` and ``__main__`` count)."""
    loose = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(loose) <= ROOT_MODULE_LIMIT, loose


def script_imports(directory: Path) -> dict[str, set[str]]:
    """The Python modules of ``directory`` (each a top-level module: a script's own directory is
    on its path), each with the modules of ``directory`` it imports anywhere, in functions too."""
    paths = sorted(directory.glob("*.py"))
    names = {path.stem for path in paths}
    edges: dict[str, set[str]] = {}
    for path in paths:
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                imported.update(alias.name.partition(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module.partition(".")[0])
        edges[path.stem] = imported & names
    return edges


def test_no_import_circle_among_the_scripts() -> None:
    edges = script_imports(SCRIPTS)
    assert "bench_accounting" in edges["bench"], "the scripts' imports were not read"
    assert cycles(edges) == []


def test_a_circle_among_scripts_is_found(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("import b\n", encoding="utf-8")
    (tmp_path / "b.py").write_text("def main() -> None:\n    import a\n", encoding="utf-8")
    (tmp_path / "c.py").write_text("from a import x\nimport os\n", encoding="utf-8")
    assert script_imports(tmp_path) == {"a": {"b"}, "b": {"a"}, "c": {"a"}}
    assert cycles(script_imports(tmp_path)) == [["a", "b"]]


def test_every_script_in_python_is_checked() -> None:
    """ruff and mypy read ``*.py``: a script in Python under another name goes unchecked (the
    extensionless ones are shell launchers of a module)."""
    unchecked = [
        path.name
        for path in sorted(SCRIPTS.iterdir())
        if path.is_file()
        and path.suffix != ".py"
        and "python" in path.read_text(encoding="utf-8").partition("\n")[0]
    ]
    assert unchecked == []


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


# ----- one way to wait, one backoff ---------------------------------------------------------------
def _called(node: ast.AST) -> str | None:
    """The name of the function or method ``node`` calls (``None``: not a call)."""
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    return func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)


def _calls(tree: ast.AST, name: str) -> Iterator[ast.Call]:
    """The calls in ``tree`` of a function or method called ``name``."""
    return (n for n in ast.walk(tree) if isinstance(n, ast.Call) and _called(n) == name)


def _named(node: ast.AST) -> str | None:
    """The name ``node`` uses or defines (a variable, an argument, an attribute, a function)."""
    for field in ("id", "arg", "attr", "name"):
        value = getattr(node, field, None)
        if isinstance(value, str):
            return value
    return None


def other_waits(source: str) -> list[str]:
    """What in ``source`` waits for a change or a time other than by a watch's deadline."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if _named(node) in RETIRED_WAITS:
            found.append(f"line {line}: {_named(node)}")
        if isinstance(node, ast.AsyncWith) and any(_timeout(i.context_expr) for i in node.items):
            under: list[ast.AST] = list(node.body)
        elif _called(node) == "wait_for":
            under = [node]
        else:
            continue
        if any(next(_calls(n, "anext"), None) is not None for n in under):
            found.append(f"line {line}: anext() under a timeout")
    return found


def _timeout(expr: ast.expr) -> bool:
    return _called(expr) in _TIMEOUTS


def doublings(source: str) -> list[int]:
    """The lines of ``source`` whose code doubles a value the way a backoff does."""
    tree = ast.parse(source)
    lines = {getattr(node, "lineno", 0) for node in ast.walk(tree) if _doubles(node)}
    for call in _calls(tree, "min"):  # min(x * 2, most): a doubling with a ceiling
        lines |= {getattr(node, "lineno", 0) for node in ast.walk(call) if _times_two(node)}
    return sorted(lines)


def _doubles(node: ast.AST) -> bool:
    """``2 ** n`` (a variable exponent: ``2**64`` is a constant) or ``x *= 2``."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        return _two(node.left) and not isinstance(node.right, ast.Constant)
    return isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Mult) and _two(node.value)


def _times_two(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.BinOp)
        and isinstance(node.op, ast.Mult)
        and (_two(node.left) or _two(node.right))
    )


def _two(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value in (2, 2.0)


def test_one_way_to_wait_for_a_change_or_a_time() -> None:
    found = {str(p.relative_to(ROOT)): other_waits(p.read_text()) for p in modules()}
    assert {name: what for name, what in found.items() if what} == {}


def test_one_backoff() -> None:
    classes = [
        str(path.relative_to(ROOT))
        for path in modules()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and node.name.endswith("Backoff")
    ]
    assert classes == [str(BACKOFF.relative_to(ROOT))]
    found = {str(p.relative_to(ROOT)): doublings(p.read_text()) for p in modules() if p != BACKOFF}
    assert {name: lines for name, lines in found.items() if lines} == {}
    assert doublings(BACKOFF.read_text()), "the backoff doubles nowhere: the check sees nothing"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("retry = min(retry * 2, limit)\n", [1]),
        ("x = min(max(2 * x, first), most)\n", [1]),
        ("delay *= 2\n", [1]),
        ("wait = base * 2 ** n\n", [1]),
        ("MAX_XID = 2**64 - 1\n", []),
        ('"""min(maximum, initial * 2**(n-1))"""\nx = y * 2\n', []),
    ],
)
def test_the_backoff_check_sees_a_hand_rolled_doubling(source: str, expected: list[int]) -> None:
    assert doublings(source) == expected


@pytest.mark.parametrize(
    "source",
    [
        "w = store.watch(p, repeat_after=20.0)\n",
        "async def f(w):\n    return await next_change(clock, w, 1.0)\n",
        "async def f(w):\n    async with asyncio.timeout_at(t):\n        return await anext(w)\n",
        "async def f(w):\n    return await asyncio.wait_for(anext(w), 5)\n",
    ],
)
def test_the_wait_check_sees_another_way_to_wait(source: str) -> None:
    assert other_waits(source)
    assert not other_waits("async def f(w, t):\n    return await w.next(t)\n")
