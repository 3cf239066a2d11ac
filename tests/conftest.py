"""Shared fixtures, and how ``pytest -n N --dist loadgroup`` (``make test``) splits the suite.

Under pytest-xdist each worker is its own process, with its own pool of idle
vLLM driver processes (``harness/candidates/vllm/candidate.py``: importing
vLLM costs 5-17 s per driver) and its own copy of every module-scoped
fixture. ``pytest_collection_modifyitems`` below therefore puts every test
that drives real vLLM through the pool (marked ``vllm``, outside
``tests/test_encoder.py``'s and ``tests/test_vllm_recording.py``'s own
subprocesses) in one ``xdist_group``, so one worker pays those imports, and
keeps each module whose module-scoped fixture is costly (the vLLM recording
drive) on one worker. Other module-scoped fixtures cost under half a second
or serve one test, so those modules' tests spread over the workers one by
one. Without xdist the marks do nothing.
"""
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from harness.trace import METADATA_KEY, READABLE_VERSIONS, SCHEMA_VERSION, SUMMARY_KEY

pytest_plugins = ["pytester"]

#: Modules whose tests share a costly module-scoped fixture, each kept on one
#: xdist worker: the vLLM recording drive (~7 s on an idle 2-core machine,
#: one vLLM import of its own).
_ONE_WORKER_MODULES = {"test_vllm_recording.py": "vllm-recording"}
#: Modules whose ``vllm``-marked tests run their own vLLM process rather than
#: the pool: free to run on any worker.
_OWN_VLLM_PROCESS = {"test_encoder.py"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Add ``xdist_group`` marks (read by ``--dist loadgroup``; see the module docstring)."""
    for item in items:
        module = item.path.name
        if module in _ONE_WORKER_MODULES:
            item.add_marker(pytest.mark.xdist_group(_ONE_WORKER_MODULES[module]))
        elif item.get_closest_marker("vllm") and module not in _OWN_VLLM_PROCESS:
            item.add_marker(pytest.mark.xdist_group("vllm-pool"))


@pytest.fixture
def schema3_copy():
    """``copy(path, out) -> out``: rewrite a current trace as schema 3 wrote
    it (the columns schema 3 lacked dropped, the version set to 3, the
    footer summary kept), to show older traces still read."""
    def copy(path: Path, out: Path) -> Path:
        source = pq.ParquetFile(path)
        table = source.read().drop_columns(list(READABLE_VERSIONS[3]))
        meta = dict(table.schema.metadata)
        info = json.loads(meta[METADATA_KEY])
        assert info["schema_version"] == SCHEMA_VERSION
        info["schema_version"] = 3
        meta[METADATA_KEY] = json.dumps(info, sort_keys=True).encode()
        with pq.ParquetWriter(out, table.schema.with_metadata(meta)) as writer:
            writer.write_table(table.replace_schema_metadata(meta))
            writer.add_key_value_metadata({SUMMARY_KEY: source.metadata.metadata[SUMMARY_KEY]})
        return out
    return copy
