"""An export folder on disk: replaced under a lock, repaired after a kill, one permission policy, and
adapter files that change together with the manifest or not at all (issue 29).

Real exports of a tiny random drafter (the real exporter, onnxruntime and the filesystem; nothing
mocked). The SIGKILL sweep over many points of a replace is in test_hostile_input.py.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tiny_export import build, copy_export, probe, run_writer, siblings

from omnidraft.errors import OmnidraftError
from omnidraft.export import folder as ef
from omnidraft.export.onnx_export import install, write_adapter
from omnidraft.fsutil import LockHeld


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """Two tiny exports that give different logits: the export in place ("old") and its replacement."""
    root = tmp_path_factory.mktemp("sources")
    return {"old": build(root, 1), "new": build(root, 2)}


@pytest.fixture(scope="module")
def logits(sources) -> dict[str, np.ndarray]:
    return {k: probe(v) for k, v in sources.items()}


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped): what a killed writer leaves in names."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _temp_copy(src: Path, out: Path) -> Path:
    """A writer's complete temporary sibling of ``out`` holding a copy of the export ``src``."""
    tmp = ef.new_temp(out)
    shutil.copytree(src, tmp, dirs_exist_ok=True)
    return tmp


def _which(folder: Path, logits: dict[str, np.ndarray]) -> str:
    got = probe(folder)
    return next(k for k, v in logits.items() if np.array_equal(got, v))


def test_a_replace_swaps_the_whole_folder_and_leaves_nothing_beside_it(sources, logits, tmp_path):
    out = copy_export(sources["old"], tmp_path / "export" / "d-fp32")
    assert run_writer(sources["new"], out).returncode == 0
    assert _which(out, logits) == "new" and siblings(out) == []


def test_recover_finishes_the_new_export_when_the_kill_came_between_the_renames(sources, logits, tmp_path):
    out = tmp_path / "export" / "d-fp32"
    pid = _dead_pid()
    copy_export(sources["old"], out.parent / f".d-fp32.old-{pid}-0")
    copy_export(sources["new"], out.parent / f".d-fp32.tmp-{pid}-abc123")
    with ef.holding(out):
        done = ef.recover(out)
    assert "finished the interrupted export" in done[0]
    assert _which(out, logits) == "new" and siblings(out) == []


def test_recover_restores_the_old_export_when_the_new_one_is_incomplete(sources, logits, tmp_path):
    out = tmp_path / "export" / "d-fp32"
    pid = _dead_pid()
    copy_export(sources["old"], out.parent / f".d-fp32.old-{pid}-0")
    partial = copy_export(sources["new"], out.parent / f".d-fp32.tmp-{pid}-abc123")
    (partial / "manifest.json").unlink()  # the writer died before its last file
    with ef.holding(out):
        ef.recover(out)
    assert _which(out, logits) == "old" and siblings(out) == []


def test_a_live_writers_folders_are_left_alone(sources, tmp_path):
    out = copy_export(sources["old"], tmp_path / "export" / "d-fp32")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        mine = copy_export(sources["new"], out.parent / f".d-fp32.tmp-{live.pid}-abc123")
        stale = copy_export(sources["new"], out.parent / f".d-fp32.tmp-{_dead_pid()}-def456")
        with ef.holding(out):
            ef.recover(out)
        assert mine.is_dir() and not stale.exists()
    finally:
        live.kill()
        live.wait()


def test_what_the_old_rmtree_replace_left_is_repaired(sources, logits, tmp_path):
    """Issue 29 #1 as older versions left it: the folder emptied but for adapters/ and bridge/, the
    finished new export stranded in a hidden `.<name>-xxxxxxxx` folder. The next export (or load)
    moves the stranded one in; `export` no longer says the folder is not an export."""
    out = tmp_path / "export" / "d-fp32"
    (out / "adapters").mkdir(parents=True)
    (out / "bridge" / "t").mkdir(parents=True)
    copy_export(sources["new"], out.parent / ".d-fp32-k2j4h5g6")
    ef.check_replaceable(out)  # a remnant: replaceable, not "exists and is not an export"
    assert _which(out, logits) == "new"  # the backend settled it before loading
    assert siblings(out) == []


def test_an_older_versions_pidless_temp_folders_are_removed_by_the_next_export(sources, logits, tmp_path):
    """Older versions named their temporary folder `.<name>-xxxxxxxx` (mkdtemp, no pid). They predate
    the writer lock, so under the lock no live writer can own one: the next export removes them,
    complete or not, beside an export in place (a complete one does not replace the newer export).
    A file of that shape is not a folder of ours and stays."""
    out = copy_export(sources["old"], tmp_path / "export" / "d-fp32")
    partial = copy_export(sources["new"], out.parent / ".d-fp32-q7w8e9r0")
    (partial / "manifest.json").unlink()
    complete = copy_export(sources["new"], out.parent / ".d-fp32-k2j4h5g6")
    (out.parent / ".d-fp32-a1b2c3d4").write_text("not ours")
    assert {(p.name, pid) for p, kind, pid in ef.leftovers(out)} == {(partial.name, None), (complete.name, None)}
    proc = run_writer(sources["new"], out)
    assert proc.returncode == 0, proc.stderr
    assert _which(out, logits) == "new"
    assert siblings(out) == [".d-fp32-a1b2c3d4"]


