"""The adapter store: atomic publishing under SIGKILL, corrupt and foreign adapters refused in one
line, the CLI around it. Uses a tiny random Llama with peft LoRA (fast); the real drafter's
adapters are exercised in test_train_real.py."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from test_cli import assert_one_line_error, omnidraft
from tiny import tiny_model

from omnidraft.adapter import store as adapter_store
from omnidraft.adapter.merge import MergedLora
from omnidraft.train import lora
from omnidraft.train.publish import save as publish

IDENTITY = adapter_store.Identity("d" * 16, "t" * 16, "a" * 16)


def _peft(seed: int = 0):
    model = tiny_model(64, seed)
    peft_model = lora.attach(model, lora.lora_config(rank=4, alpha=8))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return peft_model


def test_save_and_load_round_trip(tmp_path):
    peft_model = _peft()
    path = publish(tmp_path / "pair", peft_model, {"identity": vars(IDENTITY), "updates": 3})
    loaded = adapter_store.load(tmp_path / "pair", IDENTITY)
    assert loaded.path == path and loaded.version == 1 and loaded.meta["updates"] == 3 and loaded.scaling == 2.0
    assert set(loaded.state) == set(lora.lora_state(peft_model))
    publish(tmp_path / "pair", peft_model, {"identity": vars(IDENTITY)})
    publish(tmp_path / "pair", peft_model, {"identity": vars(IDENTITY)})
    assert adapter_store.load(tmp_path / "pair", IDENTITY).version == 3
    versions = sorted(p.name for p in (tmp_path / "pair").iterdir() if p.name.startswith("v"))
    assert versions == ["v000002", "v000003"]  # older versions are pruned
    assert adapter_store.load(tmp_path / "pair" / "v000002", IDENTITY).version == 2  # a version folder loads too


def test_nothing_published_yet_is_not_an_error(tmp_path):
    (tmp_path / "pair").mkdir()
    assert adapter_store.load(tmp_path / "pair", IDENTITY) is None


@pytest.mark.parametrize("damage", ["weights", "meta", "current", "nan", "identity"])
def test_damaged_or_foreign_adapters_are_refused(tmp_path, damage):
    peft_model = _peft()
    path = publish(tmp_path / "pair", peft_model, {"identity": vars(IDENTITY)})
    if damage == "weights":
        (path / adapter_store.WEIGHTS_FILE).write_bytes(b"\x00garbage" * 10)
    elif damage == "meta":
        (path / adapter_store.META_FILE).write_text("{not json")
    elif damage == "current":
        (tmp_path / "pair" / adapter_store.CURRENT_FILE).write_text("../../etc\n")
    elif damage == "nan":
        from safetensors.torch import load_file, save_file

        state = load_file(str(path / adapter_store.WEIGHTS_FILE))
        next(iter(state.values()))[0, 0] = float("nan")
        save_file(state, str(path / adapter_store.WEIGHTS_FILE))
    elif damage == "identity":
        meta = json.loads((path / adapter_store.META_FILE).read_text())
        meta["identity"]["target_vocab"] = "x" * 16
        (path / adapter_store.META_FILE).write_text(json.dumps(meta))
    with pytest.raises(adapter_store.AdapterProblem) as err:
        adapter_store.load(tmp_path / "pair", IDENTITY)
    assert "\n" not in str(err.value)


def test_merged_lora_equals_peft_forward_and_refuses_a_wrong_shape():
    peft_model = _peft(seed=1)
    plain = tiny_model(64, seed=1)  # same base weights
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    merged = MergedLora(plain)
    merged.apply(lora.lora_state(peft_model), scaling=2.0)
    with torch.no_grad():
        assert torch.allclose(plain(ids).logits, peft_model(input_ids=ids).logits, atol=1e-5)
        merged.clear()
        assert torch.allclose(plain(ids).logits, tiny_model(64, seed=1)(ids).logits)
    other = lora.attach(tiny_model(80, seed=2), lora.lora_config(rank=4, alpha=8))  # a different vocabulary
    state = {k: v for k, v in lora.lora_state(other).items()}
    state = {k: (torch.zeros(v.shape[0], 7) if "lora_A" in k else v) for k, v in state.items()}  # wrong in-features
    with pytest.raises(ValueError, match="shape"):
        merged.apply(state, 2.0)


WRITER = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    from tiny import tiny_model
    from pathlib import Path
    from omnidraft.train import lora
    from omnidraft.train.publish import save as publish
    model = lora.attach(tiny_model(64, 0), lora.lora_config(rank=4, alpha=8))
    i = 0
    while True:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.fill_(float(i))
        publish(Path({folder!r}), model, {{"identity": {identity!r}, "step": i}})
        print(i, flush=True)
        i += 1
""")


