"""Parse and locate a real-vLLM candidate spec: ``vllm@TARGET[,scheduler_cls=MOD:CLASS]``.

``TARGET`` is either

- a release, ``vllm@0.33.0`` (four-part versions too, ``vllm@0.10.1.1``): the
  harness-built environment under ``envs_root()`` (``harness vllm-env``), or
- a path, ``vllm@/path/to/bin/python`` or ``vllm@/path/to/venv`` (anything
  holding ``/`` or starting with ``.`` or ``~``): a Python interpreter in which
  ``import vllm`` works, e.g. a developer's editable checkout or a fork. Its
  vLLM version is read from the interpreter's installed metadata; for a vLLM
  package that is a git checkout, the commit and whether the tree is dirty.

``scheduler_cls=package.module:Class`` (``package.module.Class``, vLLM's own
``--scheduler-cls`` spelling, is accepted too) names a subclass of vLLM's
``vllm.v1.core.sched.scheduler.Scheduler`` that the driver builds instead of
vLLM's, inside the target's interpreter, with the caller's ``PYTHONPATH``
(relative entries made absolute) so the module is importable there. This
mirrors ``SchedulerConfig.scheduler_cls`` / ``get_scheduler_cls`` in vLLM
0.33.0 (``vllm/config/scheduler.py``): a custom class is used as given, with
async scheduling too.

``parse_vllm_spec`` raises ``VLLMSpecError`` (one line) for a malformed spec, a
path without a Python, an interpreter without vLLM, or an unknown option.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reference.words import close_matches, did_you_mean

from harness.candidates.vllm.env import VLLMEnvError, built_versions, check_version, env_python, is_ready

#: Seconds allowed for the metadata probe of a ``vllm@PATH`` interpreter
#: (no vLLM import: the installed distribution and the package's folder).
PROBE_TIMEOUT_S = 60.0

# Run by the target interpreter: where vllm is and which version its
# installed metadata names, without importing vllm (that takes ~10 s).
_PROBE = r"""
import importlib.util, importlib.metadata as md, json, os, sys
out = {"python": sys.executable, "python_version": "%d.%d.%d" % sys.version_info[:3]}
try:
    spec = importlib.util.find_spec("vllm")
except Exception as exc:
    spec = None
    out["error"] = "%s: %s" % (type(exc).__name__, exc)
if spec is None or not spec.origin:
    out.setdefault("error", "No module named 'vllm'")
else:
    out["package_dir"] = os.path.dirname(spec.origin)
    try:
        out["version"] = md.version("vllm")
    except md.PackageNotFoundError:
        out["version"] = None
