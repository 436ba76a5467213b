
// ---- omnidraft (scripts/patch_llamacpp.py appends this to ggml-cpu/arch/x86/quants.c) ----------------
//
// One weight row against up to four activation rows at once, for the evals of 2-31 rows that a
// speculative verify makes. ggml's one-row vec_dot unpacks a weight block for every activation row
// again; on a 2-core CPU those evals are bound by instructions, and the unpacking (Q5_0's fifth bit,
// the K-quants' nibbles and sub-block scales) is a large share of them. Here each block is unpacked
// once per group of rows, and each row's sum takes exactly the operations of the AVX2 path of
// ggml_vec_dot_{q5_0,q8_0}_q8_0 and ggml_vec_dot_{q4_K,q6_K}_q8_K in the same order (the same
// scales, integer products, fused multiply-adds per block and horizontal sums), so a row's result is
// bit for bit what the one-row kernel gives it: verifies stay batch-invariant.
//
// Each kernel: s[c * bs] = dot(weight row vx, activation row c at vy + c * by) for c < nc <= 4. A
// switch calls an always-inlined body with a constant count, so the accumulators stay in registers.

#if defined(__AVX2__)

#define OMNIDRAFT_INLINE static inline __attribute__((always_inline))
#define OMNIDRAFT_DISPATCH(body, ...)                                      \
    switch (nc) {                                                          \
        case 1: body(1, __VA_ARGS__); break;                               \
        case 2: body(2, __VA_ARGS__); break;                               \
        case 3: body(3, __VA_ARGS__); break;                               \
        default: body(4, __VA_ARGS__); break;                              \
    }

// GGML_OMNIDRAFT_COLS=0 turns the multi-row kernels off (read once), for a paired comparison in one build
int omnidraft_cols_enabled(void) {
    static int on = -1;
    if (on < 0) {
        const char * env = getenv("GGML_OMNIDRAFT_COLS");
        on = !(env != NULL && atoi(env) == 0);
    }
    return on;
}

// ---- Q5_0 and Q8_0 weights, Q8_0 activations: ggml_vec_dot_q5_0_q8_0, ggml_vec_dot_q8_0_q8_0

OMNIDRAFT_INLINE __m256i omnidraft_unpack_q5_0(const block_q5_0 * GGML_RESTRICT b) {
    __m256i qx = bytes_from_nibbles_32(b->qs);
    __m256i bxhi = bytes_from_bits_32(b->qh);
    bxhi = _mm256_andnot_si256(bxhi, _mm256_set1_epi8((char) 0xF0));
    return _mm256_or_si256(qx, bxhi);
}

OMNIDRAFT_INLINE __m256i omnidraft_unpack_q8_0(const block_q8_0 * GGML_RESTRICT b) {
    return _mm256_loadu_si256((const __m256i *) b->qs);
}

#define OMNIDRAFT_Q8_0_BODY(NC, BLOCK, UNPACK) omnidraft_q8_0_rows(NC, n, s, bs, (const char *) vx, sizeof(BLOCK), UNPACK, vy, by)

OMNIDRAFT_INLINE void omnidraft_q8_0_rows(const int NC, int n, float * GGML_RESTRICT s, size_t bs, const char * GGML_RESTRICT x,
                                          size_t x_block, __m256i (*unpack)(const void *), const void * GGML_RESTRICT vy, size_t by) {
    const int nb = n / QK8_0;
    __m256 acc[4];
    for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();
    for (int ib = 0; ib < nb; ++ib) {
        const void * xb = x + ib * x_block;
        const float dx = GGML_CPU_FP16_TO_FP32(*(const ggml_half *) xb);  // both blocks start with their scale
        const __m256i qx = unpack(xb);
        for (int c = 0; c < NC; ++c) {
            const block_q8_0 * GGML_RESTRICT yc = (const block_q8_0 *) ((const char *) vy + c * by) + ib;
            const __m256 d = _mm256_set1_ps(dx * GGML_CPU_FP16_TO_FP32(yc->d));
            const __m256i qy = _mm256_loadu_si256((const __m256i *) yc->qs);
            acc[c] = _mm256_fmadd_ps(d, mul_sum_i8_pairs_float(qx, qy), acc[c]);
        }
    }
    for (int c = 0; c < NC; ++c) s[c * bs] = hsum_float_8(acc[c]);
}

OMNIDRAFT_INLINE __m256i omnidraft_unpack_q5_0_v(const void * b) { return omnidraft_unpack_q5_0((const block_q5_0 *) b); }
OMNIDRAFT_INLINE __m256i omnidraft_unpack_q8_0_v(const void * b) { return omnidraft_unpack_q8_0((const block_q8_0 *) b); }

void omnidraft_vec_dot_q5_0_q8_0_cols(int n, int nc, float * GGML_RESTRICT s, size_t bs,
                                      const void * GGML_RESTRICT vx, const void * GGML_RESTRICT vy, size_t by) {
    OMNIDRAFT_DISPATCH(OMNIDRAFT_Q8_0_BODY, block_q5_0, omnidraft_unpack_q5_0_v)
}

