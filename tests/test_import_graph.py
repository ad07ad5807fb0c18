"""qosgate's modules import one another without a circle.

The graph is read from the source (no module is executed): every import,
at the top of a module or inside a function, except those under
`if TYPE_CHECKING:` (annotations only). Importing a submodule through its
package (`from qosgate.backends import support`) is an edge to the
submodule, not to the package's own code.
"""

from __future__ import annotations

import ast
from pathlib import Path

import qosgate

ROOT = Path(qosgate.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree: ast.AST, package: str, modules: set[str]) -> set[str]:
    found: set[str] = set()
    todo = [tree]
    while todo:
        node = todo.pop()
        for child in ast.iter_child_nodes(node):
            if _type_checking_only(child):
                continue
            todo.append(child)
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*anchor, *([child.module] if child.module else [])])
                names = [f"{base}.{alias.name}" for alias in child.names]
                submodules = [name for name in names if name in modules]
                found.update(submodules)
                if len(submodules) < len(names):
                    found.add(base)
    return found & modules


def import_graph() -> dict[str, set[str]]:
    paths = {_module_name(path): path for path in ROOT.rglob("*.py")}
    modules = set(paths)
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        graph[name] = _imports(ast.parse(path.read_text()), package, modules) - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle, as the modules along it, or None."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path: list[str] = []
        on_path: set[str] = set()
        stack = [(start, iter(sorted(graph[start])))]
        path.append(start)
        on_path.add(start)
        while stack:
            node, edges = stack[-1]
            step = next(edges, None)
            if step is None:
                stack.pop()
                path.pop()
                on_path.discard(node)
                done.add(node)
            elif step in on_path:
                return [*path[path.index(step) :], step]
            elif step not in done:
                stack.append((step, iter(sorted(graph[step]))))
                path.append(step)
                on_path.add(step)
    return None


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_is_read() -> None:
    graph = import_graph()
    assert "qosgate.backends.base" in graph["qosgate.backends.sim_live"]
    assert "qosgate.profiles" in graph["qosgate.config.models"]


def test_no_import_circle() -> None:
    assert find_cycle(import_graph()) is None


def test_config_imports_no_adapter() -> None:
    adapters = ("qosgate.backends", "qosgate.http", "qosgate.runtime", "qosgate.fleet")
    graph = import_graph()
    for name in (m for m in graph if m.startswith("qosgate.config")):
        assert not {d for d in graph[name] if d.startswith(adapters)}, name