@pytest.mark.parametrize("round_", range(6))
def test_a_writer_killed_at_any_moment_leaves_a_loadable_adapter(tmp_path, round_):
    """SIGKILL a process that publishes adapters in a loop; the store must load cleanly afterwards,
    with weights that are exactly one of the published versions (never a mix)."""
    folder = tmp_path / "pair"
    code = WRITER.format(tests=str(Path(__file__).parent), folder=str(folder), identity=vars(IDENTITY))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(2 + round_ % 3):
            assert proc.stdout.readline(), "writer died"
        time.sleep(0.003 * round_)  # land the kill at different points of a save
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    loaded = adapter_store.load(folder, IDENTITY)
    assert loaded is not None
    step = loaded.meta["step"]
    b_values = {float(v.flatten()[0]) for k, v in loaded.state.items() if "lora_B" in k}
    assert b_values == {float(step)}  # the weights belong to the version the metadata names
    publish(folder, _peft(), {"identity": vars(IDENTITY)})  # and the next writer goes on
    assert adapter_store.load(folder, IDENTITY).version > loaded.version
    assert not list(folder.glob(".tmp-*"))  # the killed writer's leftovers were swept


def test_cli_adapters_list_show_remove_and_a_corrupt_adapter_path(tmp_path):
    home = tmp_path / "home"
    pair = home / "adapters" / "smollm2-135m--qwen2.5-coder-0.5b"
    publish(pair, _peft(), {"identity": vars(IDENTITY), "updates": 2, "records_seen": 16,
                                       "history": [{"loss": 0.5, "dm_kl": 0.4, "ngram_nll": 2.0, "expected_acceptance": 0.6,
                                                    "top1_agreement": 0.7, "dm_tokens": 100, "ngram_tokens": 10, "seconds": 3.0},
                                                   {"loss": 0.4, "dm_kl": 0.3, "ngram_nll": 1.9, "expected_acceptance": 0.65,
                                                    "top1_agreement": 0.72, "dm_tokens": 90, "ngram_tokens": 9, "seconds": 3.5,
                                                    "head_positions": 120, "head_auc": 0.913}]})
    env_home = ["--home", str(home)]
    listed = omnidraft(*env_home, "adapters", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    (row,) = json.loads(listed.stdout)
    assert row["name"] == pair.name and row["updates"] == 2 and row["status"] == "ok"
    shown = omnidraft(*env_home, "adapters", "show", pair.name)
    assert shown.returncode == 0 and "records_seen" in shown.stdout and "0.600" in shown.stdout
    assert "0.913" in shown.stdout  # the acceptance head's AUC of the update that trained one
    (pair / "CURRENT").write_text("v999999\n")
    assert "unusable" in omnidraft(*env_home, "adapters", "list").stdout
    assert_one_line_error(omnidraft(*env_home, "generate", "--prompt", "hi", "--adapter", str(pair)), "--adapter", "missing")
    assert_one_line_error(omnidraft(*env_home, "adapters", "show", "nope"), "no adapter named")
    removed = omnidraft(*env_home, "adapters", "remove", pair.name, "--yes")
    assert removed.returncode == 0 and not pair.exists()


def test_the_trainers_next_version_keeps_the_drafters_cache_and_a_chosen_adapter_drops_it(tmp_path):
    """``AdapterSlot.take`` (a version the trainer published) keeps the drafter's KV cache: dropping
    it meant re-reading the whole context before the next draft. ``use`` (an adapter chosen at load
    time) starts from an empty cache."""
    from tiny import tiny_pair

    from omnidraft.adapter.slot import AdapterSlot
    from omnidraft.runtime import make_drafter

    d_model, target, bridge = tiny_pair()
    drafter = make_drafter(d_model, bridge, target)
    slot = AdapterSlot(drafter, IDENTITY, tmp_path / "pair")
    path = publish(tmp_path / "pair", _peft(), {"identity": vars(IDENTITY)})
    before = drafter.lm.logits_for([3, 4, 5, 6]).clone()
    slot.take(path)
    assert slot.current is not None and drafter.lm.cached_ids == [3, 4, 5, 6]
    after = drafter.lm.logits_for([3, 4, 5, 6, 7])  # reads one token on the kept cache, under the new weights
    assert not torch.allclose(after, before)
    slot.use(adapter_store.load(path, IDENTITY))
    assert drafter.lm.cached_ids == []
