"""The example traces in ``traces/``: each opens, the clean ones check clean and
replay ``conformant``, the mutant one fails with exactly the invariant its
README names, and re-recording each with the command its README gives (parsed
from traces/README.md, so the two cannot drift) yields the same bytes.

Bytes, not only decisions: recording is byte-deterministic (the goldens rely
on it too), and the file metadata keeps only the workload's base name and
sha256, so the same command on the same input writes the same file.
"""

from __future__ import annotations

from reference.words import plural

import importlib.util
import json
import re
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from harness.cli import main
from harness.trace import open_trace

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "traces"
README = TRACES / "README.md"
MAX_BYTES = 200_000

# file: (steps, finished, preemptions, prefix_hit_tokens, draft_tokens, violations by invariant),
# as recorded; the same figures are quoted in traces/README.md.
EXPECTED: dict[str, tuple[int, int, int, int, int, dict[str, int]]] = {
    "azure-code-15.parquet": (72, 15, 0, 0, 0, {}),
    "shared-prefix.parquet": (80, 6, 0, 4144, 0, {}),
    "preemption-heavy.parquet": (160, 40, 15, 352, 0, {}),
    "spec-decode.parquet": (112, 30, 1, 56, 345, {}),
    "torch-tiny.parquet": (20, 4, 0, 0, 0, {}),
    "mutant-ignore-max-num-seqs.parquet": (71, 12, 0, 0, 0, {"MAX-NUM-SEQS": 2}),
}


def _readme_commands() -> dict[str, list[str]]:
    """Output file name -> the ``harness record`` arguments the README gives for it."""
    commands: dict[str, list[str]] = {}
    for block in re.findall(r"```\n(.*?)```", README.read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.startswith("harness record "):
                args = shlex.split(line)[2:]
                out = args[args.index("-o") + 1]
                assert out.startswith("traces/"), line
                commands[Path(out).name] = args
    return commands


def test_every_trace_is_listed_small_and_has_its_command() -> None:
    on_disk = sorted(p.name for p in TRACES.glob("*.parquet"))
    assert on_disk == sorted(EXPECTED)
    assert sorted(_readme_commands()) == on_disk
    for name in on_disk:
        assert (TRACES / name).stat().st_size < MAX_BYTES, name
        assert f"## `{name}`" in README.read_text(), name
    # Inputs the commands read from traces/ are committed beside them.
    for args in _readme_commands().values():
        if args[0].startswith("traces/"):
            assert (ROOT / args[0]).is_file(), args[0]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_trace_checks_and_replays_as_its_readme_says(name: str) -> None:
    steps, finished, preemptions, prefix_hits, drafts, violations = EXPECTED[name]
    path = TRACES / name
    trace = open_trace(path)
    assert trace.meta["engine"] == ("mutant:ignore-max-num-seqs" if violations else "reference")
    runner = CliRunner()
    r = runner.invoke(main, ["check", "--json", str(path)])
    report = json.loads(r.output)
    assert (report["steps"], report["finished"], report["preemptions"], report["prefix_hit_tokens"],
            report["draft_tokens"]) == (steps, finished, preemptions, prefix_hits, drafts)
    assert report["violations_by_invariant"] == violations
    if violations:
        assert r.exit_code == 1 and report["ok"] is False
        # The README names the invariant and shows the check's exit status.
        text = README.read_text()
        assert all(f"**{inv}**" in text for inv in violations) and "(exit 1)" in text
        return
    assert r.exit_code == 0 and report["ok"] is True
    r = runner.invoke(main, ["replay", str(path)])
    assert r.exit_code == 0, r.output
    assert f"conformant (profile 0.33.0): {plural(steps, 'step')} replayed, identical decisions" in r.output


def test_mutant_trace_check_prints_what_the_readme_shows(monkeypatch) -> None:
    monkeypatch.chdir(ROOT)
    runner = CliRunner()
    r = runner.invoke(main, ["check", "traces/mutant-ignore-max-num-seqs.parquet"], catch_exceptions=False)
    text = README.read_text()
    shown = text.split("Expected `harness check traces/mutant-ignore-max-num-seqs.parquet` (exit 1):")[1]
    shown = shown.split("```")[1].strip("\n")
    assert r.exit_code == 1
    assert [line.rstrip() for line in r.output.strip("\n").splitlines()] == shown.splitlines()


@pytest.mark.parametrize("candidate, last", [
    ("mutant:ignore-max-num-seqs", "2 violations of 1 invariant: MAX-NUM-SEQS ×2 (profile 0.33.0); "
                                   "71 steps replayed, identical decisions"),
    ("reference", "2 violations of 1 invariant: MAX-NUM-SEQS ×2 (profile 0.33.0); first divergence at step 10"),
])
def test_replay_of_the_mutant_trace_ends_on_a_verdict(candidate: str, last: str) -> None:
    """Regression (a new user's walkthrough): a replay with violations ended on a context row or
    on the last violation, never saying whether the decisions matched."""
    r = CliRunner().invoke(main, ["replay", str(TRACES / "mutant-ignore-max-num-seqs.parquet"),
                                  "--candidate", candidate], catch_exceptions=False)
    assert r.exit_code == 1
    assert r.output.rstrip("\n").splitlines()[-1] == last


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_readme_command_rerecords_the_same_bytes(name: str, tmp_path: Path, monkeypatch) -> None:
    args = _readme_commands()[name]
    if "torch" in args and importlib.util.find_spec("torch") is None:
        pytest.skip("recording with --model torch needs torch")
    if args[0].startswith("../shared/") and not (ROOT / args[0]).exists():
        pytest.skip(f"{args[0]} is not here")
    out = tmp_path / name
    args[args.index("-o") + 1] = str(out)
    monkeypatch.chdir(ROOT)  # the commands' paths are relative to the repository root
    r = CliRunner().invoke(main, ["record", *args])
    assert r.exit_code == 0, r.output
    assert out.read_bytes() == (TRACES / name).read_bytes()
