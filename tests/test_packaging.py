"""What ``pip install .`` must give: every command works with the runtime
dependencies alone, and torch stays optional (the ``[torch]`` extra, pinned).

- Every third-party module the packages import is a runtime dependency in
  pyproject.toml, except the three optional ones, each confined to where it is
  documented: torch (the ``[torch]`` extra; imported lazily, only by the torch
  runner and the output oracle), pytest (only the pytest plugin and the
  conformance suite, which pytest itself loads) and vLLM (only the modules that
  run inside a vLLM environment). ``harness fuzz`` once died with a
  ModuleNotFoundError because hypothesis was only a test extra.
- Without torch, ``harness record --model torch`` and ``harness
  verify-outputs`` print one line saying how to install it and exit 2.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from harness.outputs import TORCH_MISSING

ROOT = Path(__file__).resolve().parents[1]
OWN = {"reference", "workloads", "harness"}
# Optional imports -> the files allowed to import them (lazily for torch: see below).
OPTIONAL = {
    "torch": {"reference/runners/torch_model.py", "reference/runners/torch_runner.py", "harness/outputs.py",
              "harness/candidates/vllm/driver_engine_core.py", "harness/candidates/vllm/driver_platform.py",
              "harness/serve/tiny_model_script.py"},
    # The serving env's own libraries, imported only by the scripts that run there (harness/serve/).
    "transformers": {"harness/serve/tiny_model_script.py"},
    "pytest": {"harness/pytest_plugin.py", "harness/conformance.py"},
    # The driver's modules (driver.py itself imports neither vLLM nor torch).
    "vllm": {*(f"harness/candidates/vllm/driver_{m}.py" for m in (
                 "engine_core", "kv_cache_config", "kv_connector", "model_runner_output", "platform",
                 "scheduler_cls", "vllm_config")),
             "harness/candidates/vllm/events.py",
             "harness/candidates/vllm/recording_scheduler.py", "harness/serve/offline_runner.py",
             "harness/serve/cpu_async.py",
             # Loaded with -p into vLLM's own test run, in the release's env (harness vllm-tests).
             "harness/candidates/vllm/pytest_inject/sched_harness_vllm_tests.py"},
    # The [ray] extra: only harness.ray_cluster (imported inside functions, for `check --ray`
    # and `fuzz --ray`).
    "ray": {"harness/ray_cluster.py"},
    # vLLM's own dependency: the recording scheduler encodes with it inside vLLM (json when absent).
    "msgspec": {"harness/candidates/vllm/recording_scheduler.py"},
}


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _name(requirement: str) -> str:
    """The normalised distribution name of a requirement string (PEP 503)."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group(0)).lower()


