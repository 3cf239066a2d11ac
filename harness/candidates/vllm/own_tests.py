"""vLLM's own scheduler tests as a corpus: ``harness vllm-tests VERSION`` (fetch, run twice, record).

A release's source distribution on PyPI holds its unit tests (``tests/v1/core``:
``test_scheduler.py``, ``test_prefix_caching.py``, ... and ``utils.py`` with
``create_scheduler``). This module

* fetches ``vllm-VERSION.tar.gz`` from the package index pip is configured with
  (``PIP_INDEX_URL`` or pip's ``global.index-url``, default PyPI), through its
  JSON simple API (PEP 691), without building it, checks its sha256 against the
  index's, and caches it beside the vLLM envs (``<envs root>/sdists/``);
* extracts only ``tests/`` and ``pyproject.toml`` (the pytest markers) next to
  it; vLLM's tests are never copied into this repository;
* installs what the tests import and the release's env lacks (pytest, tblib,
  pytest-asyncio, pytest-mock at the release's own pins from
  ``requirements/test/*.txt``), adding packages only: every package already in
  the env is held at its version (a constraints file of ``pip freeze``);
* writes the offline model config the tests build their ``ModelConfig`` from
  (an HF cache holding only facebook/opt-125m's ``config.json``);
* runs the chosen test files twice in the release's env: plain, and with the
  recording scheduler injected into every ``Scheduler``/``AsyncScheduler`` the
  tests build (``pytest_inject/sched_harness_vllm_tests.py``), one recording per
  scheduler.

``harness.vllm_tests_report.py`` turns the two runs and the
recordings into the report (convert, check, replay).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import time
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from harness.candidates.vllm.env import env_python, envs_root, is_ready

DEFAULT_FILES = ("tests/v1/core/test_scheduler.py", "tests/v1/core/test_prefix_caching.py")
#: A test file that builds a scheduler: vLLM's ``create_scheduler`` helpers
#: (``tests/v1/core/utils.py``, ``create_scheduler_with_priority``) or a ``Scheduler(``
#: / ``AsyncScheduler(`` call (not a ``...ConnectorScheduler(``: a KV connector's side).
_BUILDS_SCHEDULER = re.compile(r"\bcreate_scheduler\w*\(|\b(?:Async)?Scheduler\(")
#: Test-only packages vLLM's tests/conftest.py and tests/v1/core import (the rest
#: come with vLLM). Pinned at the release's requirements/test/*.txt versions.
TEST_PACKAGES = ("pytest", "tblib", "pytest-asyncio", "pytest-mock")
PLUGIN_DIR = Path(__file__).resolve().parent / "pytest_inject"
PLUGIN = "sched_harness_vllm_tests"


class OwnTestsError(RuntimeError):
    """The release's tests cannot be fetched, prepared or run; one line."""


Log = Callable[[str], None]


def _index_url() -> str:
    """The index pip uses: ``PIP_INDEX_URL``, else pip's ``global.index-url``, else PyPI."""
    url = os.environ.get("PIP_INDEX_URL")
    if not url:
        try:
            out = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"],
                                 capture_output=True, text=True, timeout=60)
            url = out.stdout.strip() if out.returncode == 0 else ""
        except (OSError, subprocess.TimeoutExpired):
            url = ""
    return (url or "https://pypi.org/simple").rstrip("/")


def sdist_path(version: str) -> Path:
    """Where the release's sdist is cached (``<envs root>/sdists/vllm-VERSION.tar.gz``)."""
    return envs_root() / "sdists" / f"vllm-{version}.tar.gz"


