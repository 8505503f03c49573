"""Import direction: every layer of gradientflow imports only from the layers below it.

The layers, bottom to top (a module may import its own component and any lower layer):

    0  kernels, algorithm_registry  compute kernels (numba); the table of collective algorithms
    1  errors, fingerprint,         every error; process-independent hashing; the resolved
       config, stores, simulate,    Config; a store connection of one's own; the scale model;
       cross_rank, threads          the ranks' agreement on a description (digest, then views);
                                    torch's thread count on the threads we start
    2  observability, settings_check  the statistics sink and timeline; settings agreed at init
    3  inspector, algorithms        check-ins, mismatch and stall detection; collective algorithms
    4  engine                       issue -> agreement -> messages -> completion
    5  backend                      the torch Backend, transports, the group registry and API
    6  compression                  compressors (stage generators for the engine)
    7  hooks, optim, autotune       DDP communication hooks; the distributed optimizer; autotune
    8  horovod, _registrar          Horovod's API on top; the entry point torch calls
    9  gradientflow/__init__.py     the package's front door
   10  spark, run, reducer          programs and launchers, which may import the front door

Components that share a layer (errors / fingerprint / config / stores / simulate / cross_rank /
threads; hooks / optim) do not import each other. Function-level imports count like module-level
ones: a lazy import is still a dependency, and hiding a cycle in a function is what this test
exists to catch.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "gradientflow"
LAYERS = [
    {"kernels", "algorithm_registry"},
    {"errors", "fingerprint", "config", "stores", "simulate", "cross_rank", "threads"},
    {"observability", "settings_check"},
    {"inspector", "algorithms"},
    {"engine"},
    {"backend"},
    {"compression"},
    {"hooks", "optim", "autotune"},
    {"horovod", "_registrar"},
    {"__init__"},
    {"spark", "run", "reducer"},
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}
# components that live outside gradientflow/ in the checkout (pyproject's package-dir)
COMPONENTS_OUTSIDE = {"kernels": ROOT.parent / "kernels"}


def component(module: str) -> str:
    """'gradientflow.engine.fusion' -> 'engine'; 'gradientflow' -> '__init__'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports_of(source: str, module: str, is_package: bool) -> set[str]:
    """The gradientflow modules `source` (module `module`) imports, anywhere in its body."""
    package = module if is_package else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name != "gradientflow":
                out.add(name)
                continue
            # `from gradientflow import kernels` names a component; anything else is an
            # attribute of the front door
            for a in node.names:
                sub = ROOT / a.name
                # kernels/ lives beside the package and is installed as gradientflow.kernels
                is_module = (a.name in COMPONENTS_OUTSIDE or sub.is_dir()
                             or sub.with_suffix(".py").exists())
                out.add(f"gradientflow.{a.name}" if is_module else "gradientflow")
    return {m for m in out if m == "gradientflow" or m.startswith("gradientflow.")}


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """Each import of `module` that goes to its own layer's sibling or to a higher layer."""
    mine = component(module)
    bad = []
    for target in sorted(imports_of(source, module, is_package)):
        theirs = component(target)
        if target == "gradientflow" and RANK[mine] < RANK["__init__"]:
            bad.append(f"{module} imports the package front door ({target})")
        elif theirs != mine and RANK.get(theirs, -1) >= RANK[mine]:
            bad.append(f"{module} (layer {RANK[mine]}, {mine}) imports {target} "
                       f"(layer {RANK.get(theirs)}, {theirs})")
    return bad


def modules():
    """(module name, path, is_package) of every module of the package, kernels/ included."""
    files = [(p, p.relative_to(ROOT.parent)) for p in ROOT.rglob("*.py")
             if "kernels" not in p.relative_to(ROOT).parts[:1]]
    for name, folder in COMPONENTS_OUTSIDE.items():
        files += [(p, pathlib.Path("gradientflow", name, p.relative_to(folder)))
                  for p in folder.rglob("*.py")]
    for path, rel in sorted(files):
        rel = rel.with_suffix("")
        parts = list(rel.parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        yield ".".join(parts), path, is_package


def test_every_component_has_a_layer():
    found = {component(m) for m, _p, _k in modules()}
    assert found <= set(RANK), f"components without a layer: {sorted(found - set(RANK))}"


def test_no_layer_imports_upward():
    bad = []
    for module, path, is_package in modules():
        bad += violations(path.read_text(), module, is_package)
    assert not bad, "upward imports:\n" + "\n".join(bad)


@pytest.mark.parametrize("module,source", [
    ("gradientflow.engine.api",
     "def f():\n    from gradientflow.backend.backend import backend_of\n"),
    ("gradientflow.inspector.inspector", "from gradientflow.engine.engine import EngineError\n"),
    ("gradientflow.config", "from gradientflow.errors import EngineError\n"),
    ("gradientflow.hooks._state", "from ..optim import plan\n"),
    ("gradientflow.observability.stats", "import gradientflow.engine.work\n"),
])
def test_the_check_flags_an_upward_import(module, source):
    assert violations(source, module), (module, source)


def test_the_check_allows_downward_and_own_imports():
    src = ("from gradientflow.engine import completion\nfrom ..errors import EngineError\n"
           "from gradientflow import kernels\nfrom .fusion import Message\n")
    assert violations(src, "gradientflow.engine.messages") == []
