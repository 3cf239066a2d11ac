"""Issue 27: every ``-o`` (and ``--report``) creates missing parent folders, as
``record -o`` always did; ``report -o`` used to refuse with "cannot write the
report (No such file or directory)", ``scenario extract -o`` with a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from harness.cli import main

TRACE = "traces/shared-prefix.parquet"


@pytest.mark.parametrize("args, verdict", [
    (["record", "synthetic:2", "-o", "{out}/t.parquet"], "recorded "),
    (["report", TRACE, "-o", "{out}/r.html"], "report written to "),
    (["check", TRACE, "--report", "{out}/c.html"], "conformant"),
    (["export", TRACE, "--perfetto", "-o", "{out}/p.json"], "exported "),
    (["export", TRACE, "--tables", "{out}/tables"], "exported "),
    (["scenario", "extract", TRACE, "--requests", "{first}", "-o", "{out}/s.toml"], "wrote "),
])
def test_output_in_a_missing_folder_is_created(tmp_path: Path, args: list[str], verdict: str) -> None:
    from harness.trace import open_trace

    first = next(r["request_id"] for _, rows in open_trace(TRACE).iter_steps() for r in rows if r.get("request_id"))
    out = tmp_path / "a" / "b"
    argv = [a.format(out=out, first=first) for a in args]
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 0, r.output
    assert verdict in r.output.strip().splitlines()[-1]
    written = Path(next(a for a in argv if a.startswith(str(out))))
    assert written.exists()
    assert not [p for p in out.rglob(".*") if p.name.endswith(".tmp")]  # no temp file left
