"""The observability layer is a leaf: it imports nothing of gradientflow outside itself."""
from __future__ import annotations

import ast
import pathlib

import gradientflow.observability as obs

ALLOWED_THIRD_PARTY = {"torch", "numpy", "matplotlib"}


def test_observability_imports_only_itself_stdlib_and_allowed_packages():
    import sys
    root = pathlib.Path(obs.__file__).parent
    for path in root.glob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top == "gradientflow":
                    assert name.startswith("gradientflow.observability"), (path.name, name)
                else:
                    assert top in sys.stdlib_module_names or top in ALLOWED_THIRD_PARTY, (
                        path.name,
                        name,
                    )