print(json.dumps(out))
"""

_OPTIONS = ("scheduler_cls",)


class VLLMSpecError(ValueError):
    """A ``vllm@...`` spec that names nothing usable; the message is one line."""


@dataclass(frozen=True)
class VLLMTarget:
    """What a ``vllm@...`` spec resolves to.

    ``python``: the interpreter the driver runs under; ``version``: the vLLM
    version installed there (a release's own, or the metadata's for a path);
    ``release``: True for a harness-built release environment;
    ``scheduler_cls``: ``module:Class`` or None; ``pythonpath``: the absolute
    ``PYTHONPATH`` entries the driver keeps (only with ``scheduler_cls``);
    ``git``: ``{"commit", "dirty", "root"}`` for a vLLM package inside a git
    checkout, else None.
    """

    spec: str
    python: Path
    version: str
    release: bool
    scheduler_cls: str | None = None
    pythonpath: tuple[str, ...] = ()
    git: dict[str, Any] | None = field(default=None, compare=False)

    @property
    def label(self) -> str:
        """Short name for messages: ``vLLM 0.33.0`` or ``vLLM 0.33.0 at /x/bin/python``."""
        where = "" if self.release else f" at {self.python}"
        cls = f" with scheduler_cls {self.scheduler_cls}" if self.scheduler_cls else ""
        return f"vLLM {self.version}{where}{cls}"

    @property
    def pool_key(self) -> str:
        """Drivers are interchangeable when interpreter and PYTHONPATH agree
        (see candidate._pool_key): the scheduler class is chosen at each
        ``init``, so one driver serves every class of a run."""
        return "|".join([str(self.python), os.pathsep.join(self.pythonpath)])

    def metadata(self) -> dict[str, Any]:
        """What the trace's metadata says of this vLLM (key ``vllm_source``): the
        interpreter, the version found, the git commit and dirty flag (a
        checkout), the scheduler class. Empty for a plain release (its traces
        keep the bytes they always had)."""
        if self.release and self.scheduler_cls is None:
            return {}
        out: dict[str, Any] = {"version": self.version}
        if not self.release:
            out["python"] = str(self.python)
        if self.git is not None:
            out["git_commit"] = self.git["commit"]
            out["git_dirty"] = self.git["dirty"]
        if self.scheduler_cls is not None:
            out["scheduler_cls"] = self.scheduler_cls
        return out


def is_path_target(target: str) -> bool:
    """True when a ``vllm@`` target names a path rather than a release."""
    return "/" in target or target.startswith((".", "~"))


def split_spec(spec: str) -> tuple[str, dict[str, str]]:
    """``vllm@TARGET,key=value,...`` -> ``(TARGET, {key: value})``. Raises
    VLLMSpecError for an unknown key, a repeated key or a missing value."""
    if not spec.startswith("vllm@"):
        raise VLLMSpecError(f"not a vLLM candidate spec: {spec!r}")
    target, *rest = spec[len("vllm@"):].split(",")
    if not target:
        raise VLLMSpecError(f"{spec!r}: expected vllm@VERSION or vllm@PATH")
    options: dict[str, str] = {}
    for item in rest:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not value.strip():
            raise VLLMSpecError(f"{spec!r}: expected key=value after ',', got {item!r}")
        if key not in _OPTIONS:
            raise VLLMSpecError(f"{spec!r}: unknown option {key!r}{did_you_mean(key, _OPTIONS)}")
        if key in options:
            raise VLLMSpecError(f"{spec!r}: option {key!r} given twice")
        options[key] = value.strip()
    return target, options


def normalise_class_name(name: str) -> str:
    """``pkg.mod:Class`` or ``pkg.mod.Class`` (vLLM's spelling) -> ``pkg.mod:Class``.
    Raises VLLMSpecError when no module or no class is named."""
    module, sep, attr = name.partition(":")
    if not sep:
        module, _, attr = name.rpartition(".")
    ident = r"[A-Za-z_][A-Za-z0-9_]*"
    if not re.fullmatch(rf"{ident}(\.{ident})*", module or "") or \
            not re.fullmatch(rf"{ident}(\.{ident})*", attr or ""):
        raise VLLMSpecError(f"scheduler_cls {name!r}: expected package.module:Class")
    return f"{module}:{attr}"


def caller_pythonpath(cwd: Path | None = None) -> tuple[str, ...]:
    """The caller's ``PYTHONPATH`` entries, made absolute against ``cwd`` (the
    driver runs in another folder); empty entries (meaning the cwd) become it."""
    base = Path(cwd or os.getcwd())
    raw = os.environ.get("PYTHONPATH", "")
    out: list[str] = []
    for entry in raw.split(os.pathsep) if raw else ():
        path = str((base / entry).resolve()) if entry else str(base.resolve())
        if path not in out:
            out.append(path)
    return tuple(out)


def _python_of(target: str, spec: str) -> Path:
    path = Path(target).expanduser()
    if not path.exists():
        raise VLLMSpecError(f"{spec!r}: {path} does not exist (expected a Python interpreter "
                            f"or a virtual environment)")
    if path.is_dir():
        candidate = path / "bin" / "python"
        if not candidate.exists():
            raise VLLMSpecError(f"{spec!r}: {path} is a folder without bin/python "
                                f"(expected a virtual environment)")
        path = candidate
    if not os.access(path, os.X_OK):
        raise VLLMSpecError(f"{spec!r}: {path} is not executable")
    # Absolute, but not resolved: a venv's bin/python is a symlink to the base
    # interpreter, and only the link finds the venv's site-packages.
    return Path(os.path.abspath(path))


def _kill_group(child: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(child.pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        child.kill()
    except OSError:
        pass
    try:
        child.communicate(timeout=5)
    except (subprocess.TimeoutExpired, ValueError, OSError):
        pass


def probe_python(python: Path, spec: str) -> dict[str, Any]:
    """Run the metadata probe under ``python``: ``{python, python_version,
    package_dir, version}``. Raises VLLMSpecError when it cannot run or finds no vLLM."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    try:
        # Its own process group: on a timeout, what it started (a wrapper
        # script's children) is killed with it, not left running.
        child = subprocess.Popen([str(python), "-c", _PROBE], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 stdin=subprocess.DEVNULL, text=True, env=env, start_new_session=True)
    except OSError as exc:
        raise VLLMSpecError(f"{spec!r}: cannot run {python}: {exc.strerror or exc}") from None
    try:
        stdout, stderr = child.communicate(timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _kill_group(child)
        raise VLLMSpecError(f"{spec!r}: {python} did not answer the version probe within "
                            f"{PROBE_TIMEOUT_S:g} s (killed)") from None
    except BaseException:
        _kill_group(child)
        raise
    _kill_group(child)  # anything it left behind
    proc = subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)
    lines = proc.stdout.strip().splitlines()
    try:
        data = json.loads(lines[-1]) if proc.returncode == 0 and lines else None
    except ValueError:
        data = None
    if not isinstance(data, dict):
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise VLLMSpecError(f"{spec!r}: {python} is not a working Python interpreter: {tail[:200]}")
    if data.get("error"):
        raise VLLMSpecError(f"{spec!r}: `import vllm` fails under {python}: {data['error']}")
    if not data.get("version"):
        raise VLLMSpecError(f"{spec!r}: vllm under {python} ({data.get('package_dir')}) has no "
                            f"installed metadata naming its version (pip install -e it)")
    return data


