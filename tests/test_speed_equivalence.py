"""Issue 24's speed-ups compute exactly what the code they replace computed:
the snapshot's queue ids reused across snapshots (``reference.scheduler._QueueIds``,
and ``Scheduler._waiting_queue_ids`` while the queues' ``mutations`` stand still),
a text prompt's block hashes packed at once (``hash_request_blocks``), the
queue encoder's shortcuts (``QueueEncoder.encode_row``) and the writer's
C-speed row conversion (``TraceWriter._flush``)."""

from __future__ import annotations

import json
import random
from operator import attrgetter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from harness.trace.queues import QueueEncoder, encode
from harness.trace.schema import METADATA_KEY
from harness.trace.writer import TraceWriter
from reference.kv_cache_utils import hash_block_tokens, hash_request_blocks
from reference.request import Request, SamplingParams
from reference.scheduler import _QueueIds


def _request(i: int) -> Request:
    return Request(f"r{i:04d}", [1, 2, 3], SamplingParams(max_tokens=4))


@pytest.mark.parametrize("seed", range(10))
def test_queue_ids_equal_a_fresh_map(seed: int) -> None:
    rng = random.Random(seed)
    pool = [_request(i) for i in range(60)]
    ids = _QueueIds()
    queue: list[Request] = []
    for _ in range(400):
        op = rng.random()
        if op < 0.3 and queue:
            del queue[:rng.randint(1, min(3, len(queue)))]  # admissions
        elif op < 0.6:
            queue += rng.sample(pool, rng.randint(0, 3))  # arrivals (repeats too)
        elif op < 0.7 and queue:
            queue.insert(0, rng.choice(pool))  # a preemption
        elif op < 0.8 and queue:
            queue.pop(rng.randrange(len(queue)))  # an abort
        elif op < 0.85:
            rng.shuffle(queue)
        assert ids.of(queue) == tuple(map(attrgetter("request_id"), queue))


@pytest.mark.parametrize("scenario", ["fcfs-tight", "priority-tight", "preemption-heavy", "kv-connector",
                                      "spec-decode-priority"])
def test_snapshot_waiting_equals_a_fresh_walk(scenario: str) -> None:
    """Every snapshot's waiting ids, reused or not, are the queues walked now."""
    from harness.scenarios import SCENARIOS
    from reference.engine import Engine
    from reference.scheduler import Scheduler

    reused = 0

    class Walked(Scheduler):
        def snapshot(self):
            nonlocal reused
            stamp = self._waiting_stamp
            snap = super().snapshot()
            reused += stamp is self._waiting_stamp  # (a walk sets a fresh stamp)
            assert snap.waiting == tuple(r.request_id for r in [*self.kv_holding_waiting, *self.waiting])
            return snap

    found = SCENARIOS[scenario]
    Engine(found.engine_config(), seed=found.seed, candidate_factory=Walked).run(found.make_workload())
    assert reused  # the shortcut was taken


@pytest.mark.parametrize("block_size", [1, 2, 16, 32])
def test_block_hashes_packed_equal_the_chain(block_size: int) -> None:
    rng = random.Random(block_size)
    for n in range(0, 130, 9):
        tokens = [rng.randrange(0, 2 ** 40) for _ in range(n)]
        packed: list[bytes] = []
        hash_request_blocks(tokens[:n // 3], block_size, packed)
        hash_request_blocks(tokens, block_size, packed)
        chain: list[bytes] = []
        parent = None
        for start in range(0, n - n % block_size, block_size):
            parent = hash_block_tokens(parent, tokens[start:start + block_size])
            chain.append(parent)
        assert packed == chain


@pytest.mark.parametrize("seed", range(10))
def test_encode_row_equals_encode(seed: int) -> None:
    rng = random.Random(seed)
    ids = [f"r{i}" for i in range(30)]
    encoder = QueueEncoder()
    previous: dict[str, list[str]] = {}
    for _ in range(300):
        row = {"kind": rng.choice(["schedule_begin", "schedule_end", "output"]), "rank": 0}
        for name in ("waiting", "running"):
            if rng.random() < 0.5 and name in previous:
                queue = list(previous[name])  # unchanged: the shortcut
            else:
                queue = rng.sample(ids, rng.randint(0, 8))
            row[name] = queue
        out = encoder.encode_row(row)
        if row["kind"] == "output":
            assert out is row
            continue
        for name in ("waiting", "running"):
            kept, head, tail = encode(previous.get(name), row[name])
            assert (out[name], out[f"{name}_kept"], out[f"{name}_head"]) == (tail, kept, head)
            previous[name] = row[name]


def test_writer_rows_read_back_as_from_pylist(tmp_path: Path) -> None:
    """Missing keys are null and keys outside the schema are left out, as
    ``pa.Table.from_pylist`` (the conversion the writer replaced) made them."""
    meta = {"engine": "reference", "config": {}, "workload": {"source": "x", "sha256": "0" * 64}, "seed": 0}
    rows = [{"step": 0, "event_index": 0, "kind": "arrival", "request_id": "a", "prompt_token_ids": [1, 2],
             "not_a_column": 5},
            {"step": 0, "event_index": 1, "kind": "update_end", "num_free_blocks": 7}]
    with TraceWriter(tmp_path / "t.parquet", meta) as writer:
        writer.add_step(rows)
    table = pq.read_table(tmp_path / "t.parquet")
    schema = table.schema.remove_metadata()
    expected = pa.Table.from_pylist([dict(r) for r in rows], schema=schema)
    assert table.replace_schema_metadata(None).equals(expected)
    assert json.loads(pq.ParquetFile(tmp_path / "t.parquet").schema_arrow.metadata[METADATA_KEY])["engine"] \
        == "reference"


def test_compact_prompt_hashes_and_grows_as_int64() -> None:
    """A waiting request's prompt is held as 4-byte ints (check's memory grows
    with the backlog of waiting prompts); its block hashes and its outputs
    are those of the int64 array it replaces."""
    from array import array

    from harness.check.model import ReqShadow, chain_hash, compact_tokens, wide_tokens

    prompt = [7, 2**31 - 1, -5, 0] * 8
    assert compact_tokens(prompt).typecode == "i"
    assert compact_tokens([1, 2**31]).typecode == "q"  # rows built in memory may hold wider ids
    req = ReqShadow("r", 0, 0.0, len(prompt), 4, 0, None, (), compact_tokens(prompt))
    assert chain_hash(None, req.token_ids[:16]) == chain_hash(None, array("q", prompt)[:16])
    wide = wide_tokens(req)
    assert wide.typecode == "q" and req.token_ids is wide and list(wide) == prompt
    wide.append(2**40)
    assert wide_tokens(req) is wide and wide[-1] == 2**40
