"""The package's shape: no import circle, every import down the layers of docs/design.md, the commands
and the public API alone in the root, and a first line in every module that says what it is.

Imports inside functions count as well as those at the top of a module: a circle closed by one of
them still ties its modules together. `from P import M` counts as importing the module P.M where M
is one, else P; a string given to importlib.import_module counts as an import of that module.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "flexh2o"

# Bottom first: a module may import from its own layer and those before it. The root's modules
# (the `python -m` commands and the public API) stand above every layer.
LAYERS = ["common", "host", "native", "compression", "checkpoints", "offload", "kv", "models", "engine",
          "planning", "profiling", "runs", "jobs", "harness", "cli", "server"]
ROOT_MODULES = {"flexh2o", "flexh2o.run", "flexh2o.plan", "flexh2o.profile", "flexh2o.eval", "flexh2o.lm_eval",
                "flexh2o.serve"}


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported_modules(module: str, path: pathlib.Path, known) -> set[str]:
    """The modules of `known` that a module imports, wherever in it the import stands."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            # `from P import M`: the module P.M where M is one, else (a name defined in P) P itself
            found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant)):
            found.add(node.args[0].value)
    return (found & set(known)) - {module}


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {module: imported_modules(module, path, known) for module, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one module (Tarjan's algorithm, without recursion)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    part = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        part.append(member)
                        if member == node:
                            break
                    if len(part) > 1:
                        found.append(sorted(part))
    return found


def layer_of(module: str) -> int:
    if module in ROOT_MODULES:
        return len(LAYERS)
    return LAYERS.index(module.split(".")[1])


def test_every_module_has_a_layer():
    assert [m for m in modules() if m not in ROOT_MODULES and m.split(".")[1] not in LAYERS] == []


def test_no_import_circle():
    assert cycles(import_graph()) == []


def test_imports_go_down_the_layers():
    graph = import_graph()
    against = sorted(f"{module} -> {target}" for module, targets in graph.items() for target in targets
                     if layer_of(target) > layer_of(module))
    assert against == []


def test_the_root_holds_commands_and_the_public_api():
    assert {m for m in modules() if m.count(".") == 1 and not (PACKAGE / m.split(".")[1]).is_dir()} | {"flexh2o"} \
        == ROOT_MODULES


@pytest.mark.parametrize("source, expected", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": set()}, []),
])
def test_cycles_finds_a_circle(source, expected):
    assert cycles(source) == expected


def test_every_module_says_what_it_is_in_its_first_line():
    silent = [m for m, path in modules().items()
              if not path.read_text().startswith('"""') or not ast.get_docstring(ast.parse(path.read_text()))]
    assert silent == []
