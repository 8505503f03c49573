"""docs/DESIGN.md against the code: its size table, its thread table, its module map, its length.

The tables are checked, not trusted: a module that starts a thread the thread table does not
name, a module map entry that no longer exists, or a size that drifted beyond the stated
tolerance fails here, and the message says what to write. `python tests/test_docs.py` prints
the size table as the code has it now.
"""
from __future__ import annotations

import ast
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[1]
DESIGN = REPO / "docs" / "DESIGN.md"
PACKAGE = REPO / "gradientflow"
KERNELS = REPO / "kernels"  # installed as gradientflow.kernels (pyproject's package-dir)
# The size table's columns, in order; every other component counts as "other layers".
COLUMNS = ("engine", "backend", "compression", "optim", "horovod", "kernels")
# A figure may be this far from the count (relative), so that a small edit need not touch the
# doc while a module moved between layers, or a subsystem added or removed, does.
SIZE_TOLERANCE = 0.05
MAX_MODULE_LINES = 500
MAX_DESIGN_LINES = 400
# Modules allowed over MAX_MODULE_LINES (none: each was split along a seam).
LONG_MODULES_ALLOWED: set[str] = set()


def package_files() -> list[tuple[str, pathlib.Path]]:
    """(path relative to the package, file) of every module of gradientflow and kernels/."""
    files = [(p.relative_to(PACKAGE).as_posix(), p) for p in PACKAGE.rglob("*.py")
             if p.relative_to(PACKAGE).parts[0] != "kernels"]
    files += [("kernels/" + p.relative_to(KERNELS).as_posix(), p) for p in KERNELS.rglob("*.py")]
    return sorted(files)


def line_counts() -> dict[str, int]:
    """Lines (as `wc -l` counts them) per size-table column, with "other layers" and "total"."""
    counts = dict.fromkeys(COLUMNS + ("other layers", "total"), 0)
    for rel, path in package_files():
        n = len(path.read_text(encoding="utf-8").splitlines())
        top = rel.split("/")[0]
        counts[top if top in COLUMNS else "other layers"] += n
        counts["total"] += n
    return counts


def section(title: str) -> str:
    """The text of DESIGN.md's section `## title`, up to the next `## `."""
    text = DESIGN.read_text(encoding="utf-8")
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert m, f"docs/DESIGN.md has no section '## {title}'"
    return m.group(1)


def table(title: str) -> list[list[str]]:
    """The rows (cells stripped) of the first table in section `title`, header first."""
    rows = [line.strip().strip("|").split("|") for line in section(title).splitlines()
            if line.startswith("|") and not re.match(r"^\|[-| ]+\|$", line.strip())]
    return [[c.strip() for c in r] for r in rows]


def size_row() -> str:
    counts = line_counts()
    head = "| " + " | ".join(counts) + " |"
    return head + "\n|" + "---|" * len(counts) + "\n| " + " | ".join(
        f"{v:,}" for v in counts.values()) + " |"


def test_design_md_is_short():
    n = len(DESIGN.read_text(encoding="utf-8").splitlines())
    assert n < MAX_DESIGN_LINES, f"docs/DESIGN.md has {n} lines; keep it under {MAX_DESIGN_LINES}"


def test_size_table_matches_the_code():
    header, *rows = table("Size")
    assert len(rows) == 1, "the Size table has one row: the code as it is"
    written = dict(zip(header, rows[0]))
    counts = line_counts()
    assert list(written) == list(counts), f"the Size table's columns are {list(counts)}"
    off = {k: (written[k], v) for k, v in counts.items()
           if abs(int(written[k].replace(",", "")) - v) > SIZE_TOLERANCE * v}
    assert not off, (f"docs/DESIGN.md's Size table drifted ((written, counted): {off}); "
                     f"write:\n{size_row()}")


def thread_starters() -> set[str]:
    """Modules (relative to the package) that start a thread or a thread pool."""
    found = set()
    for rel, path in package_files():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                if name in ("Thread", "ThreadPoolExecutor"):
                    found.add(rel)
    return found


def test_thread_table_names_every_module_that_starts_a_thread():
    header, *rows = table("Threads")
    assert "started in" in header, "the Threads table has a 'started in' column"
    col = header.index("started in")
    named = {m for r in rows for m in re.findall(r"`([^`]+\.py)`", r[col])}
    started = thread_starters()
    assert started == named, (
        "docs/DESIGN.md's Threads table and the code disagree: "
        f"modules that start threads but are not in the table: {sorted(started - named)}; "
        f"in the table but starting none: {sorted(named - started)}")


def test_module_map_names_only_modules_that_exist():
    missing = []
    for row in table("Layers")[1:]:
        folder = ""
        for name in re.findall(r"`([^`]+)`", row[1]):
            if not name.endswith((".py", "/")):
                continue  # a note, such as an import name
            name = name.rstrip("/")
            if "/" in name:
                folder = name.rsplit("/", 1)[0] if name.endswith(".py") else name
                path = name
            else:
                path = f"{folder}/{name}" if folder else name
            if not (PACKAGE / path).exists() and not (REPO / path).exists():
                missing.append(path)
    assert not missing, f"docs/DESIGN.md's module map names what does not exist: {missing}"


def test_no_module_over_500_lines():
    long = {rel: n for rel, path in package_files()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES}
    over = {k: v for k, v in long.items() if k not in LONG_MODULES_ALLOWED}
    assert not over, (f"modules over {MAX_MODULE_LINES} lines: {over}; split each along a seam "
                      "(one purpose a module), re-exporting its public names where they were")


if __name__ == "__main__":
    print(size_row())
