"""Patch llama.cpp so a speculative verify keeps ggml's one-token arithmetic, and pays less for it.

Two edits, both to ggml's CPU backend:

1. llamafile's sgemm: a threshold that keeps small batches on ggml's one-token kernels (below).
2. Multi-row kernels (``scripts/llamacpp_cols.c``, x86 with AVX2): a product of Q5_0, Q8_0, Q4_K or
   Q6_K weights with 2-31 activation rows unpacks each weight block once for up to four rows, where ggml's one-row
   ``vec_dot`` unpacks it for every row again. Each row's sum takes ``vec_dot``'s operations in
   ``vec_dot``'s order, so the rows are bit for bit what a one-token eval gives; on a small CPU,
   where those evals are bound by instructions, each verified row then costs a fraction of a step
   (docs/performance.md). ``GGML_OMNIDRAFT_COLS=0`` turns them off, for a paired comparison.

Why the first: llama.cpp runs an eval of one token with ggml's ``vec_dot`` and an eval of 2+ tokens with
llamafile's tinyBLAS. The two round differently, so a speculative verify of k proposals can pick
another token than the target's own one-token decode at a near-tie. Building without llamafile makes
every eval take the one-token arithmetic, but reading a prompt then costs 1.5x (docs/performance.md).

The patch adds one threshold, read once from ``GGML_LLAMAFILE_MIN_ROWS``: tinyBLAS runs only evals of
at least that many rows. omnidraft's llama.cpp target sets it, evaluates the rows it needs logits for
in batches below it (one-token arithmetic) and reads the rest of a prompt in larger
batches (tinyBLAS). Unset, llama.cpp behaves as released. The exported
``ggml_cpu_llamafile_min_rows()``, ``ggml_cpu_omnidraft_patch()`` (this script's version) and
``ggml_cpu_omnidraft_multi_row()`` let the target, and the set-up, check what a build carries.

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


QUANTS = "vendor/llama.cpp/ggml/src/ggml-cpu/arch/x86/quants.c"
QUANTS_H = "vendor/llama.cpp/ggml/src/ggml-cpu/quants.h"
MATMUL = "vendor/llama.cpp/ggml/src/ggml-cpu/ggml-cpu.c"
COLS = "omnidraft_vec_dot_q5_0_q8_0_cols"  # in every file the multi-row kernels touch
COLS_SOURCE = Path(__file__).with_name("llamacpp_cols.c")  # appended to x86 quants.c
COLS_DECL_ANCHOR = "void ggml_vec_dot_q8_0_q8_0(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);\n"
COLS_DECL = """#if defined(__AVX2__)  // omnidraft: one weight row against up to 4 activation rows (scripts/llamacpp_cols.c)
#define OMNIDRAFT_VEC_DOT_COLS 1
int omnidraft_cols_enabled(void);
void omnidraft_vec_dot_q5_0_q8_0_cols(int n, int nc, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, const void * GGML_RESTRICT vy, size_t by);
void omnidraft_vec_dot_q8_0_q8_0_cols(int n, int nc, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, const void * GGML_RESTRICT vy, size_t by);
void omnidraft_vec_dot_q4_K_q8_K_cols(int n, int nc, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, const void * GGML_RESTRICT vy, size_t by);
void omnidraft_vec_dot_q6_K_q8_K_cols(int n, int nc, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, const void * GGML_RESTRICT vy, size_t by);
#endif
"""
MATMUL_ANCHOR = "    // block-tiling attempt\n    const int64_t blck_0 = 16;\n"
# A 2-D product of Q5_0, Q8_0, Q4_K or Q6_K weights with 2+ activation rows takes the multi-row kernels: each weight
# row (in the cache for the whole sweep) against the chunk's activation rows, four at a time.
MATMUL_COLS = """#if defined(OMNIDRAFT_VEC_DOT_COLS)  // omnidraft (scripts/llamacpp_cols.c): bit for bit vec_dot's rows
    {
        void (*cols)(int, int, float *, size_t, const void *, const void *, size_t) = NULL;
        enum ggml_type cols_type = GGML_TYPE_Q8_0;  // the activations' type each kernel reads
        switch (type) {
            case GGML_TYPE_Q5_0: cols = omnidraft_vec_dot_q5_0_q8_0_cols; break;
            case GGML_TYPE_Q8_0: cols = omnidraft_vec_dot_q8_0_q8_0_cols; break;
            case GGML_TYPE_Q4_K: cols = omnidraft_vec_dot_q4_K_q8_K_cols; cols_type = GGML_TYPE_Q8_K; break;
            case GGML_TYPE_Q6_K: cols = omnidraft_vec_dot_q6_K_q8_K_cols; cols_type = GGML_TYPE_Q8_K; break;
            default: break;
        }
        if (cols != NULL && omnidraft_cols_enabled() && vec_dot_type == cols_type && num_rows_per_vec_dot == 1 &&
                ir1_end - ir1_start > 1 && ne02 == 1 && ne03 == 1 && ne12 == 1 && ne13 == 1 && nb0 == sizeof(float)) {
            const size_t col_stride = src1_cont || src1->type != vec_dot_type ? row_size : (size_t) nb11;
            for (int64_t ir0 = ir0_start; ir0 < ir0_end; ++ir0) {
                const char * w = (const char *) src0->data + ir0 * nb01;
                for (int64_t ir1 = ir1_start; ir1 < ir1_end; ir1 += 4) {
                    cols((int) ne00, (int) MIN(4, ir1_end - ir1), (float *) ((char *) dst->data + ir1 * nb1) + ir0,
                         nb1 / sizeof(float), w, (const char *) wdata + ir1 * col_stride, col_stride);
                }
            }
            return;
        }
    }
