"""graphpass's modules import downwards only: no cycle, and no import from a lower layer into a
higher one. Read from the source (ast), so an import inside a function counts too, and for cycles
an import under ``if TYPE_CHECKING:`` as well (a module that needs another's types while that one
calls it is one idea split in two files). (A module over 500 lines says why: tests/test_docs.py.)"""

from __future__ import annotations

import ast
from pathlib import Path

import graphpass

ROOT = Path(graphpass.__file__).parent

# Lowest first. A module may import modules of its own layer and of the layers below it. A
# dotted name places one module apart from its package: the FP8 recipes (the Recipe identity
# that Config's options derive, and its numerics) import nothing of graphpass's.
# The reference models (``models``) are plain PyTorch: they import nothing of graphpass's.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("_version", "_compat", "fp8.recipes", "config", "decisions", "paths", "models"),
    ("report",),
    ("fp8", "graph"),
    ("passes",),
    ("min_cut", "reporting", "pipeline", "selections"),
    ("backend", "plan", "distributed"),
    ("job",),
    ("testing",),
    ("cli_flags", "named", "cli", "__main__", "__init__"),
)


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def _layer(module: str) -> int:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):  # the longest name LAYERS lists
        for i, names in enumerate(LAYERS):
            if ".".join(parts[:n]) in names:
                return i
    raise AssertionError(f"graphpass.{module} is in no layer: add it to LAYERS")


def _runtime_nodes(tree: ast.AST, annotations: bool = False):
    """Every node of ``tree`` but those under ``if TYPE_CHECKING:`` (imports for annotations only,
    which never run), unless ``annotations``."""
    for child in ast.iter_child_nodes(tree):
        if (not annotations and isinstance(child, ast.If) and isinstance(child.test, ast.Name)
                and child.test.id == "TYPE_CHECKING"):
            continue
        yield child
        yield from _runtime_nodes(child, annotations)


def _imports(path: Path, module: str, *, source: str | None = None, root: Path = ROOT,
             annotations: bool = False) -> set[str]:
    """The graphpass modules ``path`` imports, as names relative to the package; ``annotations``:
    those under ``if TYPE_CHECKING:`` too."""
    package = module.split(".")[:-1] if path.name != "__init__.py" else module.split(".")
    if module == "__init__":
        package = []
    found = set()
    text = path.read_text(encoding="utf-8") if source is None else source
    for node in _runtime_nodes(ast.parse(text), annotations):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                name = ".".join([*base, *(node.module.split(".") if node.module else [])])
            elif (node.module or "").startswith("graphpass"):
                name = node.module.removeprefix("graphpass").lstrip(".")
            else:
                continue
            for alias in node.names:  # `from . import _compat` imports a module
                child = f"{name}.{alias.name}" if name else alias.name
                found.add(child if (root / (child.replace(".", "/") + ".py")).exists()
                          or (root / child.replace(".", "/")).is_dir() else name)
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("graphpass.") for a in node.names
                      if a.name.startswith("graphpass.")}
    return {f for f in found if f}


def _graph(annotations: bool = False) -> dict[str, set[str]]:
    return {_module(p): _imports(p, _module(p), annotations=annotations) for p in sorted(ROOT.rglob("*.py"))}


def test_no_import_goes_up_a_layer() -> None:
    upward = [f"{m} (layer {_layer(m)}) imports {i} (layer {_layer(i)})"
              for m, imports in _graph().items() for i in sorted(imports) if _layer(i) > _layer(m)]
    assert not upward, "\n".join(upward)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    # a package's __init__ re-exporting its own modules is no cycle through them
    edges = {m: {i for i in imports if not i.startswith(m + ".")} for m, imports in graph.items()}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for i in sorted(edges.get(m, ())):
            if state.get(i) == 1:
                cycles.append(path[path.index(i):] + [i])
            elif i not in state:
                visit(i, [*path, i])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    return cycles


def test_no_import_cycle() -> None:
    """Lazy imports included: inside a function, or under ``if TYPE_CHECKING:``."""
    cycles = _cycles(_graph(annotations=True))
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_lazy_imports_close_a_cycle(tmp_path: Path) -> None:
    """The cycle finder sees an import inside a function and one under ``TYPE_CHECKING``."""
    (tmp_path / "pkg").mkdir()
    sources = {
        "pkg.a": "def f():\n    from .b import g\n",
        "pkg.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n",
        "pkg.c": "import math\n",
    }
    for name, text in sources.items():
        (tmp_path / (name.replace(".", "/") + ".py")).write_text(text)
    graph = {m: _imports(tmp_path / (m.replace(".", "/") + ".py"), m, root=tmp_path,
                         annotations=True) for m in sources}
    assert graph == {"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": set()}
    assert _cycles(graph) == [["pkg.a", "pkg.b", "pkg.a"]]
    runtime = {m: _imports(tmp_path / (m.replace(".", "/") + ".py"), m, root=tmp_path)
               for m in sources}
    assert _cycles(runtime) == []


# -- torch's internals: one package ---------------------------------------------------------------