void omnidraft_vec_dot_q8_0_q8_0_cols(int n, int nc, float * GGML_RESTRICT s, size_t bs,
                                      const void * GGML_RESTRICT vx, const void * GGML_RESTRICT vy, size_t by) {
    OMNIDRAFT_DISPATCH(OMNIDRAFT_Q8_0_BODY, block_q8_0, omnidraft_unpack_q8_0_v)
}

// ---- Q4_K weights, Q8_K activations: ggml_vec_dot_q4_K_q8_K

OMNIDRAFT_INLINE void omnidraft_q4_K_rows(const int NC, int n, float * GGML_RESTRICT s, size_t bs,
                                          const void * GGML_RESTRICT vx, const void * GGML_RESTRICT vy, size_t by) {
    const block_q4_K * GGML_RESTRICT x = vx;
    const int nb = n / QK_K;
    static const uint32_t kmask1 = 0x3f3f3f3f;
    static const uint32_t kmask2 = 0x0f0f0f0f;
    static const uint32_t kmask3 = 0x03030303;
    const __m256i m4 = _mm256_set1_epi8(0xF);
    __m256 acc[4];
    __m128 acc_m[4];
    for (int c = 0; c < NC; ++c) { acc[c] = _mm256_setzero_ps(); acc_m[c] = _mm_setzero_ps(); }

    for (int i = 0; i < nb; ++i) {
        uint32_t utmp[4];
        memcpy(utmp, x[i].scales, 12);
        utmp[3] = ((utmp[2] >> 4) & kmask2) | (((utmp[1] >> 6) & kmask3) << 4);
        const uint32_t uaux = utmp[1] & kmask1;
        utmp[1] = (utmp[2] & kmask2) | (((utmp[0] >> 6) & kmask3) << 4);
        utmp[2] = uaux;
        utmp[0] &= kmask1;
        const __m256i mins_and_scales = _mm256_cvtepu8_epi16(_mm_set_epi32(utmp[3], utmp[2], utmp[1], utmp[0]));
        const __m128i mins = _mm256_extracti128_si256(mins_and_scales, 1);
        const __m128i sc128 = _mm256_extracti128_si256(mins_and_scales, 0);
        const __m256i scales = MM256_SET_M128I(sc128, sc128);
        __m256i q4l[QK_K/64], q4h[QK_K/64], scale_l[QK_K/64], scale_h[QK_K/64];
        const uint8_t * GGML_RESTRICT q4 = x[i].qs;
        for (int j = 0; j < QK_K/64; ++j) {
            scale_l[j] = _mm256_shuffle_epi8(scales, get_scale_shuffle_k4(2*j+0));
            scale_h[j] = _mm256_shuffle_epi8(scales, get_scale_shuffle_k4(2*j+1));
            const __m256i q4bits = _mm256_loadu_si256((const __m256i*)q4); q4 += 32;
            q4l[j] = _mm256_and_si256(q4bits, m4);
            q4h[j] = _mm256_and_si256(_mm256_srli_epi16(q4bits, 4), m4);
        }
        const float xd = GGML_CPU_FP16_TO_FP32(x[i].d), xdmin = GGML_CPU_FP16_TO_FP32(x[i].dmin);
        for (int c = 0; c < NC; ++c) {
            const block_q8_K * GGML_RESTRICT y = (const block_q8_K *) ((const char *) vy + c * by) + i;
            const float d = y->d * xd;
            const float dmin = -y->d * xdmin;
            const __m256i q8sums = _mm256_loadu_si256((const __m256i*)y->bsums);
            const __m128i q8s = _mm_hadd_epi16(_mm256_extracti128_si256(q8sums, 0), _mm256_extracti128_si256(q8sums, 1));
            const __m128i prod = _mm_madd_epi16(mins, q8s);
            acc_m[c] = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), acc_m[c]);
            const int8_t * GGML_RESTRICT q8 = y->qs;
            __m256i sumi = _mm256_setzero_si256();
            for (int j = 0; j < QK_K/64; ++j) {
                const __m256i q8l = _mm256_loadu_si256((const __m256i*)q8); q8 += 32;
                __m256i p16l = _mm256_maddubs_epi16(q4l[j], q8l);
                p16l = _mm256_madd_epi16(scale_l[j], p16l);
                const __m256i q8h = _mm256_loadu_si256((const __m256i*)q8); q8 += 32;
                __m256i p16h = _mm256_maddubs_epi16(q4h[j], q8h);
                p16h = _mm256_madd_epi16(scale_h[j], p16h);
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p16l, p16h));
            }
            acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc[c]);
        }
    }
    for (int c = 0; c < NC; ++c) {
        __m128 m = _mm_add_ps(acc_m[c], _mm_movehl_ps(acc_m[c], acc_m[c]));
        m = _mm_add_ss(m, _mm_movehdup_ps(m));
        s[c * bs] = hsum_float_8(acc[c]) + _mm_cvtss_f32(m);
    }
}

