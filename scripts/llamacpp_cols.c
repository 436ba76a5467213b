
// ---- omnidraft (scripts/patch_llamacpp.py appends this to ggml-cpu/arch/x86/quants.c) ----------------
//
// One weight row against up to four activation rows at once, for the evals of 2-31 rows that a
// speculative verify makes. ggml's one-row vec_dot unpacks a weight block for every activation row
// again; on a 2-core CPU those evals are bound by instructions, and for Q5_0 the unpacking (the fifth
// bit of each weight) is half of them. Here each block is unpacked once per group of rows, and each
// row's sum takes exactly the operations of ggml_vec_dot_{q5_0,q8_0}_q8_0's AVX2 path in the same order
// (the same combined scale, integer products, fused multiply-add per block and horizontal sum), so a
// row's result is bit for bit what the one-row kernel gives it: verifies stay batch-invariant.

#if defined(__AVX2__)

// GGML_OMNIDRAFT_COLS=0 turns the multi-row kernels off (read once), for a paired comparison in one build
int omnidraft_cols_enabled(void) {
    static int on = -1;
    if (on < 0) {
        const char * env = getenv("GGML_OMNIDRAFT_COLS");
        on = !(env != NULL && atoi(env) == 0);
    }
    return on;
}

// s[c * bs] = dot(weight row vx, activation row c at vy + c * by) for c < NC.
#define OMNIDRAFT_COLS_BODY(NC, UNPACK)                                                          \
    do {                                                                                        \
        __m256 acc[NC];                                                                         \
        for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();                              \
        for (int ib = 0; ib < nb; ++ib) {                                                       \
            const float dx = GGML_CPU_FP16_TO_FP32(x[ib].d);                                    \
            const __m256i qx = UNPACK;                                                          \
            for (int c = 0; c < NC; ++c) {                                                      \
                const block_q8_0 * GGML_RESTRICT yc = (const block_q8_0 *) ((const char *) vy + c * by) + ib; \
                const __m256 d = _mm256_set1_ps(dx * GGML_CPU_FP16_TO_FP32(yc->d));             \
                const __m256i qy = _mm256_loadu_si256((const __m256i *) yc->qs);                \
                acc[c] = _mm256_fmadd_ps(d, mul_sum_i8_pairs_float(qx, qy), acc[c]);            \
            }                                                                                   \
        }                                                                                       \
        for (int c = 0; c < NC; ++c) s[c * bs] = hsum_float_8(acc[c]);                          \
    } while (0)

static inline __m256i omnidraft_unpack_q5_0(const block_q5_0 * GGML_RESTRICT b) {
    __m256i qx = bytes_from_nibbles_32(b->qs);
    __m256i bxhi = bytes_from_bits_32(b->qh);
    bxhi = _mm256_andnot_si256(bxhi, _mm256_set1_epi8((char) 0xF0));
    return _mm256_or_si256(qx, bxhi);
}

void omnidraft_vec_dot_q5_0_q8_0_cols(int n, int nc, float * GGML_RESTRICT s, size_t bs,
                                      const void * GGML_RESTRICT vx, const void * GGML_RESTRICT vy, size_t by) {
    const int nb = n / QK8_0;
    const block_q5_0 * GGML_RESTRICT x = vx;
    switch (nc) {  // a constant count per case keeps the accumulators in registers
        case 1: OMNIDRAFT_COLS_BODY(1, omnidraft_unpack_q5_0(x + ib)); break;
        case 2: OMNIDRAFT_COLS_BODY(2, omnidraft_unpack_q5_0(x + ib)); break;
        case 3: OMNIDRAFT_COLS_BODY(3, omnidraft_unpack_q5_0(x + ib)); break;
        default: OMNIDRAFT_COLS_BODY(4, omnidraft_unpack_q5_0(x + ib)); break;
    }
}

void omnidraft_vec_dot_q8_0_q8_0_cols(int n, int nc, float * GGML_RESTRICT s, size_t bs,
                                      const void * GGML_RESTRICT vx, const void * GGML_RESTRICT vy, size_t by) {
    const int nb = n / QK8_0;
    const block_q8_0 * GGML_RESTRICT x = vx;
    switch (nc) {
        case 1: OMNIDRAFT_COLS_BODY(1, _mm256_loadu_si256((const __m256i *) x[ib].qs)); break;
        case 2: OMNIDRAFT_COLS_BODY(2, _mm256_loadu_si256((const __m256i *) x[ib].qs)); break;
        case 3: OMNIDRAFT_COLS_BODY(3, _mm256_loadu_si256((const __m256i *) x[ib].qs)); break;
        default: OMNIDRAFT_COLS_BODY(4, _mm256_loadu_si256((const __m256i *) x[ib].qs)); break;
    }
}

#endif  // __AVX2__
