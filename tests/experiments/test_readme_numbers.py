"""The README's first screen is what `experiments/imagenet/first_screen.py` renders from the
committed results it cites, and each number of its tables (bar the ratios, computed from them)
is in the results file the paragraph before the table cites (at the README's rounding, with its
sign). A number copied or changed by hand, or a results file rerun without `--write`, fails here.
The digits paragraph below the block holds only numbers of the results folders it cites, and
experiments/imagenet/README.md's table of every peer only numbers of the file it cites."""

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


def paragraph_before(lines: list[str], i: int) -> str:
    """The paragraph that ends above line `i` (blank lines between skipped)."""
    j = i - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    start = j
    while start > 0 and lines[start - 1].strip():
        start -= 1
    return "\n".join(lines[start:j + 1])


def tables(block: str) -> list[tuple[str, list[list[str]]]]:
    """(the results file the paragraph before cites, the table's rows as cells, its header
    first and the separator second) of every table in `block`."""
    lines = block.splitlines()
    found, i = [], 0
    while i < len(lines):
        if lines[i].startswith("|"):
            cited = re.findall(r"`([^`]+results[^`]*\.md)`", paragraph_before(lines, i))[-1]
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                rows.append([c.strip() for c in lines[i].strip().strip("|").split("|")])
                i += 1
            found.append((cited, rows))
        i += 1
    return found


def unmatched(block: str, root: Path = ROOT) -> list[str]:
    """Every number of the block's tables, bar the first column (what the row is) and the
    ratios ("60x"), that its cited file does not hold; MB may quote a file's kB."""
    missing = []
    for cited, rows in tables(block):
        held = numbers((root / cited).read_text())
        values = [(s, v) for s, v, _, _ in held] + [(s, v / 1000) for s, v, _, _ in held]
        for cells in rows[2:]:
            for cell in cells[1:]:
                for sign, value, places, after in numbers(cell):
                    if after == "x":
                        continue  # a ratio: wrong_ratios checks it
                    if not any(round(v, places) == value and (not sign or s == sign)
                               for s, v in values):
                        missing.append(f"{cells[0]!r}: {sign}{value:.{places}f} not in {cited}")
    return missing


def _first(cell: str) -> tuple[float, int]:
    """(value, decimals) of the first number in a cell."""
    _, value, places, _ = numbers(cell)[0]
    return value, places


def _rounded_ratio_holds(ratio: tuple, top: tuple, bottom: tuple) -> bool:
    """Whether a ratio shown at its rounding can be `top` over `bottom`, each shown at theirs."""
    (r, rp), (a, ap), (b, bp) = ratio, top, bottom
    ha, hb, hr = 0.5 * 10 ** -ap, 0.5 * 10 ** -bp, 0.5 * 10 ** -rp
    return (a - ha) / (b + hb) - hr <= r <= (a + ha) / (b - hb) + hr


def section(results: str, title: str) -> str:
    """The cited file's section whose heading is `title` (a model's label)."""
    parts = re.split(r"^## ", results, flags=re.M)
    found = [p for p in parts if p.split("\n", 1)[0].strip() == title]
    assert len(found) == 1, f"no section '## {title}'"
    return found[0]


def file_cell(sec: str, row: str, title: str) -> float:
    """The number in a section's table under column `title` in the row of setting `row`."""
    table = [line for line in sec.splitlines() if line.startswith("|")]
    head = [c.strip() for c in table[0].strip("|").split("|")]
    line = next(line for line in table if line.startswith(f"| {row} |"))
    return float(line.strip("|").split("|")[head.index(title)])


def wrong_ratios(block: str, root: Path = ROOT) -> list[str]:
    """Every ratio of the block's tables that is not what it says: "fewer bytes" is DDP's bytes
    a step over the CSC default's in the cited file's section for the row's model; "DDP's step
    over CSC's" and "sooner" are the row's own DDP number over its CSC number (within their
    rounding). "Most any setting could gain" divides by the bound's step, which the row does
    not show; the render test pins it."""
    wrong = []
    for cited, rows in tables(block):
        head, body = rows[0], rows[2:]
        results = (root / cited).read_text()
        for cells in body:
            col = dict(zip(head, cells))
            if "fewer bytes" in col:
                sec = section(results, cells[0].split(" (")[0])
                ratio = (file_cell(sec, "DDP gloo dense FP32", "kB/step sent")
                         / file_cell(sec, "GradientFlow CSC 1% default", "kB/step sent"))
                shown, places = _first(col["fewer bytes"])
                if round(ratio, places) != shown:
                    wrong.append(f"{cells[0]!r}: {shown:g}x fewer bytes, the file gives "
                                 f"{ratio:.2f}x")
            # (ratio's column, (value, decimals) over (value, decimals)) the row shows
            pairs = []
            if col.get("DDP step (ms)") and col.get("CSC step (ms)"):
                pairs.append(("DDP's step over CSC's", _first(col["DDP step (ms)"]),
                              _first(col["CSC step (ms)"])))
            times = numbers(col.get("time to target: DDP, CSC (s)", "-"))
            if len(times) >= 2:
                pairs.append(("sooner", times[0][1:3], times[1][1:3]))
            for title, top, bottom in pairs:
                if col.get(title, "-") != "-" and not \
                        _rounded_ratio_holds(_first(col[title]), top, bottom):
                    wrong.append(f"{cells[0]!r}: {title} {col[title]} is not {top[0]:.{top[1]}f} "
                                 f"over {bottom[0]:.{bottom[1]}f}")
    return wrong


def test_the_first_screen_is_rendered_from_the_committed_results():
    readme = (ROOT / "README.md").read_text()
    assert first_screen.current(readme) == first_screen.render(), (
        "README.md's first screen differs from its results: run "
        "python experiments/imagenet/first_screen.py --write")


def test_every_number_of_the_first_screen_tables_is_in_its_results_file():
    block = first_screen.current((ROOT / "README.md").read_text())
    found = tables(block)
    assert len(found) == 2 and all(rows[2:] for _, rows in found)
    assert all(len(r) == len(rows[0]) for _, rows in found for r in rows)
    assert all((ROOT / cited).is_file() for cited, _ in found)
    assert unmatched(block) == []
    assert wrong_ratios(block) == []


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
    fewer = re.search(r"\| (\d+)x \|\n", block)  # the first row's "fewer bytes"
    worse = f"| {int(fewer.group(1)) + 1}x |\n"
    assert wrong_ratios(block.replace(fewer.group(0), worse, 1)) != []
    step = re.search(r"\| (\d+\.\d\d)x \|", block)  # the first "DDP's step over CSC's"
    assert wrong_ratios(block.replace(step.group(0), f"| {float(step.group(1)) + 0.1:.2f}x |",
                                      1)) != []


def test_the_timed_comparisons_table_of_peers_is_in_its_results_file():
    """experiments/imagenet/README.md's table of every peer, copied from the `make compare` run,
    holds only numbers of the results file it cites (a path relative to that README)."""
    here = ROOT / "experiments" / "imagenet"
    text = (here / "README.md").read_text()
    start = text.index("### The timed comparison")
    sec = text[start:text.index("\n### ", start)]
    assert [cited for cited, _ in tables(sec)] == ["results/fashion/results.md"]
    assert unmatched(sec, here) == []
    # a number changed by hand is caught
    assert "12.34" not in (here / "results/fashion/results.md").read_text()
    top1 = re.search(r"\| (\d+\.\d\d) ±", sec).group(1)
    assert unmatched(sec.replace(f"| {top1} ±", "| 12.34 ±", 1), here) != []


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
