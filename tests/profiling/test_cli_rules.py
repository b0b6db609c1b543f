"""`shardline profile report --rules FILE --rank N`: user rules as data, a rank for a file that records none."""

from __future__ import annotations

import io
import json

import pandas as pd
import pytest

from shardline.profiling.present.cli import main, read_rules
from shardline.profiling.table.names import DEFAULT_RULES, CommRule

from .test_comm_coverage import MYSTERY, write_trace


def _csv(capsys) -> pd.DataFrame:
    return pd.read_csv(io.StringIO(capsys.readouterr().out))


@pytest.mark.parametrize("suffix", ["yaml", "json"])
def test_rules_file_makes_an_unknown_kernel_communication(tmp_path, capsys, suffix):
    trace = write_trace(tmp_path / "t.pt.trace.json.gz")
    assert main(["profile", "report", str(trace), "--format", "csv"]) == 0
    before = _csv(capsys)
    assert "all_reduce" not in before or before["all_reduce"].sum() == 0  # MYSTERY counts as compute
    rules = tmp_path / f"rules.{suffix}"
    entry = {"pattern": r"mystery::fused_ar", "category": "all_reduce", "literals": ["mystery::"]}
    rules.write_text(json.dumps([entry]) if suffix == "json" else
                     "rules:\n  - pattern: 'mystery::fused_ar'\n    category: all_reduce\n"
                     "    literals: ['mystery::']\n")
    assert main(["profile", "report", str(trace), "--format", "csv", "--rules", str(rules)]) == 0
    after = _csv(capsys)
    assert after["all_reduce"].sum() == 10_000  # the 10 µs kernel
    assert after["compute"].sum() == before["compute"].sum() - 10_000
    assert after["step_ns"].tolist() == before["step_ns"].tolist()


def test_user_rules_come_first_and_replace_a_default_with_the_same_pattern(tmp_path):
    default = DEFAULT_RULES[0]
    rules = tmp_path / "r.yaml"
    rules.write_text(f"- {{pattern: '{default.pattern}', category: other_comm}}\n- {{pattern: x_ag, category: "
                     "all_gather}\n")
    got = read_rules(rules)
    assert got[0] == CommRule(default.pattern, "other_comm") and got[1].pattern == "x_ag"
    assert [r.pattern for r in got].count(default.pattern) == 1
    assert len(got) == len(DEFAULT_RULES) + 1


@pytest.mark.parametrize("text, message", [
    ("- {pattern: '(unclosed', category: all_reduce}", "not a valid regex"),
    ("- {pattern: x, category: compute}", "not a communication category"),
    ("- {pattern: x, category: all_the_things}", "unknown category"),
    ("- {pattern: x}", "'pattern' string and a 'category'"),
    ("- {pattern: x, category: all_reduce, colour: red}", "unknown keys"),
    ("{}", "non-empty list"),
    ("[: bad yaml", "not YAML or JSON"),
])
def test_bad_rules_files_are_one_error_line_and_status_2(tmp_path, capsys, text, message):
    trace = write_trace(tmp_path / "t.pt.trace.json.gz")
    rules = tmp_path / "r.yaml"
    rules.write_text(text)
    assert main(["profile", "report", str(trace), "--rules", str(rules)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardline profile report: error: --rules") and message in err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("opening, closing", [("[", "]"), ('{"a": ', "}")])
def test_a_rules_file_nested_a_million_deep_is_one_error_line(tmp_path, capsys, opening, closing):
    trace = write_trace(tmp_path / "t.pt.trace.json.gz")
    rules = tmp_path / "deep.json"
    rules.write_text(opening * 10**6 + closing * 10**6)
    assert main(["profile", "report", str(trace), "--rules", str(rules)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"shardline profile report: error: --rules {rules}: nested too deep")
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_missing_rules_file_is_status_2(tmp_path, capsys):
    trace = write_trace(tmp_path / "t.pt.trace.json.gz")
    assert main(["profile", "report", str(trace), "--rules", str(tmp_path / "absent.yaml")]) == 2
    assert "absent.yaml" in capsys.readouterr().err


def test_rank_for_a_file_that_records_none(tmp_path, capsys):
    trace = write_trace(tmp_path / "trace.json.gz", rank=None)
    assert main(["profile", "report", str(trace), "--format", "csv"]) == 2
    err = capsys.readouterr().err
    assert "rank is not recorded" in err and "--rank N" in err and len(err.splitlines()) == 1
    assert main(["profile", "report", str(trace), "--format", "csv", "--rank", "3"]) == 0
    assert _csv(capsys)["rank"].unique().tolist() == [3]
    merged = tmp_path / "m.json"
    assert main(["profile", "merge", str(trace), "-o", str(merged), "--rank", "3"]) == 0
    assert MYSTERY in merged.read_text()


def test_a_recorded_rank_wins_and_rank_for_a_folder_is_refused(tmp_path, capsys):
    (tmp_path / "a").mkdir()
    trace = write_trace(tmp_path / "a" / "t.pt.trace.json.gz", rank=1)
    assert main(["profile", "report", str(trace), "--format", "csv", "--rank", "5"]) == 0
    assert _csv(capsys)["rank"].unique().tolist() == [1]
    write_trace(tmp_path / "a" / "u.pt.trace.json.gz", rank=0)
    assert main(["profile", "report", str(tmp_path / "a"), "--rank", "5"]) == 2
    assert "rank=5 given for a folder" in capsys.readouterr().err


def test_diff_takes_rules_too(tmp_path, capsys):
    before = write_trace(tmp_path / "b.pt.trace.json.gz")
    after = write_trace(tmp_path / "c.pt.trace.json.gz")
    rules = tmp_path / "r.json"
    rules.write_text(json.dumps({"rules": [{"pattern": "mystery::", "category": "all_reduce"}]}))
    assert main(["profile", "diff", str(before), str(after), "--format", "csv", "--rules", str(rules)]) == 0
    table = _csv(capsys)
    assert (table["delta_ns"] == 0).all() and table.loc[table["column"] == "all_reduce", "before_ns"].sum() > 0
