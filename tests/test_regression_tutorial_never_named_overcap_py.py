"""Regression (new-user trial): docs/tutorials/check-your-scheduler.md showed the OverCapScheduler
code and then ran `--engine overcap:make` without saying the code goes in `overcap.py`. Each
Python block of the tutorial follows a sentence naming its file; written there, the overcap one
records the tutorial's figures and trips MAX-NUM-SEQS as the page shows."""

from __future__ import annotations

import re
from pathlib import Path

from click.testing import CliRunner

from harness.cli import main

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "tutorials" / "check-your-scheduler.md"


def _files() -> dict[str, str]:
    """``{file name: code}``: each ```python block under the last `NAME.py` named before it."""
    text = PAGE.read_text()
    out = {}
    for m in re.finditer(r"```python\n(.*?)```", text, re.S):
        before = re.findall(r"`(\w+\.py)`", text[:m.start()].rsplit("```", 1)[-1])
        assert before, f"{PAGE.name}: a python block at offset {m.start()} names no file before it"
        out[before[-1]] = m.group(1)
    return out


def test_regression_tutorial_never_named_overcap_py(tmp_path: Path, monkeypatch) -> None:
    files = _files()
    assert sorted(files) == ["mysched.py", "overcap.py"]
    for name, code in files.items():
        (tmp_path / name).write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    trace = tmp_path / "overcap.parquet"
    r = CliRunner().invoke(main, ["record", str(ROOT / "harness" / "scenarios" / "fcfs-roomy.toml"),
                                  "--engine", "overcap:make", "-o", str(trace)])
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[-1] == (
        f"recorded {trace}: 371 steps, 60 requests (60 finished, 0 rejected, 0 aborted), 0 preemptions, "
        "0 prefix-hit tokens, 5.25 s virtual time")
    r = CliRunner().invoke(main, ["check", str(trace)])
    assert r.exit_code == 1, r.output
    assert r.output.splitlines()[-1] == ("6 violations of 1 invariant: MAX-NUM-SEQS ×6 (profile safety; a fork's "
                                         "trace: add --semantics fork for the progress rules)")