def fetch_sdist(version: str, log: Log = lambda _: None) -> Path:
    """The cached sdist of vLLM ``version``, downloaded first if absent: the
    index's JSON page for ``vllm`` names the file and its sha256; the download
    goes to a ``.part`` file, is checked, then renamed. Raises OwnTestsError
    (no such release, no sdist, a hash mismatch, the network)."""
    target = sdist_path(version)
    digest_file = target.with_name(target.name + ".sha256")
    if target.is_file() and digest_file.is_file():
        return target
    name = f"vllm-{version}.tar.gz"
    index = _index_url()
    try:
        req = urllib.request.Request(f"{index}/vllm/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            page = json.load(resp)
    except (OSError, ValueError) as exc:
        raise OwnTestsError(f"cannot read {index}/vllm/ (the package index pip uses): {exc}") from None
    found = next((f for f in page.get("files", ()) if f.get("filename") == name), None)
    if found is None or "sha256" not in (found.get("hashes") or {}):
        raise OwnTestsError(f"{index}/vllm/ lists no {name} with a sha256 (is {version} a release "
                            f"with a source distribution?)")
    url, want = found["url"], found["hashes"]["sha256"]
    if not re.match(r"^[a-z]+://", url):
        url = urllib.parse.urljoin(f"{index}/vllm/", url)
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(f".{name}.{os.getpid()}.part")
    log(f"downloading {name} ({found.get('size', 0) / 1e6:.0f} MB) from {index}")
    h = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=120) as resp, open(part, "wb") as fh:
            while chunk := resp.read(1 << 20):
                h.update(chunk)
                fh.write(chunk)
        if h.hexdigest() != want:
            raise OwnTestsError(f"{name}: sha256 {h.hexdigest()} is not the index's {want}")
        os.replace(part, target)
        digest_file.write_text(want + "\n")
    except OSError as exc:
        raise OwnTestsError(f"cannot download {url}: {exc}") from None
    finally:
        part.unlink(missing_ok=True)
    return target


def extract_tests(version: str, sdist: Path, log: Log = lambda _: None) -> Path:
    """``<envs root>/sdists/vllm-VERSION-tests`` holding the sdist's ``tests/`` and
    ``pyproject.toml`` (and its ``requirements/test`` pins), extracted once."""
    root = sdist.with_name(f"vllm-{version}-tests")
    done = root / ".complete"
    if done.is_file():
        return root
    log(f"extracting tests/ of {sdist.name}")
    tmp = root.with_name(f".{root.name}.{os.getpid()}.tmp")
    prefix = f"vllm-{version}/"
    keep = ("tests/", "pyproject.toml", "requirements/test/")
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers()
                   if m.name.startswith(prefix) and m.name[len(prefix):].startswith(keep)
                   and (m.isfile() or m.isdir())]
        for m in members:
            m.name = m.name[len(prefix):]
        tar.extractall(tmp, members=members, filter="data")
    (tmp / ".complete").write_text(f"{version}\n")
    if root.exists():
        import shutil

        shutil.rmtree(root)
    os.replace(tmp, root)
    return root


def scheduler_test_files(root: Path, folder: str = "tests/v1/core") -> list[str]:
    """The test files under ``root/folder`` (recursively, ``test_*.py``) that build
    a scheduler (``_BUILDS_SCHEDULER``), relative to ``root``, sorted: what
    ``bench/vllm_own_tests.py`` runs by default for a release (its tests differ
    from release to release)."""
    base = root / folder
    return sorted(str(p.relative_to(root)) for p in base.rglob("test_*.py")
                  if _BUILDS_SCHEDULER.search(p.read_text(encoding="utf-8", errors="replace")))


def _pins(root: Path) -> dict[str, str]:
    """``{package: version}`` of TEST_PACKAGES from the release's test requirements."""
    pins: dict[str, str] = {}
    for name in ("cpu.txt", "cuda.txt"):
        path = root / "requirements" / "test" / name
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            m = re.match(r"^([A-Za-z0-9_.-]+)==([^\s;#]+)", line)
            if m and m.group(1).lower() in TEST_PACKAGES:
                pins.setdefault(m.group(1).lower(), m.group(2))
    return pins


def _pip_for(python: str) -> list[str]:
    """The pip command acting on the env of ``python``: its own pip, or, for a
    layered env (built without pip, ``layered.py``), the harness's pip pointed
    at it with ``--python`` (pip sees the shared layer on that interpreter's
    path, so what it holds counts as installed and is held at its version)."""
    if subprocess.run([python, "-c", "import pip"], capture_output=True).returncode == 0:
        return [python, "-m", "pip"]
    return [sys.executable, "-m", "pip", "--python", python]


