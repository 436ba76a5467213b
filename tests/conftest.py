"""Shared fixtures. Real models load once per session from a home under the repo (.test_home),
so the one-time dequantization is reused by later local runs; CI builds it fresh."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TEST_HOME = Path(os.environ.get("OMNIDRAFT_TEST_HOME", REPO / ".test_home"))
os.environ["OMNIDRAFT_HOME"] = str(TEST_HOME)
TEST_HOME.mkdir(exist_ok=True)
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

DRAFTER = "builtin:smollm2-135m"
TARGETS = ["builtin:qwen2.5-coder-0.5b", "builtin:gemma3-270m"]


@pytest.fixture(scope="session")
def home() -> Path:
    return TEST_HOME


@pytest.fixture(scope="session")
def real_models():
    """spec -> (model, tokenizer), loaded lazily and kept for the session."""
    from omnidraft import models

    cache: dict = {}

    def get(spec: str):
        if spec not in cache:
            cache[spec] = models.load(spec, home=TEST_HOME, progress=False)
        return cache[spec]

    return get


@pytest.fixture(scope="session")
def real_pipeline(real_models):
    """target spec -> (SpeculativeDecoder with SmolLM2 drafter, target model, target tokenizer)."""
    from omnidraft.decode import SpeculativeDecoder
    from omnidraft.runtime import build_bridge, make_drafter
    from omnidraft.target import TorchTarget

    cache: dict = {}

    def get(target_spec: str):
        if target_spec not in cache:
            d_model, d_tok = real_models(DRAFTER)
            t_model, t_tok = real_models(target_spec)
            target = TorchTarget(t_model, t_tok)
            bridge = build_bridge(d_model, d_tok, t_model, t_tok)
            cache[target_spec] = (SpeculativeDecoder(target, make_drafter(d_model, bridge, target), bridge), t_model, t_tok)
        return cache[target_spec]

    return get
