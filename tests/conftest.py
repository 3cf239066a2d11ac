"""Shared fixtures, and how ``pytest -n N --dist loadgroup`` (``make test``) splits the suite.

Under pytest-xdist each worker is its own process, with its own pool of idle
vLLM driver processes (``harness/candidates/vllm/candidate.py``: importing
vLLM costs 5-17 s per driver) and its own copy of every module-scoped
fixture. So the modules that drive real vLLM through that pool
(``tests/test_vllm.py``, the give-back finding's replay) run on one worker,
which pays those imports once, and so does ``tests/test_vllm_recording.py``,
whose module fixture is one vLLM drive (~7 s on an idle 2-core machine).
Every other test is scheduled on its own: their module-scoped fixtures cost
under half a second or serve one test, and ``tests/test_encoder.py``'s vLLM
comparison runs a vLLM process of its own.

The grouping is by module path, in ``pytest_xdist_make_scheduler``, rather
than by ``xdist_group`` marks: pytest-xdist 3.8's loadgroup renames node ids
to carry the mark, which pytest 9.2's structured node ids ignore, so the
marks silently group nothing (pytest-xdist issue 1386). Without xdist, or
with another ``--dist``, nothing here applies.
"""
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from harness.trace import METADATA_KEY, SCHEMA_VERSION, SUMMARY_KEY, open_trace
from harness.trace.schema import absent_columns, rows_as_of

pytest_plugins = ["pytester"]

# The suite's exact-output checks of vllm@ runs (CliRunner's stderr is no terminal) must not
# meet the one-line "starting vLLM ... drivers" notice (harness/candidates/vllm/candidate.py);
# tests/test_regression_piped_vllm_run_said_nothing_for_minutes.py turns it back on.
os.environ.setdefault("HARNESS_VLLM_START_NOTICE", "0")

#: Test modules kept on one xdist worker, by group (see the module docstring).
ONE_WORKER_MODULES = {
    "tests/test_vllm.py": "vllm-pool",
    "tests/test_vllm_async_spec.py": "vllm-pool",
    "tests/test_fuzz_vllm_pool.py": "vllm-pool",
    "tests/test_finding_give_back_uncomputed_hit.py": "vllm-pool",
    "tests/test_finding_vllm_0_20_2_resume_before_stale_output.py": "vllm-pool",
    "tests/test_finding_swa_bounded_replay_first_block_nulled.py": "vllm-pool",
    "tests/test_vllm_versions.py": "vllm-pool",
    "tests/test_vllm_scheduler_cls.py": "vllm-pool",
    "tests/test_vllm_path.py": "vllm-pool",
    "tests/test_vllm_kv_connector_recorded.py": "vllm-pool",
    "tests/test_vllm_releases.py": "vllm-releases",
    "tests/test_vllm_recording.py": "vllm-recording",
    # Real vLLM serving a tiny model: one serving env, one model, CPU-heavy runs in sequence.
    "tests/test_serve.py": "vllm-serve",
    "tests/test_serve_candidate_class.py": "vllm-serve",
    "tests/test_serve_async.py": "vllm-serve",
}


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: absent without xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadgroup`` with ``ONE_WORKER_MODULES`` as the groups; None otherwise."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class ModuleGroupScheduling(LoadGroupScheduling):
        """Each ``ONE_WORKER_MODULES`` group is one work unit (xdist sends
        the largest units first); any other test is a unit of its own."""

        def _split_scope(self, nodeid: str) -> str:
            group = ONE_WORKER_MODULES.get(nodeid.split("::", 1)[0])
            return group if group is not None else super()._split_scope(nodeid)

    return ModuleGroupScheduling(config, log)