def test_a_folder_omnidraft_did_not_write_is_never_replaced(sources, tmp_path):
    out = tmp_path / "export" / "mine"
    (out / "notes").mkdir(parents=True)
    (out / "notes" / "todo.txt").write_text("mine")
    tmp = _temp_copy(sources["new"], out)
    with pytest.raises(OmnidraftError, match="not an export omnidraft wrote"):
        install(tmp, out)
    assert (out / "notes" / "todo.txt").read_text() == "mine"


def test_a_second_writer_is_refused_in_one_line_naming_the_first(sources, tmp_path):
    out = copy_export(sources["old"], tmp_path / "export" / "d-fp32")
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom pathlib import Path\n"
                               "from omnidraft.export.folder import holding\n"
                               f"with holding(Path({str(out)!r})):\n    print('held', flush=True)\n    time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        tmp = _temp_copy(sources["new"], out)
        with pytest.raises(LockHeld, match=f"process {holder.pid}"):
            install(tmp, out)
        shutil.rmtree(tmp)
    finally:
        holder.kill()
        holder.wait()
    assert run_writer(sources["new"], out).returncode == 0  # the kernel dropped the dead holder's lock


# ---------------------------------------------------------------- one permission policy


def _modes(folder: Path) -> set[tuple[str, int]]:
    return {("dir" if p.is_dir() else "file", stat.S_IMODE(p.stat().st_mode)) for p in [folder, *folder.rglob("*")]}