#endif

"""
# what `installed` looks for beside MARK: this version of the edits (exported on every CPU), so a build
# from an earlier version of this script is built again
VERSION_MARK = "ggml_cpu_omnidraft_patch"
PATCH_VERSION = 2  # 1: the tinyBLAS threshold only (no VERSION_MARK); 2: the multi-row kernels too
VERSION_EXPORT = f"""
// omnidraft: which version of scripts/patch_llamacpp.py's edits this build carries, and whether it has
// the multi-row kernels (x86 with AVX2; another CPU keeps its one-row kernels, as released)
int ggml_cpu_omnidraft_patch(void);
int ggml_cpu_omnidraft_multi_row(void);
#if defined(_WIN32)
#define OMNIDRAFT_EXPORT __declspec(dllexport)
#else
#define OMNIDRAFT_EXPORT __attribute__((visibility("default")))
#endif
OMNIDRAFT_EXPORT int ggml_cpu_omnidraft_patch(void) {{ return {PATCH_VERSION}; }}
OMNIDRAFT_EXPORT int ggml_cpu_omnidraft_multi_row(void) {{
#if defined(OMNIDRAFT_VEC_DOT_COLS)
    return 1;
#else
    return 0;
#endif
}}
"""


def _sgemm(text: str) -> str | None:
    head, sep, tail = text.partition("\nbool llamafile_sgemm(")
    if not sep or tail.count(ANCHOR) != 1:
        return None
    return head + HELPERS + tail.replace(ANCHOR, ANCHOR + GATE)


def _quants(text: str) -> str:
    return text.rstrip("\n") + "\n" + COLS_SOURCE.read_text()


def _quants_h(text: str) -> str | None:
    return text.replace(COLS_DECL_ANCHOR, COLS_DECL_ANCHOR + COLS_DECL) if text.count(COLS_DECL_ANCHOR) == 1 else None


def _matmul(text: str) -> str | None:
    if text.count(MATMUL_ANCHOR) != 1:
        return None
    return text.replace(MATMUL_ANCHOR, MATMUL_COLS + MATMUL_ANCHOR).rstrip("\n") + "\n" + VERSION_EXPORT


EDITS = ((SGEMM, MARK, _sgemm), (QUANTS, COLS, _quants), (QUANTS_H, COLS, _quants_h), (MATMUL, COLS, _matmul))


def patch(source_dir: Path) -> bool:
    """Patch ``source_dir`` in place; False when it already was. Every file is checked before any is
    written, so a source this script does not recognise (another llama.cpp version) is left as it was
    and the set-up stops instead of building it unpatched."""
    todo = []
    for rel, mark, edit in EDITS:
        path = source_dir / rel
        text = path.read_text()
        if mark in text:
            continue
        new = edit(text)
        if new is None:
            raise SystemExit(f"{path}: the code this patch expects is not there (another llama.cpp version?)")
        todo.append((path, new))
    for path, new in todo:
        path.write_text(new)
    return bool(todo)


def installed() -> bool:
    """Whether the llama-cpp-python installed here runs a patched ggml (it exports :data:`MARK`)."""
    import ctypes

    import llama_cpp.llama_cpp as low

    for lib in Path(low._base_path).glob("*ggml-cpu*"):
        try:
            cpu = ctypes.CDLL(str(lib))
            if (hasattr(cpu, MARK) and hasattr(cpu, VERSION_MARK) and hasattr(cpu, "ggml_cpu_omnidraft_multi_row")
                    and cpu.ggml_cpu_omnidraft_patch() == PATCH_VERSION):
                return True
        except OSError:
            continue
    return False


if __name__ == "__main__":
    if sys.argv[1:] == ["--installed"]:
        sys.exit(0 if installed() else 1)
    if len(sys.argv) != 2:
        raise SystemExit("usage: python scripts/patch_llamacpp.py <llama-cpp-python source dir> | --installed")
    print("patched" if patch(Path(sys.argv[1])) else "already patched", sys.argv[1])