#define OMNIDRAFT_K_BODY(NC, FN) FN(NC, n, s, bs, vx, vy, by)

void omnidraft_vec_dot_q4_K_q8_K_cols(int n, int nc, float * GGML_RESTRICT s, size_t bs,
                                      const void * GGML_RESTRICT vx, const void * GGML_RESTRICT vy, size_t by) {
    OMNIDRAFT_DISPATCH(OMNIDRAFT_K_BODY, omnidraft_q4_K_rows)
}

// ---- Q6_K weights, Q8_K activations: ggml_vec_dot_q6_K_q8_K

OMNIDRAFT_INLINE void omnidraft_q6_K_rows(const int NC, int n, float * GGML_RESTRICT s, size_t bs,
                                          const void * GGML_RESTRICT vx, const void * GGML_RESTRICT vy, size_t by) {
    const block_q6_K * GGML_RESTRICT x = vx;
    const int nb = n / QK_K;
    const __m256i m3 = _mm256_set1_epi8(3);
    const __m256i m15 = _mm256_set1_epi8(15);
    __m256 acc[4];
    for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();

    for (int i = 0; i < nb; ++i) {
        const uint8_t * GGML_RESTRICT q4 = x[i].ql;
        const uint8_t * GGML_RESTRICT qh = x[i].qh;
        const __m128i scales = _mm_loadu_si128((const __m128i*)x[i].scales);
        const __m256i scales_16 = _mm256_cvtepi8_epi16(scales);
        __m256i w[QK_K/32], sc[QK_K/32];  // the unpacked weights and their scales, per 32 of them
        for (int j = 0, is = 0; j < QK_K/128; ++j, is += 4) {
            const __m256i q4bits1 = _mm256_loadu_si256((const __m256i*)q4); q4 += 32;
            const __m256i q4bits2 = _mm256_loadu_si256((const __m256i*)q4); q4 += 32;
            const __m256i q4bitsH = _mm256_loadu_si256((const __m256i*)qh); qh += 32;
            const __m256i q4h_0 = _mm256_slli_epi16(_mm256_and_si256(q4bitsH, m3), 4);
            const __m256i q4h_1 = _mm256_slli_epi16(_mm256_and_si256(q4bitsH, _mm256_set1_epi8(12)), 2);
            const __m256i q4h_2 = _mm256_and_si256(q4bitsH, _mm256_set1_epi8(48));
            const __m256i q4h_3 = _mm256_srli_epi16(_mm256_and_si256(q4bitsH, _mm256_set1_epi8(-64)), 2);
            w[4*j+0] = _mm256_or_si256(_mm256_and_si256(q4bits1, m15), q4h_0);
            w[4*j+1] = _mm256_or_si256(_mm256_and_si256(q4bits2, m15), q4h_1);
            w[4*j+2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q4bits1, 4), m15), q4h_2);
            w[4*j+3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q4bits2, 4), m15), q4h_3);
            for (int t = 0; t < 4; ++t) sc[4*j+t] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, get_scale_shuffle(is + t)));
        }
        const float xd = GGML_CPU_FP16_TO_FP32(x[i].d);
        for (int c = 0; c < NC; ++c) {
            const block_q8_K * GGML_RESTRICT y = (const block_q8_K *) ((const char *) vy + c * by) + i;
            const float d = y->d * xd;
            const __m256i q8sums = _mm256_loadu_si256((const __m256i*)y->bsums);
            const __m256i q8sclsub = _mm256_slli_epi32(_mm256_madd_epi16(q8sums, scales_16), 5);
            const int8_t * GGML_RESTRICT q8 = y->qs;
            __m256i sumi = _mm256_setzero_si256();
            for (int j = 0; j < QK_K/128; ++j) {
                __m256i p16[4];
                for (int t = 0; t < 4; ++t) {
                    const __m256i q8t = _mm256_loadu_si256((const __m256i*)q8); q8 += 32;
                    p16[t] = _mm256_madd_epi16(sc[4*j+t], _mm256_maddubs_epi16(w[4*j+t], q8t));
                }
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p16[0], p16[1]));
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p16[2], p16[3]));
            }
            sumi = _mm256_sub_epi32(sumi, q8sclsub);
            acc[c] = _mm256_fmadd_ps(_mm256_broadcast_ss(&d), _mm256_cvtepi32_ps(sumi), acc[c]);
        }
    }
    for (int c = 0; c < NC; ++c) s[c * bs] = hsum_float_8(acc[c]);
}

void omnidraft_vec_dot_q6_K_q8_K_cols(int n, int nc, float * GGML_RESTRICT s, size_t bs,
                                      const void * GGML_RESTRICT vx, const void * GGML_RESTRICT vy, size_t by) {
    OMNIDRAFT_DISPATCH(OMNIDRAFT_K_BODY, omnidraft_q6_K_rows)
}

#endif  // __AVX2__
