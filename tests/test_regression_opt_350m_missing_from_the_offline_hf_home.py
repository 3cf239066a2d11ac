"""Regression (issue 22): vLLM 0.33.0's ``tests/v1/core/test_priority_preemption_bug.py`` builds its
scheduler on ``facebook/opt-350m``; the offline HF cache ``harness vllm-tests`` gives the tests held
only opt-125m's config, so the test failed plain and injected alike ("Invalid repository ID or local
directory specified: 'facebook/opt-350m'") and was never recorded. The cache now holds opt-350m's
config.json too (written under the envs root; no vLLM needed).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.candidates.vllm import own_tests


def test_the_offline_hf_home_holds_opt_125m_and_opt_350m(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HARNESS_VLLM_ENVS", str(tmp_path))
    home = own_tests.offline_hf_home()
    assert home == tmp_path / "sdists" / "hf-home"
    found = {}
    for repo in sorted((home / "hub").iterdir()):
        assert (repo / "refs" / "main").read_text() == "0" * 40
        config = json.loads((repo / "snapshots" / ("0" * 40) / "config.json").read_text())
        found[repo.name] = (config["_name_or_path"], config["hidden_size"], config["num_hidden_layers"],
                            config["word_embed_proj_dim"], config["do_layer_norm_before"])
    assert found == {"models--facebook--opt-125m": ("facebook/opt-125m", 768, 12, 768, True),
                     "models--facebook--opt-350m": ("facebook/opt-350m", 1024, 24, 512, False)}
    assert own_tests.offline_hf_home() == home  # written once, then reused as is
