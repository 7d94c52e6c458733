"""The house rules a reader relies on, checked on the source: no module under megatrain/
is over 600 lines, and no comment or docstring there cites the measurement log (sessions,
issues, bench/results/NOTES.md) or a lent machine: measurements live in bench/results/
and the README renders them; the code says why, not when or where it was measured."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "megatrain"
SOURCES = sorted(ROOT.rglob("*.py"))
MAX_LINES = 600
CITATIONS = re.compile(r"\bsessions? \d+|\bissues? #?\d+|NOTES\.md|\bH[12]00\b", re.IGNORECASE)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_modules_stay_small_and_cite_no_measurement_log(path):
    text = path.read_text()
    lines = text.count("\n") + 1
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines: split it by job"
    cited = [f"{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1) if CITATIONS.search(line)]
    assert not cited, f"{path.relative_to(ROOT)} cites the measurement log or a machine: {cited}"


def test_the_rules_can_fail():
    assert CITATIONS.search("as measured (bench/results/NOTES.md, session 29)")
    assert CITATIONS.search("the H100's link")
    assert not CITATIONS.search("a session's checkpoint, issued by the planner")
