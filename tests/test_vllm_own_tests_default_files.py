"""``bench/vllm_own_tests.py``'s default (issue 22): every file of a release's tests/v1/core that
builds a scheduler, found in that release's own tests (``own_tests.scheduler_test_files``).

The first test needs nothing; the second reads the sdists' tests cached beside the vLLM envs
(``harness vllm-tests`` extracts them) and is skipped where they are not.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.candidates.vllm.own_tests import scheduler_test_files


def test_a_file_builds_a_scheduler_by_a_helper_or_a_scheduler_call_not_a_connectors(tmp_path: Path) -> None:
    core = tmp_path / "tests" / "v1" / "core"
    (core / "prefix_cache").mkdir(parents=True)
    files = {
        "test_a.py": "scheduler = create_scheduler(async_scheduling=True)\n",
        "test_b.py": "s = create_scheduler_with_priority(model=M)\n",
        "test_c.py": "return Scheduler(\n    vllm_config=vllm_config,\n",
        "test_d.py": "s = AsyncScheduler(vllm_config=c)\n",
        "test_e.py": "connector = NixlPullConnectorScheduler(config)\n",  # a KV connector's side
        "test_f.py": "Scheduler._mamba_block_aligned_split(stub, request, 3)\n",  # a stub: no scheduler
        "utils.py": "def create_scheduler(\n",  # not a test file
        "prefix_cache/test_g.py": "from ..utils import create_scheduler\ns = create_scheduler()\n",
    }
    for name, text in files.items():
        (core / name).write_text(text)
    assert scheduler_test_files(tmp_path) == [
        "tests/v1/core/prefix_cache/test_g.py", "tests/v1/core/test_a.py", "tests/v1/core/test_b.py",
        "tests/v1/core/test_c.py", "tests/v1/core/test_d.py"]


EXPECTED = {
    "0.33.0": ["test_async_scheduler.py", "test_deferred_block_free.py", "test_prefix_caching.py",
               "test_prefix_replay.py", "test_priority_preemption_bug.py", "test_priority_scheduler_random.py",
               "test_scheduler.py", "test_swa_inflight_window_free.py", "test_worker_slot_overflow.py"],
    "0.29.0": ["test_async_scheduler.py", "test_deferred_block_free.py", "test_priority_preemption_bug.py",
               "test_priority_scheduler_random.py", "test_scheduler.py", "test_swa_inflight_window_free.py",
               "test_worker_slot_overflow.py"],
    "0.25.0": ["test_async_scheduler.py", "test_deferred_block_free.py", "test_priority_scheduler_random.py",
               "test_scheduler.py", "test_worker_slot_overflow.py"],
}


@pytest.mark.parametrize("version", sorted(EXPECTED))
def test_the_default_files_of_the_cached_releases(version: str) -> None:
    from harness.candidates.vllm.own_tests import sdist_path

    root = sdist_path(version).with_name(f"vllm-{version}-tests")
    if not (root / ".complete").is_file():
        pytest.skip(f"vLLM {version}'s tests are not extracted beside the envs ({root})")
    assert scheduler_test_files(root) == [f"tests/v1/core/{name}" for name in EXPECTED[version]]
