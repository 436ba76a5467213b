"""The README's demo (demos/quickstart.py): its timing reruns decode on a twin of the pipeline's decoder.

The whole demo takes minutes, so CI does not run it; this runs the part of it that broke once (the
twin deep-copies the cost policy, which holds the switch of the drafter's weights: a native drafter's
weights cannot be copied) on the pipeline the demo loads, with a short output."""

from __future__ import annotations

import importlib.util

import pytest
from conftest import DRAFTER, REPO, TEST_HOME

from omnidraft.config import DecodeConfig
from omnidraft.decode import SpeculativeDecoder
from omnidraft.runtime import encode_prompt, load_pipeline


def _quickstart():
    spec = importlib.util.spec_from_file_location("quickstart", REPO / "demos" / "quickstart.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.real
def test_the_demos_rerun_twin_decodes_what_the_pipeline_decodes():
    demo = _quickstart()
    target, engine, prompts = demo.CASES[0]
    pipe = load_pipeline(target, DRAFTER, engine=engine, home=TEST_HOME, quiet=True)
    assert pipe.decoder.cost_policy.switch is not None  # what the twin must share, not copy
    config = DecodeConfig(max_new_tokens=16)
    text, chat = prompts[1]
    ids = encode_prompt(pipe.target_tokenizer, text, chat=chat)
    alone = SpeculativeDecoder(pipe.decoder.target).generate(ids, config).token_ids
    first = demo._cold(pipe.decoder).generate(ids, config).token_ids
    twin = demo._rerun_decoder(pipe.decoder)
    assert twin.cost_policy is not pipe.decoder.cost_policy and twin.cost_policy.path is None
    assert twin.cost_policy.switch is pipe.decoder.cost_policy.switch
    assert demo._cold(twin).generate(ids, config).token_ids == first == alone