# The one package that reaches torch's private modules (``torch._inductor``, ``torch._functorch``,
# ``torch.utils._pytree``...), and the one module that calls torch's private FP8 GEMM functions
# (``torch._scaled_mm``, ``torch._scaled_grouped_mm``), beside the providers that use them.
PRIVATE_TORCH_PACKAGE = "_compat"
PRIVATE_TORCH_FUNCTIONS = ("fp8.torch_gemms",)


def _private(dotted: str) -> bool:
    """A dotted name under ``torch`` with a private part (``torch._inductor.config``,
    ``torch.utils._pytree``); torch's op namespaces (``torch.ops.aten._grouped_mm``) are public
    and dunders (``torch.__version__``) are no private module."""
    parts = dotted.split(".")
    return (parts[0] == "torch" and parts[1:2] != ["ops"]
            and any(p.startswith("_") and not p.startswith("__") for p in parts[1:]))


def _dotted(node: ast.AST) -> str | None:
    """``torch._ops.OpOverload`` for that attribute chain; None for a chain that starts elsewhere
    than at a name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def _private_torch(source: str) -> list[tuple[int, str, bool]]:
    """Each reach into torch's internals in ``source``, anywhere (inside a function, under
    ``TYPE_CHECKING``): (line, what, whether it is only a call of a private function of torch's
    top-level module, ``torch._scaled_mm``). An import counts, of a private module or from one
    (``from torch import _dynamo`` too), and so does an attribute chain through one
    (``torch._C._has_storage``)."""
    tree = ast.parse(source)
    # the outermost attribute chains only: ``torch._C._has_storage``, not also ``torch._C``
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, False) for a in node.names if _private(a.name)]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found += [(node.lineno, f"{node.module}.{a.name}", False) for a in node.names
                      if _private(f"{node.module}.{a.name}")
                      and (_private(node.module) or a.name.startswith("_"))]
        elif isinstance(node, ast.Attribute) and id(node) not in inner:
            dotted = _dotted(node)
            if dotted and _private(dotted):
                found.append((node.lineno, dotted, dotted.count(".") == 1))
    return sorted(found)


def test_private_torch_modules_only_in_compat() -> None:
    """Every private torch module is reached from ``graphpass/_compat/`` only, so that a torch
    release that moves one breaks one package; ``fp8/torch_gemms.py`` alone calls torch's private
    FP8 GEMM functions. Imports inside functions count."""
    outside = []
    for path in sorted(ROOT.rglob("*.py")):
        module = _module(path)
        if module == PRIVATE_TORCH_PACKAGE or module.startswith(PRIVATE_TORCH_PACKAGE + "."):
            continue
        for line, what, function in _private_torch(path.read_text(encoding="utf-8")):
            if not (function and module in PRIVATE_TORCH_FUNCTIONS):
                outside.append(f"graphpass/{path.relative_to(ROOT)}:{line}: {what}")
    assert not outside, ("private torch modules are reached through graphpass._compat:\n"
                         + "\n".join(outside))


def test_private_torch_finder_sees_every_form() -> None:
    """The finder sees a private module imported at the top, inside a function or by name from
    ``torch``, and an attribute chain through one; public names and op namespaces pass."""
    source = (
        "import torch\n"
        "import torch._dynamo\n"
        "from torch._inductor import config\n"
        "from torch.utils._pytree import tree_leaves\n"
        "from torch import _guards\n"
        "from torch.fx.experimental.symbolic_shapes import guard_or_true\n"
        "def f(t):\n"
        "    from torch._subclasses.fake_tensor import FakeTensorMode\n"
        "    isinstance(t, torch._ops.OpOverload)\n"
        "    torch._C._has_storage(t) or torch._C._has_storage(t.grad)\n"
        "    torch.ops.aten._grouped_mm.default\n"
        "    torch.__version__\n"
        "    return torch._scaled_mm(t, t)\n"
    )
    assert _private_torch(source) == [
        (2, "torch._dynamo", False),
        (3, "torch._inductor.config", False),
        (4, "torch.utils._pytree.tree_leaves", False),
        (5, "torch._guards", False),
        (8, "torch._subclasses.fake_tensor.FakeTensorMode", False),
        (9, "torch._ops.OpOverload", False),
        (10, "torch._C._has_storage", False),
        (10, "torch._C._has_storage", False),
        (13, "torch._scaled_mm", True),
    ]


def test_partition_sides_are_read_through_graph_joint() -> None:
    """The side of the partition a node is on is ``graph.joint.Side``, read and written by
    ``graph/joint.py`` alone: no other module names torch's metadata key."""
    named = [f"graphpass/{p.relative_to(ROOT)}" for p in sorted(ROOT.rglob("*.py"))
             if _module(p) != "graph.joint" and "partitioner_tag" in p.read_text(encoding="utf-8")
             .replace("``partitioner_tag``", "").replace('``meta["partitioner_tag"]``', "")]
    assert not named, "partitioner_tag outside graph/joint.py: " + ", ".join(named)


def test_the_plan_holds_no_callbacks() -> None:
    """The passes share data on the ``Plan``; what they ask of torch's min-cut they ask the
    partitioner the pipeline hands them (``passes/partitioner.py``), never a function stored on
    the plan, where a call up a layer would hide from the import graph."""
    import dataclasses

    from graphpass.decisions import Plan

    callbacks = [f.name for f in dataclasses.fields(Plan) if "Callable" in str(f.type)]
    assert not callbacks, callbacks
