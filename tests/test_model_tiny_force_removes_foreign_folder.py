"""Regression: ``harness model tiny -o DIR --force`` removed DIR whatever it
held (``shutil.rmtree``): ``-o . --force`` deleted the current folder, files
that were never a model's included. --force now replaces only a folder holding
nothing but a tiny model's files; anything else is one line, exit 2, untouched."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from harness.cli import main


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def test_regression_model_tiny_force_keeps_a_folder_of_other_files(tmp_path: Path) -> None:
    folder = tmp_path / "work"
    (folder / "src").mkdir(parents=True)
    (folder / "notes.txt").write_text("keep")
    (folder / "src" / "main.py").write_text("keep")
    code, out = run("model", "tiny", "-o", str(folder), "--force")
    assert code == 2, out
    assert out.strip() == (f"error: {folder}: --force replaces only a tiny-model folder, and it holds "
                           f"'notes.txt' and 1 more (choose a new or empty folder)")
    assert (folder / "notes.txt").read_text() == "keep"
    assert (folder / "src" / "main.py").read_text() == "keep"


def test_regression_model_tiny_force_keeps_a_model_folder_with_an_extra_file(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (folder / name).write_text("{}")
    (folder / "README.md").write_text("mine")
    code, out = run("model", "tiny", "-o", str(folder), "--force")
    assert code == 2, out
    assert out.strip() == (f"error: {folder}: --force replaces only a tiny-model folder, and it holds "
                           f"'README.md' (choose a new or empty folder)")
    assert (folder / "README.md").read_text() == "mine"