def old_schema_copy(path: Path, out: Path, version: int) -> Path:
    """Rewrite a current trace as schema ``version`` wrote it: the columns it
    lacked dropped (``absent_columns``), no ``request_state`` rows
    (``event_index`` renumbered, ``rows_as_of``), the version set, the
    footer summary's event count adjusted; to show older traces still read."""
    source = pq.ParquetFile(path)
    table = source.read()
    schema = pa.schema([f for f in table.schema if f.name not in absent_columns(version)])
    kept: list[dict] = []
    # The reader's rows: queues whole (schema 8 stores them as changes, older versions whole).
    for _, step_rows in open_trace(path).iter_steps():
        kept += rows_as_of(version, step_rows)
    meta = dict(table.schema.metadata)
    info = json.loads(meta[METADATA_KEY])
    assert info["schema_version"] == SCHEMA_VERSION
    info["schema_version"] = version
    meta[METADATA_KEY] = json.dumps(info, sort_keys=True).encode()
    summary = json.loads(source.metadata.metadata[SUMMARY_KEY])
    summary["events"] = len(kept)
    summary.pop("trace_sha256", None)  # schema 7's digest: older versions had none
    schema = schema.with_metadata(meta)
    with pq.ParquetWriter(out, schema) as writer:
        writer.write_table(pa.Table.from_pylist([{c: r[c] for c in schema.names} for r in kept], schema=schema))
        writer.add_key_value_metadata({SUMMARY_KEY: json.dumps(summary, sort_keys=True)})
    return out


@pytest.fixture
def old_schema():
    """``copy(path, out, version) -> out``: ``old_schema_copy``."""
    return old_schema_copy


@pytest.fixture
def schema3_copy():
    """``copy(path, out) -> out``: a current trace rewritten as schema 3 wrote it
    (``old_schema_copy``)."""
    return lambda path, out: old_schema_copy(path, out, 3)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``HARNESS_SKIP_VLLM=1`` skips every ``vllm``-marked test, with the reason
    given in ``HARNESS_SKIP_VLLM_REASON`` if set (``.ci/run`` sets both when the
    disk has too little room for the vLLM environments)."""
    import os

    if os.environ.get("HARNESS_SKIP_VLLM") != "1":
        return
    reason = os.environ.get("HARNESS_SKIP_VLLM_REASON") or "HARNESS_SKIP_VLLM=1"
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def _vllm_env_built(request: pytest.FixtureRequest) -> None:
    """Every ``vllm``-marked test may drive vLLM 0.33.0: its environment is built
    first (once; ``ensure_env`` holds a file lock, so xdist workers never build it
    twice). Regression: under ``-n 2`` the give-back finding's vLLM replay ran on
    a fresh clone before any test of its worker had built the environment, and
    failed with "the vLLM 0.33.0 env is not built". A skipped test (HARNESS_SKIP_VLLM=1)
    never reaches this fixture."""
    if request.node.get_closest_marker("vllm") is None:
        return
    from harness.candidates.vllm.env import ensure_env

    ensure_env("0.33.0")


@pytest.fixture
def refused_scenario(tmp_path: Path):
    """``refused(body, line, problem)``: ``harness record`` of a scenario file holding
    ``body`` exits 2 with one line naming ``file:line`` and ``problem``, and writes nothing."""
    from click.testing import CliRunner

    from harness.cli import main

    def refused(body: str, line: int, problem: str) -> None:
        src = tmp_path / "bad.toml"
        src.write_text(body)
        r = CliRunner().invoke(main, ["record", str(src), "-o", str(tmp_path / "t.parquet")])
        assert r.exit_code == 2, r.output
        assert r.output.count("\n") == 1 and f"{src}:{line}: " in r.output and problem in r.output, r.output
        assert list(tmp_path.iterdir()) == [src]  # nothing written
    return refused


@pytest.fixture
def vllm_0_33_0_tests() -> None:
    """Skip unless vLLM 0.33.0's own tests can run here: the vLLM tier is on
    (not HARNESS_SKIP_VLLM=1) and its sdist is cached or can be fetched (the
    tests `harness vllm-tests 0.33.0` runs)."""
    import os

    if os.environ.get("HARNESS_SKIP_VLLM") == "1":
        pytest.skip("HARNESS_SKIP_VLLM=1")
    from harness.candidates.vllm.own_tests import OwnTestsError, fetch_sdist

    try:
        fetch_sdist("0.33.0")
    except OwnTestsError as exc:  # no index reachable and nothing cached
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def classes_env():
    """vLLM 0.33.0 built, and tests/vllm_classes on PYTHONPATH (the vLLM driver
    imports a ``scheduler_cls`` module from there); PYTHONPATH restored after."""
    import sys

    from harness.candidates.vllm.env import ensure_env

    ensure_env("0.33.0", log=lambda line: print(f"vllm-env: {line}", file=sys.stderr))
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(Path(__file__).resolve().parent / "vllm_classes")
    yield
    if old is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old
