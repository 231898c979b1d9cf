"""The package's modules import each other in one direction: no two modules depend on each other, whether
through top-level imports or imports inside functions (those only defer a circle, they do not remove it)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "longqa"


def module_name(path: Path) -> str:
    parts = ["longqa", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that ``path`` imports anywhere in its body; ``from a.b import c`` names a.b.c
    when c is a module, else a.b. The package's own ``__init__`` is left out: importing it is not
    depending on any one module."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    named = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            submodules = {f"{base}.{alias.name}" for alias in node.names} & modules
            named.update(submodules or {base})
    found = set()
    for name in named:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name and name != "longqa":
            found.add(name)
    return found - {module_name(path)}


def import_circles() -> list[list[str]]:
    """Each group of modules that reach one another through imports (Tarjan's strongly connected components)."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: imports_of(path, set(files)) for name, path in files.items()}
    order, low, stack, circles = {}, {}, [], []

    def visit(v):
        order[v] = low[v] = len(order)
        stack.append(v)
        for w in graph[v]:
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            group = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(group) > 1:
                circles.append(sorted(group))

    for v in sorted(graph):
        if v not in order:
            visit(v)
    return circles


def test_no_module_imports_one_that_imports_it_back():
    assert import_circles() == []


def test_the_check_finds_a_circle(tmp_path, monkeypatch):
    """The search itself sees a circle that goes through an import inside a function."""
    (tmp_path / "a.py").write_text("from longqa import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from longqa.a import g\n")
    (tmp_path / "c.py").write_text("import longqa.a\n")
    monkeypatch.setitem(globals(), "PACKAGE", tmp_path)
    assert import_circles() == [["longqa.a", "longqa.b"]]