def _third_party_imports() -> dict[str, set[str]]:
    """Top-level third-party module -> the files (relative paths) importing it."""
    found: dict[str, set[str]] = {}
    for top in sorted(OWN):
        for path in sorted((ROOT / top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    first = name.split(".")[0]
                    if first not in OWN and first not in sys.stdlib_module_names and first != "__future__":
                        found.setdefault(first, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_imported_library_is_a_runtime_dependency_or_a_confined_optional_one() -> None:
    runtime = {_name(r) for r in _project()["dependencies"]}
    dists = importlib.metadata.packages_distributions()
    imports = _third_party_imports()
    assert {"pyarrow", "click", "rich", "deepdiff", "hypothesis", "torch", "pytest", "vllm"} <= set(imports)
    missing = {}
    for module, files in sorted(imports.items()):
        if module in OPTIONAL:
            assert files <= OPTIONAL[module], f"{module} imported outside its place: {files - OPTIONAL[module]}"
            continue
        names = {_name(d) for d in dists.get(module, [module])}
        if not names & runtime:
            missing[module] = sorted(files)
    assert missing == {}


def test_torch_is_imported_only_lazily_outside_its_runner() -> None:
    # reference/runners/torch_* are imported only once torch is known present (harness/outputs.py);
    # everything else imports torch inside a function.
    for rel in OPTIONAL["torch"] - {"reference/runners/torch_model.py", "reference/runners/torch_runner.py"}:
        tree = ast.parse((ROOT / rel).read_text())
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        assert not any("torch" in ast.unparse(n).split() or "reference.runners.torch" in ast.unparse(n)
                       for n in top), rel


def test_extras_pin_torch_and_the_test_extra_brings_it() -> None:
    project = _project()
    extras = project["optional-dependencies"]
    assert extras["torch"] == ["torch==2.13.0"]
    assert "torch" not in {_name(r) for r in project["dependencies"]}
    assert "sched-harness[torch]" in extras["test"] and "pytest>=8" in extras["test"]
    assert "hypothesis>=6.100" in project["dependencies"]


def test_ray_extra_pinned_and_the_test_extra_brings_it() -> None:
    # The Ray corpus tests (tests/test_corpus_ray.py) run in CI because `[test]` installs `[ray]`.
    extras = _project()["optional-dependencies"]
    assert extras["ray"] == ["ray==2.60.0"]
    assert "sched-harness[ray]" in extras["test"]


def _harness_without_torch(*args: str) -> subprocess.CompletedProcess:
    # sys.modules["torch"] = None makes every `import torch` raise ImportError, as if not installed.
    code = ("import sys; sys.modules['torch'] = None; sys.argv = ['harness', *sys.argv[1:]]\n"
            "from harness.cli import main; main()")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)


def test_without_torch_the_torch_commands_say_how_to_install_it(tmp_path: Path) -> None:
    assert TORCH_MISSING == ("the torch model runner needs torch: pip install 'sched-harness[torch]' "
                             "(or pip install torch==2.13.0)")
    record = _harness_without_torch("record", "synthetic:2", "--model", "torch", "-o", str(tmp_path / "t.parquet"))
    verify = _harness_without_torch("verify-outputs", "traces/torch-tiny.parquet")
    for proc in (record, verify):
        assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", f"error: {TORCH_MISSING}\n")
    assert not (tmp_path / "t.parquet").exists()
    # The scripted runner still works in the same torch-less interpreter.
    ok = _harness_without_torch("record", "synthetic:2", "-o", str(tmp_path / "s.parquet"))
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "s.parquet").exists()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel ``pip install .`` would install, built once for this module
    from a fresh copy of the sources: a checkout's build/ and *.egg-info keep
    files from earlier builds, which would hide a file pyproject.toml no
    longer ships."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("reference", "workloads", "harness", "golden", "traces"):  # traces/scenarios: harness.library
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out), str(src)], check=True, capture_output=True)
    (built,) = out.glob("sched_harness-*.whl")
    return built


def _wheel_only_env(site: Path) -> dict[str, str]:
    """The environment for ``python -S`` to import the project from the wheel installed at
    ``site`` and the third-party libraries from this venv: ``-S`` skips the .pth files, so the
    editable install's finder (which resolves any subpackage of ``reference`` or ``harness``
    from the checkout) cannot hide a module the wheel lacks."""
    import sysconfig

    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), sysconfig.get_paths()["purelib"]])}


def test_regression_wheel_lacked_reference_kv_and_pytest_inject(wheel: Path) -> None:
    """Regression (new-user trial): ``pip install .`` shipped neither reference/kv/ (the hybrid
    KV cache, imported by reference/scheduler.py: every command died on "No module named
    'reference.kv'") nor harness/candidates/vllm/pytest_inject/ (``harness vllm-tests``): the
    package list in pyproject.toml had not been extended, and the editable install's finder hid
    it from the installed-wheel test. Every Python file of the sources is in the wheel."""
    import zipfile

    with zipfile.ZipFile(wheel) as zf:
        shipped = {n for n in zf.namelist() if n.endswith(".py")}
    sources = {p.relative_to(ROOT).as_posix() for top in OWN for p in (ROOT / top).rglob("*.py")
               if "__pycache__" not in p.parts}
    assert sorted(sources - shipped) == []


def _shipped(wheel: Path, folder: str) -> dict[str, bytes]:
    """``{file name: bytes}`` of the wheel's files directly in ``folder``."""
    import zipfile

    with zipfile.ZipFile(wheel) as zf:
        return {Path(n).name: zf.read(n) for n in zf.namelist() if str(Path(n).parent) == folder}


def test_the_wheel_ships_every_golden_byte_for_byte(wheel: Path) -> None:
    """Regression: after ``pip install .`` (not -e), ``harness golden check`` and
    ``pytest --pyargs harness.conformance`` looked for site-packages/golden and
    found nothing (the plugin then skipped every golden replay). The wheel now
    carries golden/ as the package data ``harness/goldens/``."""
    shipped = _shipped(wheel, "harness/goldens")
    expected = {p.name: p.read_bytes() for p in (ROOT / "golden").iterdir()
                if p.suffix == ".parquet" or p.name == "MANIFEST.json"}
    assert sorted(shipped) == sorted(expected) and len(expected) == 21
    assert shipped == expected


