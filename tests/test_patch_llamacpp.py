"""scripts/patch_llamacpp.py: the set-up's llama.cpp patch applies once, exactly where it should,
and refuses a source it does not recognise (another llama.cpp version) instead of building it
unpatched, leaving every file as it was."""

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
QUANTS = """#include "quants.h"

void ggml_vec_dot_q8_0_q8_0(int n) { }
"""
QUANTS_H = "#pragma once\n" + patcher.COLS_DECL_ANCHOR + "void ggml_vec_dot_q8_1(void);\n"
MATMUL = """static void ggml_compute_forward_mul_mat_one_chunk(void) {
    assert(ne13 % ne03 == 0);

""" + patcher.MATMUL_ANCHOR + """    const int64_t blck_1 = 16;
}
"""
FILES = {patcher.SGEMM: SGEMM, patcher.QUANTS: QUANTS, patcher.QUANTS_H: QUANTS_H, patcher.MATMUL: MATMUL}


def source(tmp_path: Path, **replace: tuple[str, str]) -> dict[str, Path]:
    """A llama-cpp-python source tree with the four files the patch edits (``replace``: a file's
    name in FILES' keys' last part -> (old, new) to make it another version)."""
    paths = {}
    for rel, text in FILES.items():
        name = Path(rel).name.replace(".", "_").replace("-", "_")
        if name in replace:
            text = text.replace(*replace[name])
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        paths[rel] = path
    return paths


def test_the_patch_gates_tinyblas_once(tmp_path):
    path = source(tmp_path)[patcher.SGEMM]
    assert patcher.patch(tmp_path) is True
    text = path.read_text()
    assert text.count(patcher.MARK) == 2  # the exported query (Windows and elsewhere)
    assert text.count("llamafile_min_rows()") == 4  # defined, returned by both exports, and the gate
    gate = text.index(patcher.GATE)
    assert text.index(patcher.ANCHOR) < gate < text.index("if (Ctype != GGML_TYPE_F32)")
    assert text.index("static int64_t llamafile_min_rows()") < text.index("bool llamafile_sgemm(")
    assert patcher.patch(tmp_path) is False and path.read_text() == text  # idempotent


def test_the_multi_row_kernels_go_in_once_and_before_ggmls_tiles(tmp_path):
    paths = source(tmp_path)
    assert patcher.patch(tmp_path) is True
    quants = paths[patcher.QUANTS].read_text()
    assert quants.startswith(QUANTS.rstrip("\n")) and quants.count("void omnidraft_vec_dot_q5_0_q8_0_cols(") == 1
    assert "void omnidraft_vec_dot_q8_0_q8_0_cols(" in quants and "int omnidraft_cols_enabled(void)" in quants
    header = paths[patcher.QUANTS_H].read_text()
    assert header.index(patcher.COLS_DECL_ANCHOR) < header.index(patcher.COLS_DECL) < header.index("ggml_vec_dot_q8_1")
    matmul = paths[patcher.MATMUL].read_text()
    fast = matmul.index("omnidraft_cols_enabled()")
    assert matmul.index("assert(ne13 % ne03 == 0);") < fast < matmul.index(patcher.MATMUL_ANCHOR)  # its locals exist
    assert matmul.count(f"int {patcher.VERSION_MARK}(void) {{ return {patcher.PATCH_VERSION}; }}") == 1
    before = {rel: p.read_text() for rel, p in paths.items()}
    assert patcher.patch(tmp_path) is False
    assert {rel: p.read_text() for rel, p in paths.items()} == before  # idempotent


@pytest.mark.parametrize("file,change", [
    ("sgemm_cpp", ("if (n < 2)", "if (n < 4)")),
    ("quants_h", ("void ggml_vec_dot_q8_0_q8_0(", "void ggml_vec_dot_q8_0_q8_0_v2(")),
    ("ggml_cpu_c", ("const int64_t blck_0 = 16;", "const int64_t blck_0 = 32;")),
])
def test_another_version_is_refused_and_nothing_is_written(tmp_path, file, change):
    paths = source(tmp_path, **{file: change})
    before = {rel: p.read_text() for rel, p in paths.items()}
    with pytest.raises(SystemExit, match="another llama.cpp version"):
        patcher.patch(tmp_path)
    assert {rel: p.read_text() for rel, p in paths.items()} == before
