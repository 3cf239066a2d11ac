"""Adversarial findings on trace schema 9 (hybrid KV caches): a doctored
hybrid golden, resealed (what a deliberate editor does), is refused with one
line naming the file and row, or reported with a violation; a correct engine
with two sliding-window groups checks clean. Each test is named after its bug."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq
from click.testing import CliRunner

from harness.cli import main
from harness.trace import METADATA_KEY
from harness.trace.writer import reseal

ROOT = Path(__file__).resolve().parents[1]
ALTERNATING = ROOT / "golden" / "hybrid" / "hybrid-alternating.parquet"

Rows = list[dict[str, Any]]


def doctored(tmp_path: Path, edit: Callable[[Rows], None] = lambda rows: None,
             edit_meta: Callable[[dict], None] = lambda meta: None, drop: str | None = None) -> Path:
    table = pq.read_table(ALTERNATING)
    rows = table.to_pylist()
    edit(rows)
    schema = table.schema
    if drop:
        schema = pa.schema([f for f in schema if f.name != drop])
        for row in rows:
            del row[drop]
    kv = dict(pq.ParquetFile(ALTERNATING).metadata.metadata)
    meta = json.loads(kv[METADATA_KEY])
    edit_meta(meta)
    kv[METADATA_KEY] = json.dumps(meta, sort_keys=True).encode()
    out = tmp_path / "doctored.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=schema).replace_schema_metadata(kv), out)
    return reseal(out, out)


def check(path: Path) -> tuple[int, list[str]]:
    result = CliRunner().invoke(main, ["check", str(path)])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.output.splitlines()


def first(rows: Rows, kind: str, step: int | None = None) -> dict:
    return next(r for r in rows if r["kind"] == kind and (step is None or r["step"] == step))


def _schema_8(meta: dict) -> None:
    meta["schema_version"] = 8


def test_regression_schema_8_trace_with_a_hybrid_config_was_checked(tmp_path: Path) -> None:
    # Relabelled schema 8 with its group column dropped: 1803 violations (exit 1) before.
    code, lines = check(doctored(tmp_path, edit_meta=_schema_8, drop="group_block_ids"))
    assert code == 2 and len(lines) == 1
    assert lines[0].endswith("doctored.parquet: schema 8 trace with a hybrid config (sliding_window / "
                             "layer_types): such a trace is written in schema 9 (metadata edited?)")


def test_regression_schema_9_trace_with_a_plain_config_ignored_its_groups(tmp_path: Path) -> None:
    from reference.config import EngineConfig

    def plain(meta: dict) -> None:
        meta["config"]["sliding_window"] = meta["config"]["layer_types"] = None
        meta["config_fingerprint"] = EngineConfig.from_dict(meta["config"], accept_vllm_crash=True).fingerprint()

    code, lines = check(doctored(tmp_path, edit_meta=plain))
    assert code == 2 and len(lines) == 1
    assert lines[0].endswith("schema 9 trace whose config names no sliding_window or layer_types: a one-group "
                             "trace is written in schema 8 (metadata edited?)")


def test_regression_preempt_groups_cut_to_one_list_passed_as_conformant(tmp_path: Path) -> None:
    def cut(rows: Rows) -> None:
        row = first(rows, "preempt")
        row["group_block_ids"] = row["group_block_ids"][:1]

    code, lines = check(doctored(tmp_path, cut))
    assert code == 2 and lines == [
        f"error: {tmp_path / 'doctored.parquet'}: bad row: step 64 event 4: preempt block_ids "
        f"[12, 18, 29, 42, 6, 31, 17, 32] are not the blocks of its group_block_ids [[12, 18, 29]] (null blocks left out)"]


def test_regression_schedule_block_ids_emptied_beside_its_groups_passed(tmp_path: Path) -> None:
    def empty(rows: Rows) -> None:
        next(r for r in rows if r["kind"] == "schedule" and r["step"] == 1 and r["request_id"] == "r000001")[
            "block_ids"] = []

    code, lines = check(doctored(tmp_path, empty))
    assert code == 2 and len(lines) == 1
    assert "bad row: step 1 event 4: schedule block_ids [] are not the blocks of its group_block_ids " \
           "[[37, 38, 39, 40, 41, 42, 43], [14, 13, 12, 11, 10, 9, 8]]" in lines[0]


def test_regression_preempt_groups_nulled_passed_as_conformant(tmp_path: Path) -> None:
    def null(rows: Rows) -> None:
        first(rows, "preempt")["group_block_ids"] = None

    code, lines = check(doctored(tmp_path, null))
    assert code == 1 and lines[-1] == "1 violation of 1 invariant: BLOCKS-COVER ×1 (profile 0.33.0)"


def test_regression_null_block_id_inside_a_group_list_was_not_refused(tmp_path: Path) -> None:
    def hole(rows: Rows) -> None:
        next(r for r in rows if r["kind"] == "schedule" and r["step"] == 1 and r["request_id"] == "r000001")[
            "group_block_ids"][0][1] = None

    code, lines = check(doctored(tmp_path, hole))
    assert code == 2 and lines == [
        f"error: {tmp_path / 'doctored.parquet'}: bad row: step 1 event 4: null inside group_block_ids"]


def test_regression_two_sliding_window_groups_freed_as_one_call_alloc_from_head(tmp_path: Path) -> None:
    # Caching off: each group's skipped blocks go to the free queue's head in
    # turn (one BlockPool.free_blocks per group); the checker freed them as one
    # call and flagged the reference with ALLOC-FROM-HEAD.
    out = tmp_path / "two-windows.parquet"
    result = CliRunner().invoke(main, [
        "record", "synthetic:12", "-o", str(out), "--set", "layer_types=sliding_attention,full_attention,"
        "sliding_attention", "--set", "sliding_window=8", "--set", "block_size=4", "--set", "num_gpu_blocks=120",
        "--set", "max_model_len=64", "--set", "enable_prefix_caching=false"])
    assert result.exit_code == 0, result.output
    code, lines = check(out)
    assert code == 0 and lines[-1] == "conformant (profile 0.33.0)"
