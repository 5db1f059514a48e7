"""README's results table says what BENCHMARKS.md's headline table says: each README row links a
headline row of BENCHMARKS.md, and every number in the row's result and goal cells is one that
headline row gives (README may say less, never something else)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")


def _table_rows(text: str, header_start: str) -> list[list[str]]:
    """The cells of each row of the first markdown table whose header row starts with `header_start`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def _anchor(cell: str) -> str:
    match = re.search(r"\(([^)]*)#([^)]+)\)", cell)
    assert match, f"no link to a BENCHMARKS.md section in {cell!r}"
    return match.group(2)


def _numbers(text: str) -> set[str]:
    text = re.sub(r"\([^)]*#[^)]*\)", "", text)  # links' anchors hold no results
    return {n.replace(",", "") for n in NUMBER.findall(text)}


def test_every_readme_result_is_a_benchmarks_headline_result():
    readme = _table_rows((ROOT / "README.md").read_text(), "| benchmark | result | goal |")
    headline = {_anchor(row[0]): row for row in _table_rows((ROOT / "BENCHMARKS.md").read_text(), "| Benchmark | Result |")
                if "#" in row[0]}
    assert readme and headline
    for row in readme:
        anchor = _anchor(row[0])
        assert anchor in headline, f"README's row {row[0]!r} links no headline row of BENCHMARKS.md"
        source = " ".join(headline[anchor][1:3])
        extra = _numbers(" ".join(row[1:3])) - _numbers(source)
        assert not extra, f"README's row {row[0]!r} gives numbers BENCHMARKS.md's headline row does not: {sorted(extra)}"
