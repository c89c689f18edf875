"""The grammar libraries' measurement walks a valid answer through the schema on the default
model's vocabulary and reports each library's costs; one not installed is reported as such."""
from __future__ import annotations

import re

from bench.grammar_libs import main


def test_measures_llguidance_and_reports_a_library_it_cannot_import(capsys):
    main(["--libs", "llguidance,no_such_library", "--repeat", "1"])
    out = capsys.readouterr().out
    assert "vocabulary 49152" in out
    row = re.search(r"\| llguidance \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|", out)
    assert row and all(float(x) > 0 for x in row.groups()), out
    assert "| no_such_library | not installed" in out
