"""Regression (new-user trial, "block leaked on abort"): BLOCK-CONSERVATION's
witness named no request and no abort ("21 free + 17 held != 39 usable (the
trace implies 22 free)"), while the trace shows ``abort r000004`` freeing 11
blocks and the free count rising by 10. The witness now says what changed the
free count since the last row that carried it (each request's take or free:
blocks named, change of the count), the change those events imply and the one
the engine reported; later rows point back to the row where the gap appeared."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from forks import REPO, put_on_path
from harness.cli import main


def test_the_leak_is_attributed_to_the_abort(tmp_path: Path, monkeypatch) -> None:
    put_on_path(monkeypatch)
    out = str(tmp_path / "leak.parquet")
    r = CliRunner().invoke(main, ["record", str(REPO / "harness" / "scenarios" / "eos-stop-abort.toml"),
                                  "--engine", "forks.broken_blocks:leak_on_abort", "-o", out])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["check", out, "--semantics", "fork"])
    lines = [line for line in r.output.splitlines() if line.startswith("VIOLATION BLOCK-CONSERVATION")]
    assert r.exit_code == 1
    assert lines[:2] == [
        "VIOLATION BLOCK-CONSERVATION at step 19: at schedule_begin: 21 free + 17 held != 39 usable blocks "
        "(the trace implies 22 free); since update_end at step 18 (11 free) the engine's count changed by +10, "
        "the trace's events by +11 (abort r000004 freed 11 blocks, 11 back to the free queue (+11)): 1 block "
        "fewer came back than the trace frees",
        "VIOLATION BLOCK-CONSERVATION at step 19: at schedule_end: 11 free + 27 held != 39 usable blocks "
        "(the trace implies 12 free); since schedule_begin at step 19 (21 free) the engine's count changed by "
        "-10, the trace's events by -10 (r000010 took 10 free blocks (-10)): as the trace implies; the gap of "
        "-1 dates from schedule_begin at step 19"]
