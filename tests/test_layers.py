"""The package's imports run down one declared order of layers (docs/development.md, "The
house"): every import, including those inside functions, read with `ast`; an import only
for type checkers (`if TYPE_CHECKING:`) is not one. A part is a top-level folder or module."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "megatron_stem"
# Bottom first. A part imports from its own layer's parts never, from layers below freely.
LAYERS = [("runtime",), ("config",), ("data", "model", "evaluation"), ("tables",),
          ("checkpoint", "planning"), ("hf", "training"), ("train", "editing"), ("analysis",),
          ("__init__",)]  # the package itself: what importing it installs (runtime/)
LAYER = {part: i for i, parts in enumerate(LAYERS) for part in parts}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part_of(module: str) -> str:
    return (module.split(".") + ["__init__"])[1]


def imports(module: str, source: str, modules: set[str]) -> set[str]:
    """The package's modules `module` imports (a name from a package: the package)."""
    found, package = set(), module if f"{module}.__init__" in modules else module.rpartition(".")[0]
    todo = list(ast.parse(source).body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]) \
                if node.level else ""
            origin = ".".join(filter(None, [base, node.module]))
            found.update(f"{origin}.{a.name}" if f"{origin}.{a.name}" in modules else origin
                         for a in node.names)
    return {m for m in found if m in modules and m != module}


def problems(sources: dict[str, str]) -> list[str]:
    """Every import up or across the layers, and every cycle between files."""
    modules = set(sources) | {f"{m}.__init__" for m in sources}
    graph = {m: imports(m, s, modules) for m, s in sources.items()}
    found = [f"{m} imports {t}: {part_of(t)} is not below {part_of(m)}"
             for m, targets in graph.items() for t in targets
             if part_of(t) != part_of(m) and LAYER[part_of(t)] >= LAYER[part_of(m)]]
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(m, path):
        state[m] = 1
        for t in sorted(graph[m]):  # (a set: its order changes with the hash seed)
            if state.get(t) == 1:
                found.append("cycle: " + " -> ".join(path[path.index(t):] + [m, t]))
            elif t not in state:
                visit(t, path + [m])
        state[m] = 2
    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    return found


def package_sources() -> dict[str, str]:
    return {module_name(p): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def test_imports_run_down_the_layers_without_cycles():
    sources = package_sources()
    assert {part_of(m) for m in sources} <= set(LAYER), "a part missing from LAYERS"
    assert problems(sources) == []


def test_an_upward_import_or_a_cycle_is_found():
    sources = package_sources()
    upward = dict(sources)
    upward["megatron_stem.runtime.errors"] += "\nfrom megatron_stem.training.loop import run\n"
    found = problems(upward)
    assert found[0] == ("megatron_stem.runtime.errors imports megatron_stem.training.loop: "
                        "training is not below runtime")
    assert any(line.startswith("cycle: megatron_stem.runtime.errors -> megatron_stem.training.loop")
               for line in found[1:])
    circle = dict(sources)
    circle["megatron_stem.config.strict"] += "\nfrom megatron_stem.config import schema\n"
    assert problems(circle) == ["cycle: megatron_stem.config.schema -> megatron_stem.config.strict"
                                " -> megatron_stem.config.schema"]


def test_the_house_keeps_its_shape():
    """At most 6 modules beside the package's folders; checkpointing in one package."""
    top = [p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"]
    assert len(top) <= 6, top
    outside = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*checkpoint*.py")
               if p.relative_to(PACKAGE).parts[0] != "checkpoint"]
    assert outside == []
