"""`harness convert` (a vLLM recording into a trace) and `harness check` given a recording.

Regression (new-user trial, an operator recording their own vLLM server): there was no CLI way
to convert a recording (the docs' `python -c` one-liner), and `harness check run1.jsonl` said
"not a Parquet file" and suggested `harness record` on it.

``tests/data/vllm-0.33.0-lookahead-4.jsonl`` is a vLLM 0.33.0 recording of 3 requests (25 steps);
``tests/data/vllm-0.32.0-format2.jsonl.gz`` a gzip-compressed format 2 one (148 steps).
"""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

from click.testing import CliRunner

from harness.cli import main
from harness.trace import open_trace

DATA = Path(__file__).with_name("data")
LOOKAHEAD = DATA / "vllm-0.33.0-lookahead-4.jsonl"
FORMAT2_GZ = DATA / "vllm-0.32.0-format2.jsonl.gz"


def run(*args) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.stdout, result.stderr


def test_convert_writes_the_trace_and_ends_on_its_summary(tmp_path: Path) -> None:
    out = tmp_path / "run1.parquet"
    code, stdout, stderr = run("convert", LOOKAHEAD, "-o", out)
    assert code == 0, stderr
    assert stdout.splitlines()[-1] == (
        f"converted {LOOKAHEAD} -> {out}: 25 steps, 3 requests, 3 finished, 0 aborted, 1 preemption, "
        f"32 prefix-hit tokens")
    trace = open_trace(out)
    assert (trace.summary["steps"], trace.incomplete) == (25, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run1.parquet"]  # no temporary left
    code, stdout, _ = run("check", out)
    assert code == 0 and "conformant" in stdout.splitlines()[-1]


def test_convert_reads_gzip_and_the_recorders_temporary_file(tmp_path: Path) -> None:
    code, stdout, stderr = run("convert", FORMAT2_GZ, "-o", tmp_path / "a.parquet")
    assert code == 0, stderr
    assert stdout.splitlines()[-1].endswith(": 148 steps, 8 requests, 8 finished, 0 aborted, "
                                            "3 preemptions, 352 prefix-hit tokens")
    # A server stopped without --shutdown-timeout leaves .NAME.jsonl.<pid>.tmp, here cut in the
    # middle of its steps (no end record): the complete steps convert, marked cut off.
    lines = LOOKAHEAD.read_text().splitlines(keepends=True)
    tmp = tmp_path / ".run1.jsonl.4242.tmp"
    tmp.write_text("".join(lines[:30]))
    code, stdout, stderr = run("convert", tmp, "-o", tmp_path / "b.parquet")
    assert code == 0, stderr
    last = stdout.splitlines()[-1]
    assert last.startswith(f"converted {tmp} -> {tmp_path / 'b.parquet'}: ")
    assert last.endswith("; incomplete: a vLLM recording without its end record (the server was cut off)")


def test_a_missing_recording_names_the_unfinished_temporary_file(tmp_path: Path) -> None:
    shutil.copy(LOOKAHEAD, tmp_path / ".run1.jsonl.4242.tmp")
    code, stdout, stderr = run("convert", tmp_path / "run1.jsonl", "-o", tmp_path / "run1.parquet")
    assert (code, stdout) == (2, "")
    assert stderr == (f"error: {tmp_path / 'run1.jsonl'}: no such file; the recorder's unfinished file "
                      f"{tmp_path / '.run1.jsonl.4242.tmp'} is there (vLLM stopped before it finished "
                      f"the recording: start vllm serve with --shutdown-timeout 10): convert that file\n")


def test_a_bad_recording_is_one_line_and_leaves_the_output_untouched(tmp_path: Path) -> None:
    out = tmp_path / "run1.parquet"
    out.write_bytes(b"old bytes")
    cases = {
        "notjson.jsonl": (b"# not a recording\n{}\n", "notjson.jsonl:1: not a JSON object"),
        "binary.jsonl": (b"PAR1\xff\xfe\x00", "binary.jsonl: not a text file (a recording is JSON lines, "
                                              "or gzip-compressed JSON lines named .gz)"),
        "plain.jsonl.gz": (b'{"t":"meta"}\n', "plain.jsonl.gz: named .gz but not gzip-compressed"),
        "nometa.jsonl": (b'{"t":"arrival"}\n', "nometa.jsonl: does not start with a sched-harness meta record"),
        "fields.jsonl": (b'{"t":"meta","format":3,"config":{}}\n{"t":"schedule"}\n',
                         "fields.jsonl: not a recording this converter reads (KeyError: 'output')"),
    }
    for name, (data, message) in cases.items():
        (tmp_path / name).write_bytes(data)
        code, stdout, stderr = run("convert", tmp_path / name, "-o", out)
        assert (code, stdout, stderr) == (2, "", f"error: {tmp_path}/{message}\n"), name
    # A log that goes wrong mid-way (after the trace writer opened): out of order.
    lines = LOOKAHEAD.read_text().splitlines(keepends=True)
    edited = tmp_path / "edited.jsonl"
    edited.write_text("".join(lines[:20]) + '{"t":"meta"}\n' + "".join(lines[20:]))
    code, stdout, stderr = run("convert", edited, "-o", out)
    assert (code, stdout, stderr) == (2, "", f"error: {edited}:21: a second meta record\n")
    assert out.read_bytes() == b"old bytes"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    code, _, stderr = run("convert", LOOKAHEAD, "-o", LOOKAHEAD)  # never over its input
    assert code == 2 and "-o names the input file" in stderr


def test_check_of_a_recording_says_to_convert_it_first(tmp_path: Path) -> None:
    tmp = tmp_path / ".run1.jsonl.4242.tmp"
    tmp.write_bytes(b"")  # just created by the recorder: known by its name
    gz = tmp_path / "run1.jsonl.gz"
    gz.write_bytes(gzip.compress(LOOKAHEAD.read_bytes()))
    for path in (LOOKAHEAD, gz, tmp):
        for command in ("check", "replay"):
            code, stdout, stderr = run(command, path)
            assert (code, stdout) == (2, ""), (command, path)
            assert stderr == (f"error: {path}: a vLLM recording (the recording scheduler's JSON lines), not a "
                              f"trace: convert it first: harness convert {path} -o TRACE.parquet\n")
    # A Mooncake JSONL workload is no recording: still the hint to record it.
    workload = tmp_path / "mooncake.jsonl"
    workload.write_text('{"timestamp": 0, "input_length": 8, "output_length": 2, "hash_ids": [1]}\n')
    code, _, stderr = run("check", workload)
    assert code == 2 and "harness record" in stderr and "harness convert" not in stderr
