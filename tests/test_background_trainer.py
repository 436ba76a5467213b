"""The background trainer process on a tiny drafter saved as a local model folder: updates every
``interval`` prompts and publishes atomically, pauses and resumes, survives a failing update,
stops cleanly, and a Ctrl-C to the parent's process group never reaches it."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from tiny import tiny_model, tiny_tokenizer

from omnidraft.adapter import store as adapter_store
from omnidraft.train.background import BackgroundTrainer, TrainerSetup
from omnidraft.train.config import TrainConfig
from omnidraft.train.records import Example

VOCAB = 64


@pytest.fixture(scope="module")
def drafter_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_drafter")
    tiny_model(VOCAB, seed=3).save_pretrained(folder)
    tiny_tokenizer(VOCAB).save_pretrained(folder)
    return folder


def _example(seed: int, length: int = 24) -> Example:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (length,), generator=g)
    pos = torch.arange(4, length)
    k = 4
    return Example(input_ids=ids, dm_pos=pos, dm_topk=torch.randint(1, VOCAB, (len(pos), k, 1), generator=g),
                   dm_topk_logp=torch.log(torch.full((len(pos), k), 0.2)), dm_log_mass=torch.zeros(len(pos)),
                   dm_logp_emitted=torch.full((len(pos),), -1.0), ng_pos=torch.tensor([2, 3]),
                   ng_logp_target=torch.tensor([-0.5, -0.5]), emitted_tokens=length - 4)


def _trainer(folder, tmp_path, interval=2) -> BackgroundTrainer:
    setup = TrainerSetup(drafter_spec=str(folder), home=str(tmp_path), adapter_folder=str(tmp_path / "pair"),
                         dm_mask=np.ones(VOCAB, dtype=bool), config=TrainConfig(lr=1e-3, batch_size=2, rank=4, alpha=4, interval=interval),
                         meta={"identity": {"drafter_vocab": "x"}}, nice=0)
    return BackgroundTrainer(setup)


def test_updates_every_interval_and_publishes(drafter_folder, tmp_path):
    trainer = _trainer(drafter_folder, tmp_path)
    try:
        trainer.submit(_example(1))
        assert trainer.wait(timeout=300) is None  # one prompt: below the interval, nothing trained yet
        trainer.submit(_example(2))
        published = trainer.wait(timeout=300)
        assert published is not None and published.version == 1 and published.metrics["examples"] == 2
        loaded = adapter_store.load(tmp_path / "pair", None)
        assert loaded.path == published.path and loaded.meta["records_seen"] == 2 and len(loaded.meta["history"]) == 1
        trainer.submit(_example(3))
        trainer.flush()  # the partial buffer on request
        assert trainer.wait(timeout=300).version == 2
    finally:
        trainer.stop()
    assert not trainer.alive and trainer.errors == []


def test_pause_holds_training_until_resume(drafter_folder, tmp_path):
    trainer = _trainer(drafter_folder, tmp_path, interval=1)
    try:
        trainer.pause()
        trainer.submit(_example(4))
        with pytest.raises(TimeoutError):
            trainer.wait(timeout=20)  # paused: the update does not start
        assert adapter_store.load(tmp_path / "pair", None) is None
        trainer.resume()
        assert trainer.wait(timeout=300).version == 1
    finally:
        trainer.stop()


def test_a_failing_update_is_reported_and_training_goes_on(drafter_folder, tmp_path):
    trainer = _trainer(drafter_folder, tmp_path, interval=1)
    try:
        bad = _example(5)
        bad.input_ids[6] = 10 * VOCAB  # not a token of the drafter: the embedding lookup raises
        trainer.submit(bad)
        assert trainer.wait(timeout=300) is None
        assert len(trainer.errors) == 1 and "update failed" in trainer.errors[0] and "\n" not in trainer.errors[0]
        assert "IndexError" in (tmp_path / "pair" / "trainer.log").read_text()  # the traceback is logged
        trainer.submit(_example(6))
        assert trainer.wait(timeout=300).version == 1
    finally:
        trainer.stop()


def test_a_trainer_that_cannot_start_is_reported_once(tmp_path):
    setup = TrainerSetup(drafter_spec=str(tmp_path / "no-such-model"), home=str(tmp_path),
                         adapter_folder=str(tmp_path / "pair"), dm_mask=np.ones(VOCAB, dtype=bool),
                         config=TrainConfig(interval=1), nice=0)
    trainer = BackgroundTrainer(setup)
    deadline = time.monotonic() + 120
    while trainer.alive and time.monotonic() < deadline:
        time.sleep(0.2)
    trainer.poll()
    trainer.poll()
    assert not trainer.alive
    assert any("could not start" in e for e in trainer.errors)
    assert sum("exited unexpectedly" in e for e in trainer.errors) <= 1
    trainer.stop()


def test_stop_mid_update_is_prompt_and_leaves_the_store_loadable(drafter_folder, tmp_path):
    trainer = _trainer(drafter_folder, tmp_path, interval=1)
    trainer.submit(_example(7, length=200))
    assert trainer.wait(timeout=300).version == 1
    for seed in range(8, 14):
        trainer.submit(_example(seed, length=200))
    start = time.monotonic()
    trainer.stop(timeout=60)
    assert not trainer.alive and time.monotonic() - start < 60
    assert adapter_store.load(tmp_path / "pair", None).version >= 1
