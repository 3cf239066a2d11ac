"""Build and locate per-version vLLM virtual environments (CPU only).

Each supported vLLM version gets its own venv under ``<repo>/.vllm-envs/<version>/``
(override the root with ``HARNESS_VLLM_ENVS``), built the light way that
``shared/notes/vllm-on-cpu.md`` measured: the CPU build of torch, the pinned
dependencies of ``harness/candidates/vllm/pins.txt`` with ``--no-deps``, then vLLM itself
with ``--no-deps`` (about a minute; 1.5 GB, of which torch and the pins, 0.7-0.9 GB,
are hard links to the same files of an env built before: ``dedupe.py``; vLLM's
CUDA kernels, 0.66 GB, are removed). Nothing of the harness is installed
there: ``harness/candidates/vllm/driver.py`` runs under that venv's Python as a standalone
script.

``ensure_env(version)`` builds it if missing (idempotent, under a file lock);
``env_python(version)`` is where its Python is; ``harness vllm-env VERSION`` is
the command-line front end.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from harness.candidates.vllm.dedupe import share_with_finished_envs, site_packages

#: Releases built as full venvs (torch and the pins in each), as CI builds
#: them: 0.33.0 is what the reference mirrors; 0.29.0 and 0.20.2 are older
#: releases with measured profiles. Every other release from 0.10.0 on is
#: built layered (``layered.py``): vLLM alone over one shared dependency layer.
#: An EngineConfig field a release lacks is refused unless it has that
#: release's behaviour (the driver probes; e.g. ``watermark`` on 0.20.2).
SUPPORTED_VERSIONS = ("0.33.0", "0.29.0", "0.20.2")
TORCH_VERSION = "2.13.0"
PINS_FILE = Path(__file__).with_name("pins.txt")
MARKER = ".harness-env.json"
REPO_ROOT = Path(__file__).resolve().parents[3]


#: The v1 engine core's releases: the oldest one the driver drives, and the
#: newest series it knows (a later one is refused until probed).
OLDEST_VERSION, NEWEST_SERIES = (0, 10, 0), (0, 33)


#: vLLM's releases with the v1 engine core, oldest first (PyPI's list as of
#: 0.33.0): what `harness bisect`/`sweep` ranges select from, and the releases a
#: candidate's "did you mean" may suggest (a version below the newest listed
#: that is not here is no release).
RELEASES = (
    "0.10.0", "0.10.1", "0.10.1.1", "0.10.2", "0.11.0", "0.11.1", "0.11.2", "0.12.0", "0.13.0",
    "0.14.0", "0.14.1", "0.15.0", "0.15.1", "0.16.0", "0.17.0", "0.17.1", "0.18.0", "0.18.1",
    "0.19.0", "0.19.1", "0.20.0", "0.20.1", "0.20.2", "0.21.0", "0.22.0", "0.22.1", "0.23.0",
    "0.24.0", "0.25.0", "0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0",
    "0.31.0", "0.32.0", "0.33.0",
)


class VLLMEnvError(RuntimeError):
    """A vLLM env that cannot be built or used; the message is one line."""


def version_tuple(version: str) -> tuple[int, ...]:
    """``"0.10.1.1"`` -> ``(0, 10, 1, 1)`` (a release's numeric parts only)."""
    return tuple(int(p) for p in version.split("."))


def check_version(version: str) -> str:
    """``version`` if it is a vLLM release with the v1 engine core the driver
    knows (0.10.0 through 0.33.x; three or four parts, e.g. 0.10.1.1), else
    VLLMEnvError. Whether PyPI has it is found when it is built."""
    if not re.fullmatch(r"\d+\.\d+\.\d+(\.\d+)?", version or ""):
        raise VLLMEnvError(f"bad vLLM version {version!r}: expected e.g. 0.33.0 or 0.10.1.1")
    parts = version_tuple(version)
    if parts < OLDEST_VERSION:
        raise VLLMEnvError(f"vLLM {version} is not supported: it predates 0.10.0, the first "
                           f"release whose engine core is v1 only")
    if parts[:2] > NEWEST_SERIES:
        raise VLLMEnvError(f"vLLM {version} is not supported: newer than the "
                           f"{'.'.join(map(str, NEWEST_SERIES))} series the driver was probed on")
    return version


def envs_roots() -> list[Path]:
    """Folders holding one venv per version, in lookup order; new envs are
    built in the first. ``HARNESS_VLLM_ENVS`` if set (several folders joined
    with ``os.pathsep``: e.g. ``/work/vllm-envs-extra:/repo/.vllm-envs`` builds
    in the first and finds envs in either); else, in a checkout,
    ``<repo>/.vllm-envs``; else (a non-editable install, where the "repo" would
    be site-packages) ``$XDG_CACHE_HOME/sched-harness/vllm-envs`` (default
    ``~/.cache``)."""
    override = os.environ.get("HARNESS_VLLM_ENVS")
    if override:
        return [Path(p).expanduser().resolve() for p in override.split(os.pathsep) if p]
    if (REPO_ROOT / "pyproject.toml").is_file():
        return [REPO_ROOT / ".vllm-envs"]
    cache = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return [Path(cache).expanduser().resolve() / "sched-harness" / "vllm-envs"]


def envs_root() -> Path:
    """Where new envs are built: the first of ``envs_roots()``."""
    return envs_roots()[0]


def env_dir(version: str) -> Path:
    """``version``'s env: the first root holding a ready one, else where it
    would be built."""
    check_version(version)
    for root in envs_roots():
        if _ready_at(root / version, version):
            return root / version
    return envs_root() / version


def built_versions() -> list[str]:
    """The releases with a ready env in any of ``envs_roots()``, sorted by
    version (for "did you mean" on ``vllm@VERSION``)."""
    found: set[str] = set()
    for root in envs_roots():
        try:
            entries = list(root.iterdir())
        except OSError:
            continue
        for entry in entries:
            if re.fullmatch(r"\d+\.\d+\.\d+(\.\d+)?", entry.name) and _ready_at(entry, entry.name):
                found.add(entry.name)
    return sorted(found, key=version_tuple)


def env_python(version: str) -> Path:
    """The Python of ``version``'s venv (it may not exist yet: see ``is_ready``)."""
    return env_dir(version) / "bin" / "python"


def _pins_sha256() -> str:
    return hashlib.sha256(PINS_FILE.read_bytes()).hexdigest()


def read_pins() -> list[str]:
    """The pinned requirements, one ``name==version`` per line (comments skipped)."""
    lines = [ln.split("#", 1)[0].strip() for ln in PINS_FILE.read_text().splitlines()]
    return [ln for ln in lines if ln]


def _ready_at(target: Path, version: str) -> bool:
    try:
        data = json.loads((target / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (data.get("version") == version and data.get("pins_sha256") == _pins_sha256()
            and (target / "bin" / "python").exists())


def is_ready(version: str) -> bool:
    """True when the venv was built completely with the current pins."""
    return _ready_at(env_dir(version), version)


@contextmanager
def _lock(version: str):
    root = envs_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{version}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _run(cmd: list[str], log_path: Path, what: str) -> None:
    """Run one build stage (``cmd``, a pip call or venv creation), its output
    appended to ``log_path``. Raises VLLMEnvError (one line, naming the log):
    ``PyPI has no vllm==X`` when pip finds no such release, ``no space left on
    device`` when the disk filled, else the log's last line. Used by every env
    build (full, layered, serving)."""
    with open(log_path, "a") as log:
        log.write(f"\n$ {' '.join(cmd)}\n")
        log.flush()
        env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
        env.pop("PYTHONPATH", None)
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    if proc.returncode == 0:
        return
    lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines()
             if ln.strip() and not ln.startswith("WARNING: Location")]
    text = "\n".join(lines)
    if "No matching distribution found" in text or "Could not find a version" in text:
        wanted = next((a for a in cmd if a.startswith("vllm") and "==" in a), "the package")
        raise VLLMEnvError(f"{what} failed: PyPI has no {wanted} (full log: {log_path})")
    if "No space left on device" in text:
        raise VLLMEnvError(f"{what} failed: no space left on device under {log_path.parent} "
                           f"(full log: {log_path})")
    last = lines[-1] if lines else "no output"
    raise VLLMEnvError(f"{what} failed (exit {proc.returncode}): {last[:200]} (full log: {log_path})")


def strip_cuda_kernels(site: Path) -> int:
    """Remove the compiled extensions under ``site/vllm`` (``_C``, ``_moe_C``,
    the flash-attention builds: CUDA kernels, about 0.66 GB of 0.33.0's 0.88 GB
    package, that a CPU-only scheduler env never loads: the driver and the
    recording scheduler run only the scheduler, which is Python); returns the
    bytes removed."""
    removed = 0
    for path in (site / "vllm").rglob("*.so"):
        removed += path.stat().st_size
        path.unlink()
    return removed


def build_venv(target: Path, *, pins: Path, n_pins: int, dist: str, log_path: Path, title: str,
               verify: Callable[[str], None], marker: dict, say: Callable[[str], None],
               strip_kernels: bool = True) -> None:
    """Build a venv at ``target`` the light way (``shared/notes/vllm-on-cpu.md``):
    create it, upgrade pip, CPU ``torch==TORCH_VERSION``, the ``pins`` file with
    ``--no-deps``, then ``dist`` (e.g. ``vllm==0.33.0``) with ``--no-deps``;
    ``verify(python)`` (raises VLLMEnvError if the result is unusable), then the
    ``MARKER`` file with ``marker`` plus torch, build time and date.
    ``strip_kernels`` removes vLLM's compiled CUDA kernels (``strip_cuda_kernels``:
    a scheduler-only env never loads them; the serving env's CPU kernels stay).
    Before the marker, every file with a twin in a finished env is hard-linked
    to it (``dedupe.share_with_finished_envs``: torch and the pins, about 1.3 GB
    an env). An earlier,
    incomplete ``target`` is removed first; on any failure (KeyboardInterrupt
    included) the half-built venv is removed and only ``log_path`` stays.
    ``say`` receives one line per stage. Raises VLLMEnvError (one line, naming
    the log) when a stage fails. Used by ``ensure_env`` and the serving env
    (``harness/serve/env.py``)."""
    if target.exists():
        say(f"removing incomplete env {target}")
        shutil.rmtree(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    log_path.write_text(title + "\n")
    python = str(target / "bin" / "python")
    started = time.monotonic()
    stages = [
        ("creating venv", [sys.executable, "-m", "venv", str(target)]),
        ("upgrading pip", [python, "-m", "pip", "install", "-q", "-U", "pip"]),
        (f"installing torch=={TORCH_VERSION} (CPU)", [python, "-m", "pip", "install", "-q", f"torch=={TORCH_VERSION}"]),
        (f"installing {n_pins} pinned dependencies",
         [python, "-m", "pip", "install", "-q", "--no-deps", "-r", str(pins)]),
        (f"installing {dist}", [python, "-m", "pip", "install", "-q", "--no-deps", dist]),
    ]
    ok = False
    try:
        for what, cmd in stages:
            say(f"{what} ...")
            t0 = time.monotonic()
            _run(cmd, log_path, what)
            say(f"{what}: done in {time.monotonic() - t0:.0f} s")
        sites = site_packages(target)
        stripped = sum(strip_cuda_kernels(site) for site in sites) if strip_kernels else 0
        verify(python)
        linked = share_with_finished_envs(target, sites, [target.parent, *envs_roots()], marker=MARKER)
        if stripped or linked:
            say(f"CUDA kernels removed: {stripped / 1e9:.2f} GB; "
                f"hard-linked to other envs: {linked / 1e9:.2f} GB")
        (target / MARKER).write_text(json.dumps({
            **marker, "torch": TORCH_VERSION, "built_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "build_s": round(time.monotonic() - started, 1),
            "cuda_kernels_removed_bytes": stripped, "hard_linked_bytes": linked}, indent=1) + "\n")
        ok = True
    finally:
        if not ok:  # no half-built env left behind: the log stays
            shutil.rmtree(target, ignore_errors=True)


def ensure_env(version: str, *, log: Callable[[str], None] | None = None,
               force: bool = False) -> Path:
    """Build ``version``'s venv unless it is ready; return its Python.

    Idempotent and safe against concurrent builders (file lock). ``log``
    receives one progress line per stage. Raises VLLMEnvError on failure,
    after removing the half-built venv (its build log stays; ``build_venv``).
    """
    say = log or (lambda _msg: None)
    check_version(version)
    with _lock(version):
        if is_ready(version) and not force:
            say(f"vLLM {version} env ready: {env_dir(version)}")
            return env_python(version)
        if version not in SUPPORTED_VERSIONS:
            # Every other release: vLLM alone over one shared dependency
            # layer (harness/candidates/vllm/layered.py).
            from harness.candidates.vllm.layered import build_layered

            return build_layered(version, envs_root(), log=say)
        target = env_dir(version)
        log_path = target.parent / f"{version}.build.log"

        def verify(python: str) -> None:
            # The scheduler must import with vLLM's CUDA kernels gone (strip_cuda_kernels), as
            # the layered builds check.
            probe = subprocess.run(
                [python, "-c", "import importlib.metadata as m, vllm.v1.core.sched.scheduler; "
                               "print(m.version('vllm'))"],
                capture_output=True, text=True, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
            found = (probe.stdout.strip().splitlines() or [""])[-1]
            if probe.returncode != 0 or found != version:
                raise VLLMEnvError(f"vLLM {version} env is broken: installed vllm is "
                                   f"{found or 'missing'} ({probe.stderr.strip()[-200:]})")

        started = time.monotonic()
        build_venv(target, pins=PINS_FILE, n_pins=len(read_pins()), dist=f"vllm=={version}",
                   log_path=log_path, title=f"building vLLM {version} env at {target}", verify=verify,
                   marker={"version": version, "pins_sha256": _pins_sha256()}, say=say)
        say(f"vLLM {version} env built in {time.monotonic() - started:.0f} s: {target}")
        return env_python(version)