def test_the_wheel_ships_the_hybrid_goldens_and_scenario_files_byte_for_byte(wheel: Path) -> None:
    """Issue 28: golden/hybrid/ and harness/scenarios/hybrid/ (HYBRID_SCENARIOS,
    loaded at import) travel with an installed harness as well."""
    goldens = {p.name: p.read_bytes() for p in (ROOT / "golden" / "hybrid").iterdir()}
    assert sorted(goldens) == ["MANIFEST.json", "hybrid-alternating.parquet", "hybrid-five-to-one.parquet",
                               "hybrid-mamba.parquet"]
    assert _shipped(wheel, "harness/goldens/hybrid") == goldens
    scenarios = {p.name: p.read_bytes() for p in (ROOT / "harness" / "scenarios" / "hybrid").glob("*.toml")}
    assert len(scenarios) == 3 and _shipped(wheel, "harness/scenarios/hybrid") == scenarios


def test_the_wheel_ships_the_lora_scenario_files_byte_for_byte(wheel: Path) -> None:
    """harness/scenarios/lora/ (LORA_SCENARIOS, loaded at import: the mutation self-test's
    LoRA scenarios) travels with an installed harness."""
    scenarios = {p.name: p.read_bytes() for p in (ROOT / "harness" / "scenarios" / "lora").glob("*.toml")}
    assert sorted(scenarios) == ["lora-adapters.toml"]
    assert _shipped(wheel, "harness/scenarios/lora") == scenarios


def test_the_wheel_ships_every_canonical_scenario_file_byte_for_byte(wheel: Path) -> None:
    """The goldens are recordings of harness/scenarios/*.toml, and an installed
    harness builds ``SCENARIOS`` from those files at import: without them
    ``golden check``, ``mutants`` and the conformance plugin cannot start."""
    shipped = {name: data for name, data in _shipped(wheel, "harness/scenarios").items()
               if name.endswith(".toml")}
    expected = {p.name: p.read_bytes() for p in (ROOT / "harness" / "scenarios").glob("*.toml")}
    assert sorted(shipped) == sorted(expected) and len(expected) == 20
    assert shipped == expected
    assert "__init__.py" in _shipped(wheel, "harness/scenarios")


def test_golden_update_refuses_the_installed_copy(tmp_path: Path, monkeypatch) -> None:
    """Regression: with no checkout, ``harness golden update`` wrote new goldens into
    site-packages and left the installed copy inconsistent."""
    from harness import golden

    packaged = tmp_path / "goldens"
    packaged.mkdir()
    monkeypatch.setattr(golden, "CHECKOUT_DIR", tmp_path / "no-checkout")
    monkeypatch.setattr(golden, "PACKAGED_DIR", packaged)
    try:
        golden.update_goldens(packaged, ["fcfs-tight"])
    except golden.GoldenError as exc:
        assert str(exc) == (f"{packaged}: the installed package's copy of the goldens; "
                            f"re-record into a checkout's golden/ or pass --dir")
    else:
        raise AssertionError("update_goldens wrote into the installed copy")
    assert list(packaged.iterdir()) == []


def test_vllm_envs_live_in_the_user_cache_when_installed(tmp_path: Path, monkeypatch) -> None:
    """Regression: a non-editable install looked for vLLM environments under
    site-packages/.vllm-envs (the "repository root" of an installed package)."""
    from harness.candidates.vllm import env

    monkeypatch.delenv("HARNESS_VLLM_ENVS", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert env.envs_root() == ROOT / ".vllm-envs"  # a checkout keeps its own
    monkeypatch.setattr(env, "REPO_ROOT", tmp_path / "site-packages")
    assert env.envs_root() == tmp_path / "cache" / "sched-harness" / "vllm-envs"
    monkeypatch.setenv("HARNESS_VLLM_ENVS", str(tmp_path / "mine"))
    assert env.envs_root() == tmp_path / "mine"


def test_an_installed_harness_builds_scenarios_from_its_files_and_checks_its_goldens(
        wheel: Path, tmp_path: Path) -> None:
    """From the wheel alone (no checkout on the path, run from another folder),
    ``SCENARIOS`` comes from site-packages' harness/scenarios/*.toml and
    ``harness golden check`` passes on the packaged goldens."""
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target",
                    str(site), str(wheel)], check=True, capture_output=True)
    env = _wheel_only_env(site)
    code = ("import sys; from harness.scenarios import DIRECTORY, SCENARIOS; "
            "print(DIRECTORY, len(SCENARIOS), next(iter(SCENARIOS)))")
    where = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd=tmp_path,
                           env=env, check=True)
    assert where.stdout == f"{site / 'harness' / 'scenarios'} 20 fcfs-tight\n"
    check = subprocess.run([sys.executable, "-S", "-c", "from harness.cli import main; main()", "golden",
                            "check"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.splitlines()[-1] == f"20 ok, 0 failed ({site / 'harness' / 'goldens'}, candidate reference)"
