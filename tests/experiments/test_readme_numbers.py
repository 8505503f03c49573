"""The README's results table (its first screen) holds only numbers that its cited results file
holds: each number of a row is in that file's section for the row's model and recipe (at the
README's rounding, with its sign), and each "Nx fewer bytes" is DDP's wire bytes over the CSC
default's in that section. A number copied by hand that no run produced fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# A number, signed only where the sign does not follow a digit (a range "96.11-96.67" is two
# unsigned numbers).
NUMBER = re.compile(r"(?<![\d.])([+-]?)(\d+(?:\.\d+)?)")
DDP_ROW, OURS_ROW = "DDP gloo dense FP32", "GradientFlow CSC 1% default"


def first_table(text: str) -> tuple[str, list[list[str]]]:
    """(the path the paragraph before the README's first table cites, the table's rows as
    cells)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    before = "\n".join(lines[max(0, start - 8):start])
    cited = re.findall(r"`([^`]+results[^`]*\.md)`", before)[-1]
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return cited, rows


def section(results: str, label: str) -> str:
    """The cited file's section for a README row: its model and recipe."""
    model = re.split(r"[ ,(]", label, maxsplit=1)[0]
    recipe = "schedule" if "cosine" in label else "plain"
    parts = re.split(r"^## ", results, flags=re.M)
    found = [p for p in parts if p.startswith(f"{model}, {recipe} recipe")]
    assert len(found) == 1, f"no section '## {model}, {recipe} recipe' for row {label!r}"
    return found[0]


def numbers(text: str) -> list[tuple[str, float, int, str]]:
    """(sign, absolute value, decimals, the character after it) of every number in `text`."""
    return [(m.group(1), float(m.group(2)), len(m.group(2).partition(".")[2]),
             text[m.end():m.end() + 1]) for m in NUMBER.finditer(text)]


def wire_mb(sec: str, row_label: str) -> float:
    """The 'wire MB/step' cell of a setting's row in a section's table."""
    table = [line for line in sec.splitlines() if line.startswith("|")]
    head = [c.strip() for c in table[0].strip("|").split("|")]
    col = head.index("wire MB/step")
    row = next(line for line in table if line.startswith(f"| {row_label} |"))
    return float(row.strip("|").split("|")[col])


def unmatched(readme: str, root: Path = ROOT) -> list[str]:
    """Every number of the README's results table that its cited file does not hold."""
    cited, rows = first_table(readme)
    results = (root / cited).read_text()
    head, body = rows[0], rows[2:]
    missing = []
    for cells in body:
        sec = section(results, cells[0])
        held = numbers(sec)
        for title, cell in zip(head[1:], cells[1:]):
            for sign, value, places, after in numbers(cell):
                if "fewer bytes" in title and after == "x":
                    ratio = wire_mb(sec, DDP_ROW) / wire_mb(sec, OURS_ROW)
                    ok = round(ratio, places) == value
                else:
                    ok = any(round(v, places) == value and (not sign or s == sign)
                             for s, v, _, _ in held)
                if not ok:
                    missing.append(f"{cells[0]!r}, {title!r}: {sign}{value:.{places}f}")
    return missing


def test_every_number_of_the_first_screen_table_is_in_its_results_file():
    readme = (ROOT / "README.md").read_text()
    cited, rows = first_table(readme)
    assert (ROOT / cited).is_file(), cited
    assert len(rows) > 2 and all(len(r) == len(rows[0]) for r in rows)
    assert unmatched(readme) == []


def test_a_changed_number_is_caught():
    readme = (ROOT / "README.md").read_text()
    _, rows = first_table(readme)
    top1 = rows[2][1].split("%")[0]  # DDP's top-1 in the first row, e.g. "85.07"
    wrong = f"{float(top1) + 0.01:.2f}"
    assert unmatched(readme.replace(f"| {top1}%", f"| {wrong}%", 1))[0].endswith(wrong)
    ratio = rows[2][-1]  # e.g. "51x"
    worse = f"{int(ratio[:-1]) + 1}x"
    assert unmatched(readme.replace(f"| {ratio} |", f"| {worse} |", 1)) != []
    delta = re.search(r"\(([+-])(\d+\.\d+)\)", rows[2][2])  # the CSC row's difference
    flipped = {"+": "-", "-": "+"}[delta.group(1)] + delta.group(2)
    assert unmatched(readme.replace(delta.group(0), f"({flipped})", 1)) != []


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
