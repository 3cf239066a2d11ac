"""docs/trace-format.md cannot drift from harness/trace/schema.py
(regression, issue 16: the doc's column count, the undocumented ``rank``
column and the schema number of its sample output had drifted). Everything
is read from the schema module, never a literal, so a schema bump fails here
until the doc follows."""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow as pa

from harness.trace.schema import COLUMNS, EVENT_KINDS, READABLE_VERSIONS, SCHEMA, SCHEMA_VERSION

DOC = (Path(__file__).resolve().parents[1] / "docs" / "trace-format.md").read_text()


def _section(number: int) -> str:
    start = DOC.index(f"\n## {number}. ")
    end = DOC.find("\n## ", start + 1)
    return DOC[start:end if end >= 0 else len(DOC)]


def _doc_type(t: pa.DataType) -> str:
    """An Arrow type as the doc writes it: int32, list<int32>, list<list<int32>>."""
    if pa.types.is_list(t):
        return f"list<{_doc_type(t.value_type)}>"
    return {"double": "float64"}.get(str(t), str(t))


def test_the_column_table_is_the_schema_in_order_with_types() -> None:
    rows = re.findall(r"^\| `(\w+)` \| `([^`]+)`([^|]*)\|", _section(5), re.M)
    assert [name for name, _, _ in rows] == list(COLUMNS)
    for name, doc_type, notes in rows:
        field = SCHEMA.field(name)
        assert doc_type == _doc_type(field.type), name
        assert ("not null" in notes) == (not field.nullable), name


def test_the_column_count_and_the_schema_numbers_are_the_schema_modules() -> None:
    assert f"There are {len(COLUMNS)} columns, in this order." in _section(5)
    older = sorted(READABLE_VERSIONS)
    readable = ", ".join(map(str, older[:-1])) + f" and {older[-1]}"
    assert DOC.splitlines()[0] == f"# Trace format (schema version {SCHEMA_VERSION}; versions {readable} still read)"
    assert f"`{SCHEMA_VERSION}` for every trace this harness writes" in _section(2)
    # The sample metadata (section 2) and the sample query output (section 8).
    assert re.findall(r'"schema_version": (\d+)', DOC) == [str(SCHEMA_VERSION)]
    assert re.findall(r"^schema (\d+) engine", _section(8), re.M) == [str(SCHEMA_VERSION)]


def test_every_event_kind_is_documented() -> None:
    documented = set(re.findall(r"^\| \d+ \| `(\w+)` \|", _section(4), re.M))
    assert documented == set(EVENT_KINDS)


def test_the_worked_example_is_step_5_of_the_section_8_trace(tmp_path) -> None:
    """Regression: section 4's example predated schema 6 (no request_state,
    no update_begin). Re-recorded here with section 8's command, its kinds
    and event indexes must be the table's."""
    from click.testing import CliRunner

    from harness.cli import main
    from harness.trace import open_trace

    out = tmp_path / "trace.parquet"
    result = CliRunner().invoke(main, ["record", "synthetic:50", "--time-scale", "10", "--set", "num_gpu_blocks=20",
                                       "--set", "max_model_len=256", "--set", "max_num_seqs=8", "-o", str(out)])
    assert result.exit_code == 0, result.output
    step5 = next(rows for step, rows in open_trace(out).iter_steps() if step == 5)
    table = _section(4)[_section(4).index("Here are the rows of step 5"):]
    documented: list[tuple[int, str]] = []
    for first, last, kind in re.findall(r"^\| (\d+)(?:–(\d+))? \| `(\w+)` \|", table, re.M):
        documented += [(i, kind) for i in range(int(first), int(last or first) + 1)]
    assert documented == [(r["event_index"], r["kind"]) for r in step5]
    assert step5[0]["waiting"] == ["r000008", "r000009", "r000010"] and step5[8]["token_budget"] == 2042