def git_state(package_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """``{"commit", "dirty", "root"}`` when ``package_dir`` (vLLM's package
    folder) is tracked in a git checkout, else None (a wheel install, even one
    inside some other repository's ignored folder)."""
    pkg = Path(package_dir)

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(pkg), *args], capture_output=True, text=True,
                              timeout=30)

    try:
        tracked = git("ls-files", "--error-unmatch", "__init__.py")
        if tracked.returncode != 0:
            return None
        commit = git("rev-parse", "HEAD")
        root = git("rev-parse", "--show-toplevel")
        status = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.TimeoutExpired):
        return None
    if commit.returncode != 0:
        return None
    return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip()),
            "root": root.stdout.strip()}


def parse_vllm_spec(spec: str) -> VLLMTarget:
    """Resolve ``spec`` (``vllm@VERSION`` or ``vllm@PATH``, optionally
    ``,scheduler_cls=MOD:CLASS``) to a ``VLLMTarget``. A release must be
    supported and built (``harness vllm-env VERSION``); a path is probed.
    Raises VLLMSpecError with a one-line message."""
    target, options = split_spec(spec)
    scheduler_cls = options.get("scheduler_cls")
    if scheduler_cls is not None:
        scheduler_cls = normalise_class_name(scheduler_cls)
    pythonpath = caller_pythonpath() if scheduler_cls else ()
    if is_path_target(target):
        python = _python_of(target, spec)
        data = probe_python(python, spec)
        return VLLMTarget(spec, python, str(data["version"]), False, scheduler_cls, pythonpath,
                          git_state(data["package_dir"]))
    try:
        version = check_version(target)
    except VLLMEnvError as exc:
        raise VLLMSpecError(f"candidate {spec!r}: {exc}") from None
    if not is_ready(version):
        from harness.candidates.vllm.env import RELEASES, env_dir, version_tuple

        built = built_versions()
        newest = RELEASES[-1]
        if version not in RELEASES and version_tuple(version) < version_tuple(newest):
            # Regression (trial finding): `run harness vllm-env 0.30.1` for a release that never
            # was. Suggest a known release of the series, a built one first.
            close = close_matches(version, RELEASES, n=3)
            pick = next((c for c in close if c in built), close[0] if close else None)
            how = "" if pick is None else (f"; did you mean vllm@{pick}" + (
                " (built)?" if pick in built else f"? (`harness vllm-env {pick}` builds it)"))
            raise VLLMSpecError(f"candidate {spec!r}: {version} is not a vLLM release (known: 0.10.0 "
                                f"to {newest})" + how)
        close = close_matches(version, built, n=1)  # a built release of the same series
        unlisted = (f" if PyPI has it (the newest release known here is {newest})"
                    if version not in RELEASES else "")
        raise VLLMSpecError(f"candidate {spec!r}: the vLLM {version} env is not built "
                            f"({env_dir(version)}); run `harness vllm-env {version}`{unlisted}"
                            + (f"; or did you mean vllm@{close[0]} (built)?" if close
                               else f" (built here: {', '.join(built)})" if built else ""))
    return VLLMTarget(spec, env_python(version), version, True, scheduler_cls, pythonpath)


def release_target(version: str, scheduler_cls: str | None = None) -> VLLMTarget:
    """The target of a harness-built release (built or not: see ``is_ready``)."""
    cls = normalise_class_name(scheduler_cls) if scheduler_cls else None
    spec = f"vllm@{version}" + (f",scheduler_cls={cls}" if cls else "")
    return VLLMTarget(spec, env_python(check_version(version)), version, True, cls,
                      caller_pythonpath() if cls else ())
