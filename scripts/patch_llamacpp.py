"""Patch llama.cpp's llamafile sgemm so a process can keep small batches on ggml's one-token kernels.

Why: llama.cpp runs an eval of one token with ggml's ``vec_dot`` and an eval of 2+ tokens with
llamafile's tinyBLAS. The two round differently, so a speculative verify of k proposals can pick
another token than the target's own one-token decode at a near-tie. Building without llamafile makes
every eval take the one-token arithmetic, but reading a prompt then costs 1.5x (docs/performance.md).

The patch adds one threshold, read once from ``GGML_LLAMAFILE_MIN_ROWS``: tinyBLAS runs only evals of
at least that many rows. omnidraft's llama.cpp target sets it, evaluates the rows it needs logits for
in batches below it (one-token arithmetic, row by row) and reads the rest of a prompt in larger
batches (tinyBLAS). Unset, llama.cpp behaves as released. The exported
``ggml_cpu_llamafile_min_rows()`` lets the target check that it runs a patched build.

Usage: ``python scripts/patch_llamacpp.py <llama-cpp-python source dir>`` (idempotent), or
``python scripts/patch_llamacpp.py --installed``: exit status 0 when the installed build is patched.
"""
from __future__ import annotations

import sys
from pathlib import Path

SGEMM = "vendor/llama.cpp/ggml/src/ggml-cpu/llamafile/sgemm.cpp"
MARK = "ggml_cpu_llamafile_min_rows"
ANCHOR = """    // only enable sgemm for prompt processing
#if !defined(__MMA__)
    if (n < 2)
        return false;
#endif
"""
GATE = """    if (n < llamafile_min_rows())  // omnidraft: small batches keep the one-token kernels
        return false;
"""
HELPERS = """
// omnidraft: tinyBLAS runs only evals of at least GGML_LLAMAFILE_MIN_ROWS rows (read once; unset: no
// extra limit), so a process can keep the rows it needs logits for on ggml's one-token vec_dot.
static int64_t llamafile_min_rows() {
    static const int64_t rows = [] {
        const char * env = getenv("GGML_LLAMAFILE_MIN_ROWS");
        return env ? (int64_t) atoll(env) : (int64_t) 0;
    }();
    return rows;
}

#if defined(_WIN32)
extern "C" __declspec(dllexport) int64_t ggml_cpu_llamafile_min_rows(void) { return llamafile_min_rows(); }
#else
extern "C" __attribute__((visibility("default"))) int64_t ggml_cpu_llamafile_min_rows(void) {
    return llamafile_min_rows();
}
#endif

bool llamafile_sgemm("""


def patch(source_dir: Path) -> bool:
    """Patch ``source_dir`` in place; False when it already was. Raises when the anchor moved."""
    path = source_dir / SGEMM
    text = path.read_text()
    if MARK in text:
        return False
    head, sep, tail = text.partition("\nbool llamafile_sgemm(")
    if not sep or tail.count(ANCHOR) != 1:
        raise SystemExit(f"{path}: the code this patch expects is not there (another llama.cpp version?)")
    path.write_text(head + HELPERS + tail.replace(ANCHOR, ANCHOR + GATE))
    return True


def installed() -> bool:
    """Whether the llama-cpp-python installed here runs a patched ggml (it exports :data:`MARK`)."""
    import ctypes

    import llama_cpp.llama_cpp as low

    for lib in Path(low._base_path).glob("*ggml-cpu*"):
        try:
            if hasattr(ctypes.CDLL(str(lib)), MARK):
                return True
        except OSError:
            continue
    return False


if __name__ == "__main__":
    if sys.argv[1:] == ["--installed"]:
        sys.exit(0 if installed() else 1)
    if len(sys.argv) != 2:
        raise SystemExit("usage: python scripts/patch_llamacpp.py <llama-cpp-python source dir> | --installed")
    print("patched" if patch(Path(sys.argv[1])) else "already patched", SGEMM)
