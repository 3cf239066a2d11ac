"""docs/tables.md stays true: each SQL recipe there runs (DuckDB) on the
tables `harness export --tables` writes for golden/preemption-heavy.parquet,
and its output must be the table printed under it. Skipped, saying why,
without duckdb (the `sql` extra; the `test` extra has it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from harness.cli import main

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "tables.md"
RECIPE = re.compile(r"```sql\n(.*?)```\n\n((?:\|[^\n]*\n)+)", re.S)


def markdown_table(columns: list[str], rows: list[tuple]) -> str:
    """A query's result as the doc prints it: a Markdown table, NULL for
    None, lists as [a, b]."""
    def cell(v: object) -> str:
        if v is None:
            return "NULL"
        if isinstance(v, list):
            return "[" + ", ".join(map(str, v)) + "]"
        return str(v)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def run_recipes(directory: Path) -> list[tuple[str, str, str]]:
    """(sql, the doc's table, the real one) for every recipe in docs/tables.md."""
    import duckdb

    con = duckdb.connect()
    out = []
    import os

    cwd = os.getcwd()
    os.chdir(directory)  # the recipes name the files relative to the export folder
    try:
        for sql, expected in RECIPE.findall(DOC.read_text()):
            rel = con.sql(sql)
            out.append((sql, expected, markdown_table(rel.columns, rel.fetchall())))
    finally:
        os.chdir(cwd)
    return out


def test_every_recipe_prints_what_the_doc_says(tmp_path) -> None:
    pytest.importorskip("duckdb", reason="duckdb not installed (pip install '.[sql]'): recipes not run")
    r = CliRunner().invoke(main, ["export", "--tables", str(tmp_path),
                                  str(ROOT / "golden" / "preemption-heavy.parquet")])
    assert r.exit_code == 0, r.output
    results = run_recipes(tmp_path)
    assert len(results) == 5
    for sql, expected, actual in results:
        assert actual == expected, sql
