"""scripts/patch_llamacpp.py: the set-up's llama.cpp patch applies once, exactly where it should,
and refuses a source it does not recognise (another llama.cpp version) instead of building it unpatched."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "patch_llamacpp.py"
spec = importlib.util.spec_from_file_location("patch_llamacpp", SCRIPT)
patcher = importlib.util.module_from_spec(spec)
spec.loader.exec_module(patcher)

SGEMM = """#include "sgemm.h"

bool llamafile_sgemm(const struct ggml_compute_params * params, int64_t m, int64_t n, int64_t k) {
    assert(m >= 0);
""" + patcher.ANCHOR + """
    if (Ctype != GGML_TYPE_F32)
        return false;
}
"""


def source(tmp_path: Path, text: str) -> Path:
    path = tmp_path / patcher.SGEMM
    path.parent.mkdir(parents=True)
    path.write_text(text)
    return path


def test_the_patch_gates_tinyblas_once(tmp_path):
    path = source(tmp_path, SGEMM)
    assert patcher.patch(tmp_path) is True
    text = path.read_text()
    assert text.count(patcher.MARK) == 2  # the exported query (Windows and elsewhere)
    assert text.count("llamafile_min_rows()") == 4  # defined, returned by both exports, and the gate
    gate = text.index(patcher.GATE)
    assert text.index(patcher.ANCHOR) < gate < text.index("if (Ctype != GGML_TYPE_F32)")
    assert text.index("static int64_t llamafile_min_rows()") < text.index("bool llamafile_sgemm(")
    assert patcher.patch(tmp_path) is False and path.read_text() == text  # idempotent


def test_another_version_is_refused(tmp_path):
    path = source(tmp_path, SGEMM.replace("if (n < 2)", "if (n < 4)"))
    before = path.read_text()
    with pytest.raises(SystemExit, match="another llama.cpp version"):
        patcher.patch(tmp_path)
    assert path.read_text() == before
