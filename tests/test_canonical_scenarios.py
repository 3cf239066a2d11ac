"""The canonical scenarios as files (harness/scenarios/*.toml, a ``[synthetic]``
table each; docs/scenario-format.md): ``SCENARIOS`` is loaded from them in the
order the goldens have always been listed in; ``harness record`` of each file
writes its golden byte for byte (the workload's provenance is synthetic's, as
the golden's metadata records); an edited file makes its golden stale; a bad
``[synthetic]`` table exits 2 with ``file:line: problem`` and writes nothing."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from harness import scenarios as canonical
from harness.cli import main
from harness.golden import check_goldens
from harness.scenarios import DIRECTORY, ORDER, SCENARIOS, load_canonical
from harness.trace import open_trace
from workloads import synthetic
from workloads.scenario import ScenarioError, load_scenario

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "golden"


def test_scenarios_are_the_files_in_the_goldens_order() -> None:
    assert DIRECTORY == ROOT / "harness" / "scenarios"
    assert sorted(p.stem for p in DIRECTORY.glob("*.toml")) == sorted(ORDER)
    assert list(SCENARIOS) == list(ORDER) and len(SCENARIOS) == 20
    assert list(SCENARIOS)[:3] == ["fcfs-tight", "fcfs-roomy", "priority-tight"]
    assert list(SCENARIOS)[-1] == "async-spec-decode"
    assert all(s.name == name and s.path == DIRECTORY / f"{name}.toml" for name, s in SCENARIOS.items())
    # The manifest (what `golden update` wrote) carries each description: the files keep them.
    entries = json.loads((GOLDEN / "MANIFEST.json").read_text())["scenarios"]
    assert {n: s.description for n, s in SCENARIOS.items()} == {n: e["description"] for n, e in entries.items()}


def test_a_canonical_file_is_short_config_plus_synthetic() -> None:
    s = SCENARIOS["fcfs-tight"]
    assert s.config == {"block_size": 4, "max_model_len": 96, "max_num_seqs": 4, "max_num_batched_tokens": 64,
                        "num_gpu_blocks": 30}
    assert (s.workload, s.seed) == ({"num_requests": 60}, 0)
    enc = SCENARIOS["encoder-inputs"]
    assert enc.workload == {"num_requests": 60, "priority_levels": 3, "arrival_rate": 80.0, "prompt_len": [1, 32],
                            "output_len": [1, 24], "mm_fraction": 1.0, "mm_item_len": 4,
                            "mm_items_per_request": 6, "mm_distinct_items": 16}
    assert enc.make_workload() == synthetic(60, seed=0, priority_levels=3, arrival_rate=80.0, prompt_len=(1, 32),
                                            output_len=(1, 24), mm_fraction=1.0, mm_item_len=4,
                                            mm_items_per_request=6, mm_distinct_items=16)
    assert max(len(p.read_text().splitlines()) for p in DIRECTORY.glob("*.toml")) <= 30


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_recording_the_file_writes_its_golden_byte_for_byte(name: str, tmp_path: Path) -> None:
    out = tmp_path / "T.parquet"
    r = CliRunner().invoke(main, ["record", str(DIRECTORY / f"{name}.toml"), "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert out.read_bytes() == (GOLDEN / f"{name}.parquet").read_bytes()
    # The provenance the golden records is synthetic's, and the file (through
    # load_scenario, as `harness record` reads it) builds that very workload.
    meta = open_trace(GOLDEN / f"{name}.parquet").meta
    loaded = load_scenario(DIRECTORY / f"{name}.toml")
    assert loaded.workload == SCENARIOS[name].make_workload()
    assert meta["workload"] == {"source": "synthetic", "sha256": loaded.workload.sha256,
                                "params": loaded.workload.params}
    assert meta["config_fingerprint"] == loaded.engine_config().fingerprint() \
        == SCENARIOS[name].engine_config().fingerprint()
    assert meta["seed"] == loaded.seed == 0


def test_an_edited_file_makes_its_golden_stale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    edited = tmp_path / "chunked-threshold.toml"
    edited.write_text((DIRECTORY / "chunked-threshold.toml").read_text()
                      .replace("num_requests = 30", "num_requests = 31"))
    monkeypatch.setitem(SCENARIOS, "chunked-threshold", load_canonical(edited))
    results = {r.scenario: r for r in check_goldens(GOLDEN)}
    assert results["chunked-threshold"].reason.startswith(
        "stale: workload changed (num_requests 30 -> 31); run 'harness golden update'")
    assert sum(r.ok for r in results.values()) == len(SCENARIOS) - 1


def test_synthetic_seed_defaults_to_the_scenarios_and_may_differ(tmp_path: Path) -> None:
    src = tmp_path / "s.toml"
    src.write_text('format_version = 1\nseed = 3\n[config]\nblock_size = 4\nmax_model_len = 96\n'
                   'num_gpu_blocks = 30\n[synthetic]\nnum_requests = 5\n')
    assert load_scenario(src).workload == synthetic(5, seed=3)
    src.write_text(src.read_text() + "seed = 5\n")
    loaded = load_scenario(src)
    assert (loaded.seed, loaded.synthetic, loaded.workload) == (3, {"num_requests": 5, "seed": 5},
                                                                synthetic(5, seed=5))
    out = tmp_path / "t.parquet"
    r = CliRunner().invoke(main, ["record", str(src), "-o", str(out)])
    assert r.exit_code == 0, r.output
    meta = open_trace(out).meta
    assert (meta["seed"], meta["workload"]["params"]["seed"]) == (3, 5)  # model seed 3, generator seed 5


BASE = 'format_version = 1\ndescription = "d"\n\n[config]\nblock_size = 4\nmax_model_len = 96\nnum_gpu_blocks = 30\n'


@pytest.mark.parametrize("body, line, problem", [
    (BASE + "\n[synthetic]\nnum_requests = 4\ncolour = 1\n", 11, "synthetic: unknown key 'colour' (known: "
     "num_requests, seed, prompt_len, output_len, arrival_rate, shared_prefix_len, shared_prefix_fraction, "
     "priority_levels, eos_fraction, abort_fraction, mm_fraction, mm_item_len, mm_items_per_request, "
     "mm_distinct_items)"),
    (BASE + "\n[synthetic]\nnum_requests = 4\nprompt_len = [5, 2]\n", 11,
     "synthetic: prompt_len must be ints with 1 <= low <= high, got [5, 2]"),
    (BASE + "\n[synthetic]\nnum_requests = 4\nprompt_len = [1, 2, 3]\n", 11,
     "synthetic.prompt_len: [1, 2, 3] is too long"),
    (BASE + "\n[synthetic]\nnum_requests = 4\nprompt_len = [1, 2.5]\n", 11,
     "synthetic.prompt_len[1]: 2.5 is not of type 'integer'"),
    (BASE + "\n[synthetic]\nnum_requests = 0\n", 10, "synthetic.num_requests: 0 is less than the minimum of 1"),
    (BASE + "\n[synthetic]\nnum_requests = 4.0\n", 10, "synthetic.num_requests: 4.0 is not of type 'integer'"),
    (BASE + "\n[synthetic]\nnum_requests = 4\neos_fraction = 1.5\n", 11,
     "synthetic.eos_fraction: 1.5 is greater than the maximum of 1"),
    (BASE + "\n[synthetic]\nnum_requests = 4\narrival_rate = 0\n", 11,
     "synthetic.arrival_rate: 0 is less than or equal to the minimum of 0"),
    (BASE + "\n[synthetic]\nnum_requests = 4\narrival_rate = nan\n", 11,
     "synthetic: arrival_rate must be a number > 0 (req/s), got nan"),
    (BASE + "\n[synthetic]\noutput_len = [1, 2]\n", 9, "synthetic: 'num_requests' is a required property"),
    (BASE, 1, "give exactly one of [[requests]] and [synthetic], got neither"),
    (BASE + '\n[synthetic]\nnum_requests = 4\n\n[[requests]]\nrequest_id = "A"\nprompt_len = 4\n'
     "arrival_step = 0\n", 9, "give exactly one of [[requests]] and [synthetic], got both"),
])
def test_bad_synthetic_exits_2_with_file_line_problem(tmp_path: Path, body: str, line: int, problem: str) -> None:
    src = tmp_path / "bad.toml"
    src.write_text(body)
    r = CliRunner().invoke(main, ["record", str(src), "-o", str(tmp_path / "t.parquet")])
    assert (r.exit_code, r.output) == (2, f"error: {src}:{line}: {problem}\n")
    assert list(tmp_path.iterdir()) == [src]  # nothing written


def test_json_synthetic_gives_the_same_workload_and_the_tables_line(tmp_path: Path) -> None:
    import tomllib

    doc = tomllib.loads((DIRECTORY / "kv-connector.toml").read_text())
    src = tmp_path / "kv-connector.json"
    src.write_text(json.dumps(doc, indent=2))
    assert load_scenario(src).workload == SCENARIOS["kv-connector"].make_workload()
    doc["seed"], doc["synthetic"]["seed"] = 0, -1.5
    src.write_text(json.dumps(doc, indent=2))
    line = next(i + 1 for i, text in enumerate(src.read_text().splitlines()) if '"seed": -1.5' in text)
    with pytest.raises(ScenarioError) as exc:
        load_scenario(src)
    assert str(exc.value) == f"{src}:{line}: synthetic.seed: -1.5 is not of type 'integer'"


def test_load_canonical_refuses_requests_files_and_missing_descriptions(tmp_path: Path) -> None:
    listed = ROOT / "traces" / "scenarios" / "stop-token.toml"
    with pytest.raises(ScenarioError) as exc:
        load_canonical(listed)
    assert str(exc.value) == f"{listed}:1: a canonical scenario's workload is a [synthetic] table, not [[requests]]"
    bare = tmp_path / "bare.toml"
    bare.write_text((DIRECTORY / "fcfs-tight.toml").read_text().replace("description", "# description"))
    with pytest.raises(ScenarioError) as exc:
        load_canonical(bare)
    assert str(exc.value) == f"{bare}:1: a canonical scenario needs a one-line description"


def test_a_missing_listed_file_fails_and_extra_files_follow_by_name(tmp_path: Path) -> None:
    folder = tmp_path / "scenarios"
    shutil.copytree(DIRECTORY, folder, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    shutil.copy(folder / "fcfs-roomy.toml", folder / "zz-extra.toml")
    shutil.copy(folder / "fcfs-roomy.toml", folder / "aa-extra.toml")
    loaded = canonical._load_all(folder)
    assert list(loaded) == list(ORDER) + ["aa-extra", "zz-extra"]
    assert dataclasses.replace(loaded["zz-extra"], name="fcfs-roomy", path=None) == \
        dataclasses.replace(SCENARIOS["fcfs-roomy"], path=None)
    (folder / "pipeline-3.toml").unlink()
    with pytest.raises(ScenarioError) as exc:
        canonical._load_all(folder)
    assert str(exc.value) == (f"{folder / 'pipeline-3.toml'}:1: canonical scenario file missing "
                              f"(named in harness.scenarios.ORDER)")
