"""Regression (new-user trial): docs/reference/config.md said a hybrid config (`sliding_window`,
`layer_types`) was "in-process only for now, recording refuses it" after schema 9 made `harness
record` write it. The page says what the recorder does: a hybrid config records."""

from __future__ import annotations

from pathlib import Path

from reference.config import EngineConfig

ROOT = Path(__file__).resolve().parents[1]


def test_regression_config_doc_said_hybrid_recording_refused() -> None:
    text = " ".join((ROOT / "docs" / "reference" / "config.md").read_text().split())
    assert "recording refuses it" not in text
    assert "recorded in trace schema 9" in text
    config = EngineConfig.from_dict({"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
                                     "block_size": 4, "max_model_len": 96, "num_gpu_blocks": 50})
    assert len(config.kv_cache_groups) == 2
