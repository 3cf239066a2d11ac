"""Regression: a resealed trace whose metadata ``engine`` or a request id held
an ESC sequence or a newline checked ``conformant`` and printed it raw: on a
terminal ``\\x1b[8m`` hides what follows and a newline forged an extra
``conformant (profile 0.33.0)`` line in ``check``'s table and ``diff``'s
header. No engine writes a control character there: one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from harness.cli import main
from harness.trace import METADATA_KEY
from tests.test_tamper import edited


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def test_regression_control_character_in_a_request_id_is_refused(tmp_path: Path) -> None:
    def edit(rows):
        first = rows[0]["request_id"]
        for row in rows:
            for key, value in row.items():
                if value == first:
                    row[key] = first + "\x1b[8m"
                elif isinstance(value, list):
                    row[key] = [first + "\x1b[8m" if v == first else v for v in value]

    trace = edited(tmp_path, "ctl-id", edit)
    for command in (["check", str(trace)], ["replay", str(trace)], ["report", str(trace), "-o", str(tmp_path / "r.html")]):
        code, out = _run(*command)
        assert code == 2, out
        lines = out.strip().splitlines()
        assert len(lines) == 1 and "\x1b" not in out
        assert lines[0].endswith("holds a control character (ESC, newline, ...)"), lines[0]
        assert "bad row: step 0 event 0: request_id 'r000000\\x1b[8m'" in lines[0]


def test_regression_control_character_in_metadata_is_refused(tmp_path: Path) -> None:
    import pyarrow.parquet as pq
    from harness.trace.writer import reseal

    src = Path(__file__).resolve().parent.parent / "golden" / "fcfs-tight.parquet"
    table = pq.read_table(src)
    kv = dict(pq.ParquetFile(src).metadata.metadata)
    kv.pop(b"ARROW:schema", None)
    key = METADATA_KEY.encode() if isinstance(METADATA_KEY, str) else METADATA_KEY
    meta = json.loads(kv[key])
    meta["engine"] = "\x1b[31mx\x1b[0m\nconformant (profile 0.33.0)"
    kv[key] = json.dumps(meta).encode()
    raw = tmp_path / "raw.parquet"
    pq.write_table(table.replace_schema_metadata(kv), raw)
    trace = reseal(raw, tmp_path / "ctl-meta.parquet")
    code, out = _run("check", str(trace))
    assert code == 2, out
    assert out.strip() == (f"error: {trace}: metadata 'engine' holds a control character (ESC, newline, ...); "
                           f"no engine writes one")
    code, out = _run("diff", str(src), str(trace))
    assert code == 2 and "\x1b" not in out and len(out.strip().splitlines()) == 1, out