def _adapter_tensors(manifest: dict, rank: int = 2, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for module, shape in manifest["lora"].items():
        out[f"{module}.lora_A.weight"] = rng.normal(size=(shape["in"], rank)).astype(np.float32) * 0.1
        out[f"{module}.lora_B.weight"] = rng.normal(size=(rank, shape["out"])).astype(np.float32) * 0.1
    return out


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_every_file_of_an_export_follows_the_umask_adapters_and_heads_included(sources, tmp_path, umask):
    old = os.umask(umask)
    try:
        out = tmp_path / "export" / "d-fp32"
        assert run_writer(sources["old"], out).returncode == 0  # the child inherits the umask
        manifest = json.loads((out / "manifest.json").read_text())
        write_adapter(out, "d--t", 3, _adapter_tensors(manifest), {"w": np.ones((4, 2), np.float32)})
    finally:
        os.umask(old)
    assert _modes(out) == {("dir", 0o777 & ~umask), ("file", 0o666 & ~umask)}
    assert {p.suffix for p in (out / "adapters").iterdir()} == {".onnx_adapter", ".npz"}


# ---------------------------------------------------------------- adapters: together or not at all


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_an_adapter_and_its_manifest_entry_change_together(sources, tmp_path):
    from omnidraft.drafter.onnx_lm import OrtCausalLM

    out = copy_export(sources["old"], tmp_path / "d-fp32")
    manifest = json.loads((out / "manifest.json").read_text())
    first = write_adapter(out, "d--t", 1, _adapter_tensors(manifest, seed=1), {"w": np.zeros(3, np.float32)})
    second = write_adapter(out, "d--t", 2, _adapter_tensors(manifest, seed=2), {"w": np.ones(3, np.float32)})
    entry = json.loads((out / "manifest.json").read_text())["adapters"]["d--t"]
    assert entry["file"] == f"adapters/{second.name}" and entry["version"] == 2 and first != second
    assert sorted(p.name for p in (out / "adapters").iterdir()) == sorted([second.name, Path(entry["head_file"]).name])
    lm = OrtCausalLM(out, threads=1)
    base = lm.logits_for([1, 2, 3]).copy()
    lm.set_adapter_file(out / entry["file"])
    assert not np.allclose(lm.logits_for([1, 2, 3]), base)  # the file is a working adapter


@pytest.mark.parametrize("tamper", ["no lora", "adapters list", "adapters null", "lora module renamed", "head_dim"])
def test_a_bad_manifest_stops_an_adapter_export_before_any_file_changes(sources, tmp_path, tamper):
    """Issue 29 #4: a KeyError or TypeError after the .onnx_adapter was already replaced."""
    out = copy_export(sources["old"], tmp_path / "d-fp32")
    manifest = json.loads((out / "manifest.json").read_text())
    tensors = _adapter_tensors(manifest)
    write_adapter(out, "d--t", 1, tensors)
    m = json.loads((out / "manifest.json").read_text())
    if tamper == "no lora":
        del m["lora"]
    elif tamper == "adapters list":
        m["adapters"] = []
    elif tamper == "adapters null":
        m["adapters"] = None
    elif tamper == "lora module renamed":
        m["lora"] = {k.replace("q_proj", "qq_proj"): v for k, v in m["lora"].items()}
    else:
        m["head_dim"] += 1
    (out / "manifest.json").write_text(json.dumps(m))
    before = _snapshot(out)
    with pytest.raises(OmnidraftError) as err:
        write_adapter(out, "d--t", 2, _adapter_tensors(manifest, seed=5))
    assert "\n" not in str(err.value) and "manifest" in str(err.value)
    assert _snapshot(out) == before


@pytest.mark.parametrize("name", ["../escape", "/tmp/abs", "..", ".", "a/b", ".hidden", "", "x\\..\\y", "a\x00b"])
def test_an_adapter_name_never_leaves_the_adapters_folder(sources, tmp_path, name):
    out = copy_export(sources["old"], tmp_path / "e" / "d-fp32")
    manifest = json.loads((out / "manifest.json").read_text())
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    with pytest.raises(OmnidraftError, match="not a plain name"):
        write_adapter(out, name, 1, _adapter_tensors(manifest))
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


def test_an_adapters_folder_that_is_a_link_is_refused(sources, tmp_path):
    out = copy_export(sources["old"], tmp_path / "d-fp32")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (out / "adapters").symlink_to(elsewhere, target_is_directory=True)
    manifest = json.loads((out / "manifest.json").read_text())
    with pytest.raises(OmnidraftError, match="not a folder of the export"):
        write_adapter(out, "d--t", 1, _adapter_tensors(manifest))
    assert list(elsewhere.iterdir()) == []


def test_a_tensor_that_does_not_fit_the_graph_is_refused_before_writing(sources, tmp_path):
    out = copy_export(sources["old"], tmp_path / "d-fp32")
    manifest = json.loads((out / "manifest.json").read_text())
    tensors = _adapter_tensors(manifest)
    key = next(iter(tensors))
    tensors[key] = tensors[key][:-1]  # one row short of the layer's input features
    before = _snapshot(out)
    with pytest.raises(OmnidraftError, match="does not fit"):
        write_adapter(out, "d--t", 1, tensors)
    assert _snapshot(out) == before


def _cli(argv: list[str], home: Path) -> tuple[int, str]:
    """``omnidraft ARGV`` in this process with ``home`` as $OMNIDRAFT_HOME: (exit status, stderr)."""
    import contextlib
    import io

    from omnidraft.cli import main

    err, before = io.StringIO(), os.environ.get("OMNIDRAFT_HOME")
    os.environ["OMNIDRAFT_HOME"] = str(home)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(argv)
    finally:
        if before is None:
            os.environ.pop("OMNIDRAFT_HOME", None)
        else:
            os.environ["OMNIDRAFT_HOME"] = before
    return code, err.getvalue()


def test_after_a_kill_between_the_renames_generate_finds_the_export_and_export_runs(sources, logits, tmp_path):
    """Issue 29 #1 end to end: the folder is gone, the finished export waits beside it. `generate`'s
    export lookup finds it (no silent fall-back to the torch drafter), and `omnidraft export` runs
    to the end instead of failing with "exists and is not an export omnidraft wrote"."""
    from tiny import tiny_model, tiny_tokenizer
    from tiny_export import killed

    from omnidraft.runtime import onnx_export_for

    trace = run_writer(sources["new"], copy_export(sources["old"], tmp_path / "dry" / "d-fp32")).stdout.splitlines()
    between = [i + 1 for i, s in enumerate(trace) if s.startswith("rename")][1]  # the new one's rename
    home = tmp_path / "home"
    out = copy_export(sources["old"], home / "export" / "smollm2-135m-fp32")
    assert killed(run_writer(sources["new"], out, kill_at=between)) and not out.exists()
    assert onnx_export_for("builtin:smollm2-135m", "auto", home) == out and _which(out, logits) == "new"

    shutil.rmtree(out)  # the same state again, for the export command to meet first
    assert killed(run_writer(sources["new"], copy_export(sources["old"], out), kill_at=between)) and not out.exists()
    drafter, target = tmp_path / "drafter", tmp_path / "target"
    for folder, vocab, seed in ((drafter, 330, 3), (target, 420, 4)):
        tok = tiny_tokenizer(vocab)
        tiny_model(len(tok), seed).save_pretrained(folder)
        tok.save_pretrained(folder)
    code, err = _cli(["export", "--drafter", str(drafter), "--quant", "fp32", "--target", str(target),
                      "--out", str(out)], home)
    assert code == 0, err
    assert "finished the interrupted export" in err
    assert json.loads((out / "manifest.json").read_text())["drafter"] == str(drafter)
    assert _which(out, {**logits, "third": probe(out)}) == "third" and siblings(out) == []
