"""The README's first screen is what `experiments/imagenet/first_screen.py` renders from the
committed results it cites, and each number of its tables (bar the ratios, computed from them)
is in the results file the paragraph before the table cites (at the README's rounding, with its
sign). A number copied or changed by hand, or a results file rerun without `--write`, fails here.
The digits paragraph below the block holds only numbers of the results folders it cites."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments" / "imagenet"))
import first_screen  # noqa: E402

# A number, signed only where the sign does not follow a digit (a range "96.11-96.67" is two
# unsigned numbers).
NUMBER = re.compile(r"(?<![\d.])([+-]?)(\d+(?:\.\d+)?)")


def numbers(text: str) -> list[tuple[str, float, int, str]]:
    """(sign, absolute value, decimals, the character after it) of every number in `text`."""
    return [(m.group(1), float(m.group(2)), len(m.group(2).partition(".")[2]),
             text[m.end():m.end() + 1]) for m in NUMBER.finditer(text)]


def tables(block: str) -> list[tuple[str, list[list[str]]]]:
    """(the results file the paragraph before cites, the table's body rows as cells) of every
    table in `block`."""
    lines = block.splitlines()
    found, i = [], 0
    while i < len(lines):
        if lines[i].startswith("|"):
            before = "\n".join(lines[max(0, i - 4):i])
            cited = re.findall(r"`([^`]+results[^`]*\.md)`", before)[-1]
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                rows.append([c.strip() for c in lines[i].strip().strip("|").split("|")])
                i += 1
            found.append((cited, rows[2:]))
        i += 1
    return found


def unmatched(block: str, root: Path = ROOT) -> list[str]:
    """Every number of the block's tables, bar the first column (what the row is) and the
    ratios ("60x"), that its cited file does not hold; MB may quote a file's kB."""
    missing = []
    for cited, rows in tables(block):
        held = numbers((root / cited).read_text())
        values = [(s, v) for s, v, _, _ in held] + [(s, v / 1000) for s, v, _, _ in held]
        for cells in rows:
            for cell in cells[1:]:
                for sign, value, places, after in numbers(cell):
                    if after == "x":
                        continue  # a ratio, computed from numbers of the same file
                    if not any(round(v, places) == value and (not sign or s == sign)
                               for s, v in values):
                        missing.append(f"{cells[0]!r}: {sign}{value:.{places}f} not in {cited}")
    return missing


def test_the_first_screen_is_rendered_from_the_committed_results():
    readme = (ROOT / "README.md").read_text()
    assert first_screen.current(readme) == first_screen.render(), (
        "README.md's first screen differs from its results: run "
        "python experiments/imagenet/first_screen.py --write")


def test_every_number_of_the_first_screen_tables_is_in_its_results_file():
    block = first_screen.current((ROOT / "README.md").read_text())
    found = tables(block)
    assert len(found) == 2 and all(rows for _, rows in found)
    assert all((ROOT / cited).is_file() for cited, _ in found)
    assert unmatched(block) == []


def test_a_changed_number_is_caught():
    readme = (ROOT / "README.md").read_text()
    block = first_screen.current(readme)
    top1 = re.search(r"\| (\d+\.\d\d)% ±", block).group(1)  # DDP's top-1 in the first row
    wrong = f"{float(top1) + 0.01:.2f}"
    changed = block.replace(f"| {top1}% ±", f"| {wrong}% ±", 1)
    assert unmatched(changed)[0].split(": ")[1].startswith(wrong)
    assert first_screen.replaced(readme, changed) != first_screen.replaced(
        readme, first_screen.render())
    delta = re.search(r"\| [+-]\d+\.\d\d \(", block).group(0)  # the CSC row's difference
    assert unmatched(block.replace(delta, "| +7.77 (", 1)) != []


def paragraph(readme: str, opening: str) -> str:
    """The README paragraph that starts with `opening` (up to the next blank line)."""
    start = readme.index(opening)
    end = readme.find("\n\n", start)
    return readme[start:end if end >= 0 else len(readme)]


def unmatched_in_paragraph(text: str, root: Path = ROOT) -> list[str]:
    """Every decimal number of a paragraph that none of the results folders it cites
    (`.../results/<name>/`, their results.md) holds at its rounding; kB in a file may be quoted
    as MB."""
    folders = re.findall(r"`([^`]*results/[^`]+)/`", text)
    held = []
    for folder in folders:
        for _, value, places, _ in numbers((root / folder / "results.md").read_text()):
            held += [value, value / 1000]
    missing = []
    for sign, value, places, _ in numbers(text):
        if places and not any(round(v, places) == value for v in held):
            missing.append(f"{sign}{value:.{places}f}")
    return missing


def test_the_digits_paragraph_holds_only_numbers_of_its_results():
    readme = (ROOT / "README.md").read_text()
    text = paragraph(readme, "**Read with care.**")
    assert "digits-converged" in text and "digits-plateau" in text, text[:200]
    assert unmatched_in_paragraph(text) == []
    # a number changed by hand is caught
    first = re.search(r"\d+\.\d\d%", text).group(0)  # e.g. "98.67%"
    wrong = f"{float(first[:-1]) + 0.03:.2f}%"
    assert unmatched_in_paragraph(text.replace(first, wrong, 1)) == [wrong[:-1]]
