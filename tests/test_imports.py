"""The package's modules import each other in one direction: no two modules depend on each other, whether
through top-level imports or imports inside functions (those only defer a circle, they do not remove it)."""

import ast
import warnings
from pathlib import Path

import pytest

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


def module_graph() -> dict[str, set[str]]:
    """Each module of the package and the package's modules it imports."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imports_of(path, set(files)) for name, path in files.items()}


def package_of(module: str) -> str:
    """The sub-package a module belongs to (``longqa.train.actor`` -> ``longqa.train``); a module at the package's
    top is a unit of its own."""
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()):
        return ".".join(parts[:2])
    return module


def package_graph(modules: dict[str, set[str]]) -> dict[str, set[str]]:
    """The sub-packages and the other sub-packages their modules import."""
    graph: dict[str, set[str]] = {}
    for module, imported in modules.items():
        graph.setdefault(package_of(module), set()).update(
            package_of(other) for other in imported if package_of(other) != package_of(module)
        )
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each group of nodes that reach one another (Tarjan's strongly connected components)."""
    order, low, stack, found = {}, {}, [], []

    def visit(v):
        order[v] = low[v] = len(order)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            group = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in order:
            visit(v)
    return found


def test_no_module_imports_one_that_imports_it_back():
    assert circles(module_graph()) == []


def test_no_package_imports_one_that_imports_it_back():
    """The sub-packages are layers: config under model, data, rollout, planning, train and the rest, each importing
    only those below it, so a package can be read (and tested) without the ones above."""
    assert circles(package_graph(module_graph())) == []


def test_the_package_top_holds_only_the_command_and_the_reward():
    """Every concept lives in the sub-package its name says; reward.py stays at the top, where verl loads it by path
    (``custom_reward_function.path``), with no import of the package's own."""
    assert sorted(p.name for p in PACKAGE.glob("*.py")) == ["__init__.py", "cli.py", "reward.py"]
    assert module_graph()["longqa.reward"] == set()


def test_the_check_finds_a_circle(tmp_path, monkeypatch):
    """The search itself sees a circle that goes through an import inside a function."""
    (tmp_path / "a.py").write_text("from longqa import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from longqa.a import g\n")
    (tmp_path / "c.py").write_text("import longqa.a\n")
    monkeypatch.setitem(globals(), "PACKAGE", tmp_path)
    assert circles(module_graph()) == [["longqa.a", "longqa.b"]]


def test_the_check_finds_a_circle_between_packages(tmp_path, monkeypatch):
    """Two packages that import each other through different modules: no module circle, a package circle."""
    for package, text in (("p", "from longqa.q.y import f\n"), ("q", "def f():\n    from longqa.p.z import g\n")):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
        (tmp_path / package / ("x.py" if package == "p" else "y.py")).write_text(text)
    (tmp_path / "p" / "z.py").write_text("def g():\n    pass\n")
    monkeypatch.setitem(globals(), "PACKAGE", tmp_path)
    assert circles(module_graph()) == []
    assert circles(package_graph(module_graph())) == [["longqa.p", "longqa.q"]]


def test_every_source_compiles_without_a_warning():
    """An invalid escape such as ``\\p`` in a docstring is a SyntaxWarning on every import under Python 3.12 (and an
    error in a later Python): compiled here with warnings as errors, every file of the package, tests and scripts."""
    root = PACKAGE.parent.parent
    sources = [p for folder in ("src", "tests", "benchmarks", "scripts") for p in (root / folder).rglob("*.py")]
    assert len(sources) > 100
    for path in sources:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            compile(path.read_text(), str(path), "exec")


def test_the_compile_check_sees_an_invalid_escape():
    with warnings.catch_warnings(), pytest.raises(SyntaxError):
        warnings.simplefilter("error")
        compile('def f():\n    """\\pi"""\n', "planted.py", "exec")