def ensure_test_packages(version: str, root: Path, log: Log = lambda _: None) -> list[str]:
    """Install the TEST_PACKAGES the env of ``version`` lacks, at the release's
    pins, adding only (every installed package held at its version). Returns
    what was installed. The env is shared: nothing is removed or upgraded."""
    python = str(env_python(version))
    probe = {"pytest": "pytest", "tblib": "tblib", "pytest-asyncio": "pytest_asyncio",
             "pytest-mock": "pytest_mock"}
    missing = [p for p in TEST_PACKAGES
               if subprocess.run([python, "-c", f"import {probe[p]}"], capture_output=True).returncode]
    if not missing:
        return []
    pins = _pins(root)
    wanted = [f"{p}=={pins[p]}" if p in pins else p for p in missing]
    log(f"installing {', '.join(wanted)} into the {version} env")
    pip = _pip_for(python)
    freeze = subprocess.run([*pip, "freeze"], capture_output=True, text=True)
    if freeze.returncode:
        raise OwnTestsError(f"pip cannot list the packages of the {version} env: "
                            f"{(freeze.stderr.strip().splitlines() or ['?'])[-1]}")
    held = root.parent / f".constraints-{version}-{os.getpid()}.txt"
    held.write_text("\n".join(line for line in freeze.stdout.splitlines()
                              if "==" in line and not line.startswith("-e")) + "\n")
    try:
        done = subprocess.run([*pip, "install", "-q", "-c", str(held), *wanted],
                              capture_output=True, text=True)
    finally:
        held.unlink(missing_ok=True)
    if done.returncode:
        raise OwnTestsError(f"pip could not install {', '.join(wanted)} into the {version} env: "
                            f"{(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return wanted


#: facebook/opt-350m's config.json (as on the HF hub): the model of vLLM 0.29.0+'s
#: ``tests/v1/core/test_priority_preemption_bug.py`` (``build_scheduler``).
OPT_350M_CONFIG = {
    "_name_or_path": "facebook/opt-350m", "activation_dropout": 0.0, "activation_function": "relu",
    "architectures": ["OPTForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 2,
    "do_layer_norm_before": False, "dropout": 0.1, "eos_token_id": 2, "ffn_dim": 4096,
    "hidden_size": 1024, "init_std": 0.02, "layerdrop": 0.0, "max_position_embeddings": 2048,
    "model_type": "opt", "num_attention_heads": 16, "num_hidden_layers": 24, "pad_token_id": 1,
    "prefix": "</s>", "torch_dtype": "float16", "transformers_version": "4.20.0.dev0",
    "use_cache": True, "vocab_size": 50272, "word_embed_proj_dim": 512,
}


def offline_hf_models() -> dict[str, dict]:
    """``{HF repo id: config.json}`` of the models vLLM's tests/v1/core name that an
    offline HF cache can serve from a config alone (text models: no weights, no
    tokenizer; the multimodal ones also need a processor and are left out)."""
    from harness.candidates.vllm.driver_vllm_config import _OPT_CONFIG

    return {"facebook/opt-125m": _OPT_CONFIG, "facebook/opt-350m": OPT_350M_CONFIG}


def offline_hf_home() -> Path:
    """An HF cache holding only the ``config.json`` of ``offline_hf_models()``
    (facebook/opt-125m: the model vLLM's ``create_scheduler`` names; opt-350m; no
    weights, no tokenizer), written by us."""
    home = envs_root() / "sdists" / "hf-home"
    revision = "0" * 40
    for name, config_data in offline_hf_models().items():
        repo = home / "hub" / f"models--{name.replace('/', '--')}"
        config = repo / "snapshots" / revision / "config.json"
        data = json.dumps(config_data, sort_keys=True)
        if not (config.is_file() and config.read_text() == data):
            config.parent.mkdir(parents=True, exist_ok=True)
            (repo / "refs").mkdir(parents=True, exist_ok=True)
            (repo / "refs" / "main").write_text(revision)
            tmp = config.with_name(f".config.{os.getpid()}.tmp")
            tmp.write_text(data)
            os.replace(tmp, config)
    return home


@dataclass
class RunResult:
    """One pytest run: ``outcomes`` ``{node id: passed|failed|skipped}``; ``cpu_s``."""

    outcomes: dict[str, str] = field(default_factory=dict)
    cpu_s: float = 0.0
    returncode: int = 0
    #: ``{node id: the first line of pytest's message}`` for each failed test.
    messages: dict[str, str] = field(default_factory=dict)


def _junit_outcomes(path: Path, root: Path, messages: dict[str, str] | None = None) -> dict[str, str]:
    """``{node id: passed|failed|skipped}`` from pytest's JUnit XML (``root``: the
    tests' root, where a classname's module file is looked up); ``messages``,
    when given, gets each failed test's first message line."""
    out: dict[str, str] = {}
    if not path.is_file():
        return out
    for case in ET.parse(path).getroot().iter("testcase"):
        cls, name = case.get("classname", ""), case.get("name", "")
        # classname is a dotted module[.Class]: rebuild the node id.
        parts = cls.split(".")
        module = cls.replace(".", "/")
        for i in range(len(parts), 0, -1):
            candidate = "/".join(parts[:i]) + ".py"
            if (root / candidate).is_file():
                module = candidate + "".join(f"::{p}" for p in parts[i:])
                break
        outcome = "passed"
        failure = case.find("failure") if case.find("failure") is not None else case.find("error")
        if failure is not None:
            outcome = "failed"
            if messages is not None:
                text = (failure.get("message") or failure.text or "").strip()
                messages[f"{module}::{name}"] = (text.splitlines() or [""])[0][:200]
        elif case.find("skipped") is not None:
            outcome = "skipped"
        nodeid = f"{module}::{name}"
        if out.get(nodeid) == "failed":  # an error at teardown after a pass: failed
            continue
        out[nodeid] = outcome
    return out


def run_pytest(version: str, root: Path, files: list[str], k: str | None, record_dir: Path | None,
               junit: Path, log: Log = lambda _: None, label: str = "") -> RunResult:
    """Run ``files`` (relative to ``root``) in the env of ``version``, with the
    recorder injected when ``record_dir`` is given. Progress: a line every few
    seconds (tests done)."""
    env = dict(os.environ)
    env.update(HF_HOME=str(offline_hf_home()), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_TARGET_DEVICE="cpu",
               PYTHONPATH=str(PLUGIN_DIR), PYTHONDONTWRITEBYTECODE="1")
    env.pop("SCHED_HARNESS_TESTS_RECORD", None)
    env.pop("SCHED_HARNESS_TRACE", None)
    if record_dir is not None:
        env["SCHED_HARNESS_TESTS_RECORD"] = str(record_dir)
    cmd = [str(env_python(version)), "-m", "pytest", "-p", "no:cacheprovider", "-p", PLUGIN, "-rN",
           "-q", "--no-header", "-o", "console_output_style=classic", f"--junitxml={junit}", *files]
    if k:
        cmd += ["-k", k]
    start = os.times()
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    done, last = 0, time.monotonic()
    tail: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        done += sum(line.count(c) for c in ".FEsxX") if re.fullmatch(r"[.FEsxX]+\s*", line) else 0
        tail = (tail + [line.rstrip()])[-20:]
        if time.monotonic() - last > 5:
            log(f"{label}: {done} tests run")
            last = time.monotonic()
    proc.wait()
    end = os.times()
    messages: dict[str, str] = {}
    result = RunResult(outcomes=_junit_outcomes(junit, root, messages),
                       cpu_s=(end.children_user - start.children_user)
                       + (end.children_system - start.children_system),
                       returncode=proc.returncode, messages=messages)
    if proc.returncode not in (0, 1) or not result.outcomes:
        raise OwnTestsError(f"pytest in the {version} env exited {proc.returncode} with no results: "
                            + " | ".join(t for t in tail[-3:] if t))
    failed = sum(o == "failed" for o in result.outcomes.values())
    log(f"{label}: {len(result.outcomes)} tests, "
        f"{sum(o == 'passed' for o in result.outcomes.values())} passed"
        + (f", {failed} failed" if failed else ""))
    return result


def prepare(version: str, log: Log = lambda _: None) -> Path:
    """Everything a run needs: the env (built by ``harness vllm-env``), the sdist,
    its tests, the test packages, the offline model config. Returns the tests'
    root folder."""
    if not is_ready(version):
        raise OwnTestsError(f"no env for vLLM {version}: build it with `harness vllm-env {version}`")
    root = extract_tests(version, fetch_sdist(version, log), log)
    ensure_test_packages(version, root, log)
    offline_hf_home()
    return root
