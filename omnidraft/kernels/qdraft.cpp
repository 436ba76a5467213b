// A llama-architecture drafter's whole forward pass on its GGUF weights, in one call (AVX2 + FMA + F16C; the
// products on AVX512-VNNI where the CPU has it, with the same bits).
//
// Why: drafting is one token at a time, where eager torch and onnxruntime pay per operator (30 layers x
// ~20 ops) and llama.cpp rounds activations to 8 bits (its Q8 dot products), which moved the drafter's
// top-1 token on 2-3% of positions. Here the weights stay in the GGUF's own blocks (Q4_1 / Q8_0, 32
// weights per block: nothing dequantized, ~100 MB read per token for SmolLM2-135M) and activations
// are rounded to 16 bits per block of 32 (relative error ~1e-5 of the block's largest value), so the
// result follows the float32 model on the dequantized weights.
//
// Mechanism of a Linear product (weights W [out, in] in blocks, activations x [rows, in]):
//   y[r][o] = sum_b d_ob * s_rb * sum_j q_obj * xq_rbj  +  m_ob * sum_j x_rbj
// with (d, m, q) the block's scale, minimum and 4- or 8-bit integers (Q8_0 has no minimum), xq the
// activations as 16-bit integers with one scale s per block, and the minimum's term taken on the float
// activations' block sums. Q8_0 weights multiply xq as int16 (_mm256_madd_epi16); Q4_1 weights multiply
// xq's two signed bytes (xq = 255 hi + lo, _mm256_maddubs_epi16: 32 products per instruction). At load,
// each row is laid out with its block scales first (Model::repack), so a row is read front to back and
// its scales are taken 8 blocks per instruction; the weights are requested from memory ahead of use.
//
// A read of many rows (a prompt, a long catch-up) is bound by arithmetic rather than by the weights' bytes, and
// there the integer products cost more per multiply-add than float32 does: such reads take their products in
// float32 on weight tiles dequantized once per read (qdraft_gemm.h), or on AMX tiles as three bfloat16 products
// (qdraft_amx.h). Within ~1e-2 of the integer products' logits, not their bits (`long_read_rows`, `use_amx`).
//
// One OpenMP parallel region per forward: the threads share each Linear's output rows (omp for) and
// meet at barriers between the steps that depend on each other; the cheap row-wise steps (norms,
// rotary with its angles computed once per forward) run on one thread, quantizing and the MLP's
// activation on all (vectorized). RoPE is GGML's "normal" mode (adjacent pairs), which is what the
// GGUF's permuted q/k rows expect. LoRA pairs (A [rank, in], B [out, rank], given as float32) add
// scale * B (A x) to a Linear, in the GGUF's row order (callers permute q/k rows as the converter does);
// they are held as float16, B transposed, which halves the bytes a token reads for them.
#include <torch/extension.h>
#include <cpuid.h>
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

namespace {

constexpr int QK = 32;
constexpr int Q4_1 = 3, Q8_0 = 8;  // ggml_type values
constexpr float QMAX = 32512.f;   // activations' 16-bit range: 255 * 127 + 127
constexpr int64_t MAX_BLOCKS = 512;  // blocks per weight row a product takes (in <= 16384)
constexpr int64_t PREFETCH_AHEAD = 4096;  // bytes: see prefetch_ahead
constexpr int64_t OUT_TILE = 16;  // weight rows per tile of a product: see linear_for

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

inline float half(const uint8_t* p) { return _cvtsh_ss(*reinterpret_cast<const uint16_t*>(p)); }

// activations of `rows` rows of length n, rounded per block of 32
struct QRows {
  int64_t rows = 0, n = 0;
  std::vector<int16_t> q;
  std::vector<int8_t> split;  // per block 64 bytes: lo[32] then hi[32], q = 255 hi + lo, both in [-127, 127]
  std::vector<float> scale, sum;
  void resize(int64_t r, int64_t len) {
    rows = r; n = len;
    q.resize(r * len); split.resize(2 * r * len); scale.resize(r * len / QK); sum.resize(r * len / QK);
  }
  // block b from v (32 floats): int16 values, scale and float sum; rounds to nearest (even), as nearbyint
  void quantize_block(const float* v, int64_t b) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 r[4], amax = _mm256_setzero_ps(), total = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      r[j] = _mm256_loadu_ps(v + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, r[j]));
      total = _mm256_add_ps(total, r[j]);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float am = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
    const __m256 inv = _mm256_set1_ps(am > 0.f ? QMAX / am : 0.f);
    __m256i hi[4], lo[4];
    for (int j = 0; j < 4; ++j) {  // |values| <= QMAX = 255 * 127 + 127: hi and lo each fit in [-127, 127]
      const __m256 f = _mm256_round_ps(_mm256_mul_ps(r[j], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      r[j] = f;
      hi[j] = _mm256_cvtps_epi32(_mm256_mul_ps(f, _mm256_set1_ps(1.f / 255.f)));  // never near a tie: q is whole
      lo[j] = _mm256_sub_epi32(_mm256_cvtps_epi32(f), _mm256_mullo_epi32(hi[j], _mm256_set1_epi32(255)));
    }
    for (int j = 0; j < 4; j += 2)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(&q[b * QK + 8 * j]),
                          _mm256_permute4x64_epi64(_mm256_packs_epi32(_mm256_cvtps_epi32(r[j]), _mm256_cvtps_epi32(r[j + 1])), 0xD8));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
    auto pack8 = [&](const __m256i* v) {  // 32 int32 in [-127, 127] -> 32 int8 in element order
      const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
      return _mm256_permutevar8x32_epi32(w, order);
    };
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(&split[b * 2 * QK]), pack8(lo));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(&split[b * 2 * QK + QK]), pack8(hi));
    scale[b] = am / QMAX; sum[b] = hsum(total);
  }
  // x [rows, n]; the team shares the blocks (call inside a parallel region: ends at a barrier)
  void set_for(const float* x) {
#pragma omp for schedule(static)
    for (int64_t b = 0; b < rows * n / QK; ++b) quantize_block(x + b * QK, b);
  }
};

struct QLinear {  // a weight [out, in] in GGUF blocks (the products' weights laid out by Model::repack)
  torch::Tensor bytes;
  int type = 0;
  int64_t out = 0, in = 0, row_bytes = 0;
  const uint8_t* base = nullptr;  // bytes' data, taken once (data_ptr checks its type at every call)
  const uint8_t* row(int64_t o) const { return base + o * row_bytes; }
};

struct Lora { torch::Tensor a, bt; float scale = 0.f; };  // float16 a [rank, in] and bt = B^T [rank, out]

// ds[m][b] = d_b * s_(r0 + m, b): a weight row's block scales (float16 [nb]) times M activation rows' block
// scales, 8 blocks per instruction
template <int M>
inline void block_scales(const uint16_t* dh, int64_t nb, const QRows& x, int64_t r0, float (*ds)[MAX_BLOCKS]) {
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8) {
    const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dh + b)));
    for (int m = 0; m < M; ++m) _mm256_store_ps(&ds[m][b], _mm256_mul_ps(dv, _mm256_loadu_ps(&x.scale[(r0 + m) * nb + b])));
  }
  for (; b < nb; ++b)
    for (int m = 0; m < M; ++m) ds[m][b] = _cvtsh_ss(dh[b]) * x.scale[(r0 + m) * nb + b];
}

// The weights stream from memory once per token, a few hundred bytes per row: without a request this far
// ahead, each row's first loads waited on memory (the hardware prefetcher alone kept ~5 GB/s per core)
inline void prefetch_ahead(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH_AHEAD), _MM_HINT_T0); }

// The Q4_1 blocks as bytes: each block's 16 bytes are broadcast to both halves of a register and the upper
// half shifted by 4, so one AND leaves elements 0..31 as bytes in order (no cross-lane unpacking).
inline __m256i q41_unpack(const uint8_t* nib16) {
  const __m256i shift = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
  return _mm256_and_si256(
      _mm256_srlv_epi32(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(nib16))), shift),
      _mm256_set1_epi8(0x0F));
}

// mins[m] = sum_b m_b * sum(x_(r0 + m), b): the Q4_1 minimums' term of M activation rows
template <int M>
inline void q41_mins(const uint16_t* mh, int64_t nb, const QRows& x, int64_t r0, float* mins) {
  __m256 macc[M];
  for (int m = 0; m < M; ++m) macc[m] = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8) {
    const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mh + b)));
    for (int m = 0; m < M; ++m) macc[m] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(&x.sum[(r0 + m) * nb + b]), macc[m]);
  }
  for (int m = 0; m < M; ++m) mins[m] = hsum(macc[m]);
  for (; b < nb; ++b)
    for (int m = 0; m < M; ++m) mins[m] += _cvtsh_ss(mh[b]) * x.sum[(r0 + m) * nb + b];
}

// A block's integer products, 8 int32 lanes each summing 4 consecutive products. Q8_0: the weights as int16
// against the int16 activations (_mm256_madd_epi16). Q4_1: the nibbles (unsigned bytes) against the
// activations' two signed bytes, lo[32] then hi[32] with q = 255 hi + lo; _mm256_maddubs_epi16 multiplies 32
// pairs per instruction without saturating (2 * 15 * 127 < 2^15).
namespace avx2 {
inline __m256i q8_lanes(__m256i wl, __m256i wh, const int16_t* xq) {
  return _mm256_add_epi32(_mm256_madd_epi16(wl, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq))),
                          _mm256_madd_epi16(wh, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 16))));
}
inline __m256i q41_lanes(__m256i wv, const int8_t* xs) {
  const __m256i lo = _mm256_madd_epi16(_mm256_maddubs_epi16(wv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs))),
                                       _mm256_set1_epi16(1));
  const __m256i hi = _mm256_madd_epi16(_mm256_maddubs_epi16(wv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs + QK))),
                                       _mm256_set1_epi16(255));
  return _mm256_add_epi32(lo, hi);
}
#include "qdraft_rows.h"
}  // namespace avx2

// The same lanes on CPUs with AVX512-VNNI (Sapphire Rapids, Zen 4 and later; 256-bit registers):
// _mm256_dpwssd_epi32 and _mm256_dpbusd_epi32 sum each lane's products straight into it, in fewer
// instructions on the multiply ports (Q8_0: 2 instead of 3 per block and row; Q4_1: 4 instead of 5).
// No lane can overflow (|sum| <= 4 * 128 * 32512 and 4 * 15 * 32512), so the integers are those above.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512vnni")
namespace vnni {
inline __m256i q8_lanes(__m256i wl, __m256i wh, const int16_t* xq) {
  const __m256i t = _mm256_dpwssd_epi32(_mm256_setzero_si256(), wl, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq)));
  return _mm256_dpwssd_epi32(t, wh, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 16)));
}
inline __m256i q41_lanes(__m256i wv, const int8_t* xs) {
  __m256i t = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs + QK)));
  t = _mm256_sub_epi32(_mm256_slli_epi32(t, 8), t);  // 255 hi
  return _mm256_dpbusd_epi32(t, wv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs)));  // + lo
}
#include "qdraft_rows.h"
}  // namespace vnni
#pragma GCC pop_options

// Whether the products take the VNNI path: where the CPU has it, unless switched off (`use_vnni`)
bool vnni_on = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");

template <int M>
inline void dot_rows(const QLinear& w, int64_t o, const QRows& x, int64_t r0, float* y, int64_t ys) {
  if (vnni_on) {
    if (w.type == Q4_1) vnni::dot_rows_q41<M>(w, o, x, r0, y, ys); else vnni::dot_rows_q8<M>(w, o, x, r0, y, ys);
  } else {
    if (w.type == Q4_1) avx2::dot_rows_q41<M>(w, o, x, r0, y, ys); else avx2::dot_rows_q8<M>(w, o, x, r0, y, ys);
  }
}

// Weight row o as float32 (`Model::repack`'s layout): d q + m for Q4_1 (nibble j of a block's byte j is element j,
// its high nibble element j + 16, as GGUF stores them), d q for Q8_0
inline void dequantize_row(const QLinear& w, int64_t o, float* out) {
  const int64_t nb = w.in / QK;
  const uint16_t* dh = reinterpret_cast<const uint16_t*>(w.row(o));
  if (w.type == Q4_1) {
    const uint8_t* nib = reinterpret_cast<const uint8_t*>(dh + 2 * nb);
    for (int64_t b = 0; b < nb; ++b) {
      const __m256 d = _mm256_set1_ps(_cvtsh_ss(dh[b])), m = _mm256_set1_ps(_cvtsh_ss(dh[nb + b]));
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(nib + b * 16));
      const __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(0x0F)), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F));
      const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
      for (int j = 0; j < 4; ++j)
        _mm256_storeu_ps(out + b * QK + 8 * j, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[j])), m));
    }
  } else {
    const int8_t* qs = reinterpret_cast<const int8_t*>(dh + nb);
    for (int64_t b = 0; b < nb; ++b) {
      const __m256 d = _mm256_set1_ps(_cvtsh_ss(dh[b]));
      for (int j = 0; j < 4; ++j) {
        const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + b * QK + 8 * j));
        _mm256_storeu_ps(out + b * QK + 8 * j, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8))));
      }
    }
  }
}

namespace gemm256 {
using VF = __m256;
constexpr int LANES = 8, GR = 4, GC = 2;  // 8 accumulators, 4 activation vectors and a weight vector of 16 registers
inline VF vzero() { return _mm256_setzero_ps(); }
inline VF vload(const float* p) { return _mm256_loadu_ps(p); }
inline VF vfma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
inline float vhsum(VF v) { return hsum(v); }
#include "qdraft_gemm.h"
}  // namespace gemm256

#pragma GCC push_options
#pragma GCC target("avx512f")
namespace gemm512 {
using VF = __m512;
constexpr int LANES = 16, GR = 4, GC = 4;  // 16 accumulators, 4 activation vectors and a weight vector of 32 registers
inline VF vzero() { return _mm512_setzero_ps(); }
inline VF vload(const float* p) { return _mm512_loadu_ps(p); }
inline VF vfma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
inline float vhsum(VF v) { return _mm512_reduce_add_ps(v); }
#include "qdraft_gemm.h"
}  // namespace gemm512
#pragma GCC pop_options

#if defined(__clang__) || __GNUC__ >= 11  // compilers that know AMX's intrinsics
#define QDRAFT_AMX 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bf16,amx-tile,amx-bf16")
#include "qdraft_amx.h"
#pragma GCC pop_options
#else
#define QDRAFT_AMX 0
constexpr int64_t AMX_ROWS = 16;
inline void amx_pack_for(const float*, int64_t, int64_t, uint32_t*) {}
inline void amx_gemm_for(const QLinear&, const uint32_t*, int64_t, float*, float*, uint16_t*) {}
#endif

// Whether the CPU has AMX tiles with bfloat16 products and AVX512-BF16, and the kernel lets this process use the
// tiles' state (Linux asks each process to request it: arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA)
bool amx_usable() {
  if (!QDRAFT_AMX) return false;
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool tile = d & (1u << 24), tile_bf16 = d & (1u << 22);
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
  const bool avx512_bf16 = a & (1u << 5);
  if (!(tile && tile_bf16 && avx512_bf16 && __builtin_cpu_supports("avx512f"))) return false;
  return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
}

bool avx512_on = __builtin_cpu_supports("avx512f");
bool amx_on = amx_usable();  // a long read's products on AMX tiles (`use_amx`)
// Reads of at least this many rows take their products in float32 (qdraft_gemm.h); 0: never (`long_read_rows`)
constexpr int64_t LONG_ROWS = 16;  // the start where the float32 products are chosen (`long_read_default`)
int64_t long_rows = LONG_ROWS;
// ... and of at least this many on AMX tiles, where usable: the split of every weight into two bfloat16 costs a
// fixed time per read that fewer rows do not earn back (docs/performance.md has the read times by rows)
constexpr int64_t AMX_MIN_ROWS = 32;

// Whether a Linear's product in a read of `rows` rows goes the float32 way: a long read (from `from` rows, the
// forward's copy of long_rows: a setting changed meanwhile by another thread waits for the next forward), whole tiles
inline bool long_read(const QLinear& w, int64_t rows, int64_t from) { return from > 0 && rows >= from && w.out % OUT_TILE == 0; }

inline void gemm_for(const QLinear& w, const float* x, int64_t rows, float* y, float* scratch) {
  if (avx512_on) gemm512::gemm_for(w, x, rows, y, scratch); else gemm256::gemm_for(w, x, rows, y, scratch);
}

// y [rows, out] = x W^T, tiles of weight rows shared among the team (call inside a parallel region). Within a
// tile, each group of 4 activation rows meets every weight row of the tile: the tile's weights and the group's
// activations both stay in L1 (weight row by weight row, a long read streamed all its activations from L2
// once per weight row).
void linear_for(const QLinear& w, const QRows& x, float* y) {
  const int64_t rows = x.rows, tiles = (w.out + OUT_TILE - 1) / OUT_TILE;
#pragma omp for schedule(static) nowait
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t o0 = t * OUT_TILE, o1 = std::min(o0 + OUT_TILE, w.out);
    int64_t r = 0;  // one pass over the weight row per 4 activation rows, and one for the rest
    for (; r + 4 <= rows; r += 4)
      for (int64_t o = o0; o < o1; ++o) dot_rows<4>(w, o, x, r, y + r * w.out + o, w.out);
    for (int64_t o = o0; o < o1; ++o) switch (rows - r) {
      case 3: dot_rows<3>(w, o, x, r, y + r * w.out + o, w.out); break;
      case 2: dot_rows<2>(w, o, x, r, y + r * w.out + o, w.out); break;
      case 1: dot_rows<1>(w, o, x, r, y + r * w.out + o, w.out); break;
      default: break;
    }
  }
}

// 8 float16 values as float32
template <typename Half>  // at::Half (LoRA factors) or uint16_t (the KV cache): the same 2-byte float16
inline __m256 load_half8(const Half* p) {
  static_assert(sizeof(Half) == 2, "float16 values");
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline uint16_t to_half(float x) { return _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT); }

// t [rows, rank] = scale * x A^T (float activations, A in float16): the LoRA scale applied once per rank row.
// Four accumulators per dot product (a single FMA chain would wait on its own latency at every step); `in` is
// a multiple of the 32-wide quantization block
void lora_a_for(const Lora& l, const float* x, int64_t rows, int64_t in, float* t) {
  const int64_t rank = l.a.size(0);
  const at::Half* a = l.a.data_ptr<at::Half>();
#pragma omp for schedule(static) nowait
  for (int64_t k = 0; k < rank * rows; ++k) {
    const int64_t r = k / rank, j = k % rank;
    const at::Half* aj = a + j * in;
    const float* xr = x + r * in;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t i = 0; i < in; i += 32)
      for (int u = 0; u < 4; ++u) acc[u] = _mm256_fmadd_ps(load_half8(aj + i + 8 * u), _mm256_loadu_ps(xr + i + 8 * u), acc[u]);
    t[r * rank + j] = l.scale * hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
  }
}

// y [rows, out] += t B^T for outputs [o, o + 8 * U) (t already scaled; B held transposed, bt [rank, out], float16):
// U independent accumulators, and each rank row's 8 * U outputs read as whole cache lines
template <int U>
inline void lora_b_block(const at::Half* bt, int64_t rank, int64_t out, const float* t, int64_t rows, int64_t o, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    float* yr = y + r * out + o;
    const float* tr = t + r * rank;
    __m256 acc[U];
    for (int u = 0; u < U; ++u) acc[u] = _mm256_loadu_ps(yr + 8 * u);
    for (int64_t j = 0; j < rank; ++j) {
      const __m256 tj = _mm256_set1_ps(tr[j]);
      for (int u = 0; u < U; ++u) acc[u] = _mm256_fmadd_ps(tj, load_half8(bt + j * out + o + 8 * u), acc[u]);
    }
    for (int u = 0; u < U; ++u) _mm256_storeu_ps(yr + 8 * u, acc[u]);
  }
}

// y [rows, out] += t B^T, output blocks of 32 shared among the team (and a tail of 8s)
void lora_b_for(const Lora& l, const float* t, int64_t rows, float* y) {
  const int64_t rank = l.bt.size(0), out = l.bt.size(1), wide = out / 32 * 32;
  const at::Half* bt = l.bt.data_ptr<at::Half>();
  const int64_t blocks = wide / 32 + (out - wide) / 8;  // 32 outputs each, then 8 each
#pragma omp for schedule(static) nowait
  for (int64_t b = 0; b < blocks; ++b) {
    if (b < wide / 32) lora_b_block<4>(bt, rank, out, t, rows, 32 * b, y);
    else lora_b_block<1>(bt, rank, out, t, rows, wide + 8 * (b - wide / 32), y);
  }
}

void rms_norm(const float* x, const float* w, float* y, int64_t n, float eps) {
  double ss = 0.0;
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float inv = 1.f / std::sqrt(static_cast<float>(ss / n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * inv * w[i];
}

// e^x for x <= 0 (softmax after subtracting the maximum): 2^(x log2 e) as 2^n * 2^f, with 2^f a degree-6
// polynomial on [-0.5, 0.5] (relative error ~2e-7, as std::exp's float result for these inputs)
inline __m256 exp_neg(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.693147180559945f));  // f ln2 in [-ln2/2, ln2/2]
  __m256 p = _mm256_set1_ps(1.f / 720.f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// g = silu(g) * u over [rows, n] and its quantized blocks into qg, the team sharing the blocks (ends at a
// barrier). silu(g) = g / (1 + e^-g), taken as g / (1 + e) for g >= 0 and g e / (1 + e) below, e = e^-|g|.
void silu_mul_set_for(float* g, const float* u, QRows& qg) {
  const __m256 sign = _mm256_set1_ps(-0.f), one = _mm256_set1_ps(1.f);
#pragma omp for schedule(static)
  for (int64_t b = 0; b < qg.rows * qg.n / QK; ++b) {
    float* v = g + b * QK;
    for (int j = 0; j < QK; j += 8) {
      const __m256 x = _mm256_loadu_ps(v + j);
      const __m256 e = exp_neg(_mm256_or_ps(x, sign));  // e^-|x|
      const __m256 num = _mm256_blendv_ps(one, e, x);   // sign bit set: x < 0
      const __m256 y = _mm256_div_ps(_mm256_mul_ps(x, num), _mm256_add_ps(one, e));
      _mm256_storeu_ps(v + j, _mm256_mul_ps(y, _mm256_loadu_ps(u + b * QK + j)));
    }
    qg.quantize_block(v, b);
  }
}

// Attention, flash-decoding style: a row's positions are cut into fixed chunks of ATT_CHUNK, each chunk of
// one KV head a work item for all the query heads that share it (GQA), and the chunks' partial softmaxes
// are merged in chunk order. So the keys and values are read once per KV head rather than once per query
// head, two threads share even a one-row step, and, the chunks being fixed in absolute positions, a row's
// result does not depend on how many rows a call holds or how many threads it has.
constexpr int64_t ATT_CHUNK = 64;

// One chunk [j0, j1) of one KV head for the G query heads q + g * qstride, one query row. The cache is
// float16 (half the bytes a token reads from it; llama.cpp's default too): keys in tiles of 8 positions (tile
// t at kt + t * tstride, dimension i's 8 positions at + i * 8), values row-major (vals[j * vstride + i]).
// Writes part + g * pstride = {m, l, acc[D]}: the chunk's largest score, sum_j e^(s_j - m), and
// sum_j e^(s_j - m) v_j.
template <int G>
void attend_chunk(const float* q, int64_t qstride, const uint16_t* kt, int64_t tstride, const uint16_t* vals,
                  int64_t vstride, int64_t D, int64_t j0, int64_t j1, float scale, float* part, int64_t pstride) {
  alignas(32) float sc[G][ATT_CHUNK];
  const int64_t n = j1 - j0, n8 = (n + 7) / 8 * 8;
  for (int64_t j = 0; j < n8; j += 8) {  // 8 positions' scores at once from one contiguous tile: no horizontal sums
    const uint16_t* tile = kt + ((j0 + j) / 8) * tstride;
    __m256 a0[G], a1[G];
    for (int g = 0; g < G; ++g) a0[g] = a1[g] = _mm256_setzero_ps();
    for (int64_t i = 0; i < D; i += 2) {
      if (i % 4 == 0)  // 4 dimensions = one cache line: the next tile's line is requested as this one is read
        _mm_prefetch(reinterpret_cast<const char*>(tile + tstride + i * 8), _MM_HINT_T0);
      const __m256 k0 = load_half8(tile + i * 8), k1 = load_half8(tile + (i + 1) * 8);
      for (int g = 0; g < G; ++g) {
        a0[g] = _mm256_fmadd_ps(_mm256_set1_ps(q[g * qstride + i]), k0, a0[g]);
        a1[g] = _mm256_fmadd_ps(_mm256_set1_ps(q[g * qstride + i + 1]), k1, a1[g]);
      }
    }
    for (int g = 0; g < G; ++g) _mm256_store_ps(&sc[g][j], _mm256_mul_ps(_mm256_add_ps(a0[g], a1[g]), _mm256_set1_ps(scale)));
  }
  for (int g = 0; g < G; ++g) {
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; ++j) mx = std::max(mx, sc[g][j]);
    for (int64_t j = 0; j < n8; j += 8)
      _mm256_store_ps(&sc[g][j], exp_neg(_mm256_sub_ps(_mm256_load_ps(&sc[g][j]), _mm256_set1_ps(mx))));
    for (int64_t j = n; j < n8; ++j) sc[g][j] = 0.f;  // positions past the chunk's end weigh nothing
    __m256 total = _mm256_setzero_ps();
    for (int64_t j = 0; j < n8; j += 8) total = _mm256_add_ps(total, _mm256_load_ps(&sc[g][j]));
    part[g * pstride] = mx; part[g * pstride + 1] = hsum(total);
  }
  for (int64_t i0 = 0; i0 < D; i0 += 16) {  // the weighted values, 16 dimensions of every head in registers
    const int wide = D - i0 >= 16 ? 2 : 1;
    __m256 acc[G][2];
    for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const uint16_t* row = vals + (j0 + j) * vstride + i0;
      if (i0 == 0) _mm_prefetch(reinterpret_cast<const char*>(row + 4 * vstride), _MM_HINT_T0);
      const __m256 v0 = load_half8(row), v1 = wide == 2 ? load_half8(row + 8) : _mm256_setzero_ps();
      for (int g = 0; g < G; ++g) {
        const __m256 w = _mm256_set1_ps(sc[g][j]);
        acc[g][0] = _mm256_fmadd_ps(w, v0, acc[g][0]);
        acc[g][1] = _mm256_fmadd_ps(w, v1, acc[g][1]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < wide; ++c) _mm256_storeu_ps(part + g * pstride + 2 + i0 + 8 * c, acc[g][c]);
  }
}

// The G heads of a KV head against one chunk, G taken as a compile-time constant where it is a common group
void attend_group(int64_t G, const float* q, int64_t qstride, const uint16_t* kt, int64_t tstride, const uint16_t* vals,
                  int64_t vstride, int64_t D, int64_t j0, int64_t j1, float scale, float* part, int64_t pstride) {
  switch (G) {
    case 1: attend_chunk<1>(q, qstride, kt, tstride, vals, vstride, D, j0, j1, scale, part, pstride); return;
    case 2: attend_chunk<2>(q, qstride, kt, tstride, vals, vstride, D, j0, j1, scale, part, pstride); return;
    case 3: attend_chunk<3>(q, qstride, kt, tstride, vals, vstride, D, j0, j1, scale, part, pstride); return;
    case 4: attend_chunk<4>(q, qstride, kt, tstride, vals, vstride, D, j0, j1, scale, part, pstride); return;
    default:  // larger groups: the chunk is read once per 4 heads
      for (int64_t g = 0; g < G; g += 4)
        attend_group(std::min<int64_t>(4, G - g), q + g * qstride, qstride, kt, tstride, vals, vstride, D, j0, j1,
                     scale, part + g * pstride, pstride);
  }
}

// out[D] = the softmax-weighted values of one query head from its chunks' partials {m, l, acc} (part + c *
// cstride), merged in chunk order: each chunk rescaled by e^(m_c - max_c m_c)
void attend_merge(const float* part, int64_t chunks, int64_t cstride, int64_t D, float* out) {
  float mx = -INFINITY;
  for (int64_t c = 0; c < chunks; ++c) mx = std::max(mx, part[c * cstride]);
  float total = 0.f;
  for (int64_t i = 0; i < D; ++i) out[i] = 0.f;
  for (int64_t c = 0; c < chunks; ++c) {
    const float* pc = part + c * cstride;
    const float w = std::exp(pc[0] - mx);
    total += w * pc[1];
    for (int64_t i = 0; i < D; ++i) out[i] += w * pc[2 + i];
  }
  const float inv = 1.f / total;
  for (int64_t i = 0; i < D; ++i) out[i] *= inv;
}

enum Slot { WQ, WK, WV, WO, WGATE, WUP, WDOWN, N_SLOTS };

struct Layer {
  QLinear w[N_SLOTS];
  torch::Tensor attn_norm, ffn_norm;
};

// A pruned LM head (FR pruning, Algorithm 3 of the RDK paper, after FR-Spec): the head's rows for some
// token ids, copied out contiguously so that a step streams only them. Immutable once made: caches on other
// threads may hold it while a newer one replaces it in another cache.
struct HeadRows {
  QLinear w;                 // [ids.size(), n_embd] the kept rows, repacked as the full head's
  std::vector<int64_t> ids;  // the token id of each kept row, ascending
};

}  // namespace

// The weights (shared by every cache) and the adapter in use.
struct Model {
  int64_t n_embd, n_head, n_kv, head_dim, n_ff, vocab;
  float eps, rope_base;
  std::vector<Layer> layers;
  QLinear embed, head;
  torch::Tensor out_norm;
  std::vector<float> inv_freq;

  Model(int64_t n_embd_, int64_t n_head_, int64_t n_kv_, int64_t n_ff_, double eps_, double base)
      : n_embd(n_embd_), n_head(n_head_), n_kv(n_kv_), head_dim(n_embd_ / n_head_), n_ff(n_ff_), vocab(0),
        eps(static_cast<float>(eps_)), rope_base(static_cast<float>(base)) {
    TORCH_CHECK(n_head > 0 && n_kv > 0 && n_embd % n_head == 0 && n_head % n_kv == 0, "heads do not divide the width");
    TORCH_CHECK(head_dim % 8 == 0 && n_embd % QK == 0 && n_ff % QK == 0, "widths must be multiples of 32, heads of 8");
    for (int64_t i = 0; i < head_dim / 2; ++i)
      inv_freq.push_back(1.f / std::pow(rope_base, static_cast<float>(2 * i) / static_cast<float>(head_dim)));
  }

  // Rows laid out for the products (dot_rows_q41, dot_rows_q8): each row's block scales (float16) first, for
  // Q4_1 then its minimums, then the blocks' quantized values; the same bytes per row as the GGUF's blocks
  static torch::Tensor repack(const torch::Tensor& bytes, int type, int64_t out, int64_t in) {
    const int64_t nb = in / QK, block = type == Q4_1 ? 20 : 34, head = type == Q4_1 ? 4 : 2, row_bytes = nb * block;
    torch::Tensor r = torch::empty_like(bytes);
    const uint8_t* src = bytes.data_ptr<uint8_t>();
    uint8_t* dst = r.data_ptr<uint8_t>();
    for (int64_t o = 0; o < out; ++o) {
      const uint8_t* s = src + o * row_bytes;
      uint8_t* d = dst + o * row_bytes;
      for (int64_t b = 0; b < nb; ++b) {
        std::memcpy(d + b * 2, s + b * block, 2);                                     // scale
        if (type == Q4_1) std::memcpy(d + nb * 2 + b * 2, s + b * block + 2, 2);      // minimum
        std::memcpy(d + nb * head + b * (block - head), s + b * block + head, block - head);  // values
      }
    }
    return r;
  }

  static QLinear linear(torch::Tensor bytes, int64_t type, int64_t out, int64_t in, bool for_products = true) {
    TORCH_CHECK(type == Q4_1 || type == Q8_0, "weights must be Q4_1 or Q8_0, not ggml type ", type);
    TORCH_CHECK(in % QK == 0, "a row must be whole blocks of 32");
    const int64_t row_bytes = in / QK * (type == Q4_1 ? 20 : 34);
    TORCH_CHECK(bytes.dtype() == torch::kUInt8 && bytes.is_contiguous() && bytes.numel() == out * row_bytes,
                "weight bytes do not match their shape");
    if (for_products) TORCH_CHECK(in / QK <= MAX_BLOCKS, "rows longer than ", MAX_BLOCKS * QK, " are not supported");
    QLinear q;
    q.bytes = for_products ? repack(bytes, static_cast<int>(type), out, in) : bytes;
    q.base = q.bytes.data_ptr<uint8_t>();
    q.type = static_cast<int>(type); q.out = out; q.in = in; q.row_bytes = row_bytes;
    return q;
  }

  void add_layer(std::vector<torch::Tensor> bytes, std::vector<int64_t> types, torch::Tensor attn_norm,
                 torch::Tensor ffn_norm) {
    TORCH_CHECK(bytes.size() == N_SLOTS && types.size() == N_SLOTS, "a layer has 7 Linear weights");
    const int64_t kv = n_kv * head_dim;
    const int64_t shapes[N_SLOTS][2] = {{n_embd, n_embd}, {kv, n_embd}, {kv, n_embd}, {n_embd, n_embd},
                                        {n_ff, n_embd}, {n_ff, n_embd}, {n_embd, n_ff}};
    Layer l;
    for (int s = 0; s < N_SLOTS; ++s) l.w[s] = linear(bytes[s], types[s], shapes[s][0], shapes[s][1]);
    l.attn_norm = attn_norm.contiguous().to(torch::kFloat32);
    l.ffn_norm = ffn_norm.contiguous().to(torch::kFloat32);
    layers.push_back(l);
  }

  void set_output(torch::Tensor embed_bytes, int64_t embed_type, torch::Tensor head_bytes, int64_t head_type,
                  int64_t vocab_, torch::Tensor norm) {
    vocab = vocab_;
    embed = linear(embed_bytes, embed_type, vocab, n_embd, false);  // rows read whole: the GGUF's layout
    head = linear(head_bytes, head_type, vocab, n_embd);
    out_norm = norm.contiguous().to(torch::kFloat32);
  }

  // The head's rows for `ids` (ascending, distinct, in range), copied from the repacked head
  std::shared_ptr<const HeadRows> head_rows(torch::Tensor ids) const {
    TORCH_CHECK(head.base != nullptr, "the model has no head yet");
    ids = ids.to(torch::kInt64).contiguous();
    TORCH_CHECK(ids.dim() == 1 && ids.numel() > 0, "head rows must be a non-empty 1-D tensor");
    const int64_t n = ids.numel(), *id = ids.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i)
      TORCH_CHECK(id[i] >= 0 && id[i] < vocab && (i == 0 || id[i] > id[i - 1]), "head rows must be ascending ids in the vocabulary");
    auto rows = std::make_shared<HeadRows>();
    rows->ids.assign(id, id + n);
    rows->w = head;
    rows->w.bytes = torch::empty({n * head.row_bytes}, torch::kUInt8);
    uint8_t* out = rows->w.bytes.data_ptr<uint8_t>();
    rows->w.base = out;
    rows->w.out = n;
    for (int64_t i = 0; i < n; ++i) std::memcpy(out + i * head.row_bytes, head.row(id[i]), head.row_bytes);
    return rows;
  }

};

// One session's KV cache and adapter over a Model; `forward` appends rows at position `pos`.
struct Cache {
  std::shared_ptr<Model> model;
  std::vector<std::vector<Lora>> lora;  // [layer][slot], undefined tensors where none
  std::vector<std::vector<Lora>> stash;  // another adapter set aside (`swap_lora`): a switch back is a swap
  std::vector<std::vector<uint16_t>> k;  // float16 [layer][position / 8][kv head][dim][position % 8]: 8 positions' keys
                                         // transposed in one contiguous 2 KB tile (scores of 8 positions per pass)
  std::vector<std::vector<uint16_t>> v;  // float16 [layer][position * kv_dim]
  torch::Tensor hidden;                  // [n_embd] the final normed state of the last row
  std::shared_ptr<const HeadRows> head_rows;  // a pruned head (`set_head`): logits for its ids only, -inf elsewhere
  int64_t capacity = 0;

  explicit Cache(std::shared_ptr<Model> m)
      : model(std::move(m)), lora(model->layers.size(), std::vector<Lora>(N_SLOTS)), k(model->layers.size()),
        v(model->layers.size()) {
    hidden = torch::zeros({model->n_embd});
  }

  void set_lora(int64_t layer, int64_t slot, torch::Tensor a, torch::Tensor b, double scale) {
    TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(lora.size()) && slot >= 0 && slot < N_SLOTS, "no such Linear");
    const QLinear& w = model->layers[layer].w[slot];
    TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == w.in && b.size(0) == w.out && a.size(0) == b.size(1),
                "LoRA shapes do not fit the Linear");
    TORCH_CHECK(a.dtype() == torch::kFloat32 && b.dtype() == torch::kFloat32 && a.is_contiguous() && b.is_contiguous(),
                "LoRA tensors must be contiguous float32");
    lora[layer][slot] = Lora{a.to(torch::kHalf).contiguous(), b.t().to(torch::kHalf).contiguous(), static_cast<float>(scale)};
  }

  void clear_lora() {
    for (auto& l : lora) for (auto& s : l) s = Lora{};
  }

  // The live adapter and the stashed one trade places, without a copy: a policy that alternates the
  // adapter and the base weights draft by draft pays no conversion per switch.
  void swap_lora() {
    if (stash.size() != lora.size()) stash.assign(lora.size(), std::vector<Lora>(N_SLOTS));
    std::swap(lora, stash);
  }

  void clear_stash() { stash.clear(); }

  // Take logits on a pruned head's rows only (nullptr: the whole head)
  void set_head(std::shared_ptr<const HeadRows> rows) {
    TORCH_CHECK(!rows || rows->w.in == model->n_embd, "head rows of another model");
    head_rows = std::move(rows);
  }

  void reserve(int64_t positions) {
    if (positions <= capacity) return;
    const int64_t cap = (std::max(positions, 2 * capacity) + 7) / 8 * 8, kv = model->n_kv * model->head_dim;
    for (size_t l = 0; l < k.size(); ++l) { k[l].resize(cap * kv); v[l].resize(cap * kv); }
    capacity = cap;
  }

  // Forget positions [from, from + n) of the `length` held: the later ones move down by n, their keys
  // turned back by n positions' rotary angle (a rotation composes: R(p - n) = R(-n) R(p)), as llama.cpp's
  // context shift does. Their keys and values were computed with the dropped positions in view: kept,
  // they are an approximation the verifier makes harmless (StreamingLLM keeps the first few as sinks).
  void drop(int64_t from, int64_t n, int64_t length) {
    const Model& M = *model;
    TORCH_CHECK(from >= 0 && n >= 0 && from + n <= length && length <= capacity, "positions to drop out of range");
    if (n == 0) return;
    const int64_t D = M.head_dim, KV = M.n_kv * D;
    std::vector<float> c(D / 2), s(D / 2);
    for (int64_t i = 0; i < D / 2; ++i) {
      const float a = -static_cast<float>(n) * M.inv_freq[i];
      c[i] = std::cos(a); s[i] = std::sin(a);
    }
    for (size_t li = 0; li < k.size(); ++li) {
      uint16_t* key = k[li].data();
      for (int64_t p = from + n; p < length; ++p) {
        const int64_t to = p - n;
        for (int64_t h = 0; h < M.n_kv; ++h)
          for (int64_t i = 0; i < D / 2; ++i) {
            const int64_t e0 = h * D + 2 * i, e1 = e0 + 1;
            const float x0 = _cvtsh_ss(key[((p / 8) * KV + e0) * 8 + p % 8]), x1 = _cvtsh_ss(key[((p / 8) * KV + e1) * 8 + p % 8]);
            key[((to / 8) * KV + e0) * 8 + to % 8] = to_half(x0 * c[i] - x1 * s[i]);
            key[((to / 8) * KV + e1) * 8 + to % 8] = to_half(x0 * s[i] + x1 * c[i]);
          }
      }
      std::copy(v[li].begin() + (from + n) * KV, v[li].begin() + length * KV, v[li].begin() + from * KV);
    }
  }

  // tokens [rows] at positions pos..pos+rows-1 -> logits [vocab] of the last row
  torch::Tensor forward(torch::Tensor tokens, int64_t pos, int64_t n_threads) {
    const Model& M = *model;
    TORCH_CHECK(tokens.dim() == 1 && tokens.numel() > 0, "tokens must be a non-empty 1-D tensor");
    tokens = tokens.to(torch::kInt64).contiguous();
    const int64_t rows = tokens.numel(), E = M.n_embd, H = M.n_head, D = M.head_dim, KV = M.n_kv * D, F = M.n_ff;
    const int64_t* tok = tokens.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r) TORCH_CHECK(tok[r] >= 0 && tok[r] < M.vocab, "token id out of range");
    TORCH_CHECK(pos >= 0, "negative position");
    reserve(pos + rows);

    std::vector<float> x(rows * E), xn(rows * E), q(rows * E), kv_k(rows * KV), kv_v(rows * KV), att(rows * E),
        o(rows * E), g(rows * F), u(rows * F), down(rows * E), t(rows * 64 * N_SLOTS);
    const std::shared_ptr<const HeadRows> head = head_rows;  // held for the forward: set_head may replace it
    std::vector<float> logits(head ? 0 : M.vocab), kept(head ? head->ids.size() : 0);
    const int teams = static_cast<int>(std::max<int64_t>(n_threads, 1));
    // attention work items (row, chunk, KV head) and their partials [row][head][chunk][P]: the same in every layer
    const int64_t group = H / M.n_kv, P = (D + 2 + 7) / 8 * 8, chunks = (pos + rows + ATT_CHUNK - 1) / ATT_CHUNK;
    struct Item { int64_t r, c, kvh; };
    std::vector<Item> items;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c * ATT_CHUNK < pos + r + 1; ++c)
        for (int64_t kvh = 0; kvh < M.n_kv; ++kvh) items.push_back({r, c, kvh});
    std::vector<float> parts(rows * H * chunks * P);
    QRows qe, qf;
    qe.resize(rows, E); qf.resize(rows, F);
    int64_t max_rank = 0;
    for (auto& l : lora) for (auto& s : l) if (s.a.defined()) max_rank = std::max<int64_t>(max_rank, s.a.size(0));
    t.assign(rows * std::max<int64_t>(max_rank, 1) * N_SLOTS, 0.f);
    const int64_t ts = rows * std::max<int64_t>(max_rank, 1);  // one slot's LoRA scratch
    float* hidden_out = hidden.data_ptr<float>();
    const int64_t long_from = long_rows;  // the settings once per forward: the scratch below is sized by them
    const bool long_products = long_from > 0 && rows >= long_from;  // some products in float32: see long_read
    std::vector<float> gemm_scratch(long_products ? teams * OUT_TILE * std::max(E, F) : 0);
    const bool amx_long = long_products && amx_on && rows >= AMX_MIN_ROWS;
    std::vector<uint32_t> amx_pack(amx_long ? (rows + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS * std::max(E, F) : 0);
    std::vector<uint16_t> amx_split(amx_long ? teams * 2 * OUT_TILE * std::max(E, F) : 0);
    std::vector<float> rot_cos(rows * D / 2), rot_sin(rows * D / 2);  // the same angles in every layer
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < D / 2; ++i) {
        const float a = static_cast<float>(pos + r) * M.inv_freq[i];
        rot_cos[r * D / 2 + i] = std::cos(a); rot_sin[r * D / 2 + i] = std::sin(a);
      }

    // embeddings (Q8_0 / Q4_1 rows dequantized)
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* p = M.embed.row(tok[r]);
      for (int64_t b = 0; b < E / QK; ++b) {
        if (M.embed.type == Q8_0) {
          const uint8_t* blk = p + b * 34; const float d = half(blk);
          for (int j = 0; j < QK; ++j) x[r * E + b * QK + j] = d * static_cast<int8_t>(blk[2 + j]);
        } else {
          const uint8_t* blk = p + b * 20; const float d = half(blk), mn = half(blk + 2);
          for (int j = 0; j < 16; ++j) {
            x[r * E + b * QK + j] = d * (blk[4 + j] & 0x0F) + mn;
            x[r * E + b * QK + 16 + j] = d * (blk[4 + j] >> 4) + mn;
          }
        }
      }
    }

    // run base products and LoRA-A of `slots` on `in` (quantized qin, float fin), then LoRA-B; outputs `outs`
    auto linears = [&](const Layer& L, const std::vector<Lora>& lo, std::initializer_list<int> slots,
                       std::initializer_list<float*> outs, const QRows& qin, const float* fin) {
      auto out = outs.begin();
      bool any = false, tiles = amx_long;  // the slots share their input: packed once for the tiles
      for (int s : slots) tiles = tiles && long_read(L.w[s], rows, long_from);
      if (tiles) amx_pack_for(fin, rows, L.w[*slots.begin()].in, amx_pack.data());
      for (int s : slots) {
        if (tiles) amx_gemm_for(L.w[s], amx_pack.data(), rows, *out++, gemm_scratch.data(), amx_split.data());
        else if (long_read(L.w[s], rows, long_from)) gemm_for(L.w[s], fin, rows, *out++, gemm_scratch.data());
        else linear_for(L.w[s], qin, *out++);
        if (lo[s].a.defined()) { lora_a_for(lo[s], fin, rows, L.w[s].in, t.data() + s * ts); any = true; }
      }
#pragma omp barrier
      if (!any) return;
      out = outs.begin();
      for (int s : slots) {
        float* y = *out++;
        if (lo[s].a.defined()) lora_b_for(lo[s], t.data() + s * ts, rows, y);
      }
#pragma omp barrier
    };

#pragma omp parallel num_threads(teams)
    {
      for (size_t li = 0; li < M.layers.size(); ++li) {
        const Layer& L = M.layers[li];
        const std::vector<Lora>& lo = lora[li];
#pragma omp single
        {
          for (int64_t r = 0; r < rows; ++r) rms_norm(&x[r * E], L.attn_norm.data_ptr<float>(), &xn[r * E], E, M.eps);
        }
        qe.set_for(xn.data());
        linears(L, lo, {WQ, WK, WV}, {q.data(), kv_k.data(), kv_v.data()}, qe, xn.data());
#pragma omp single
        {  // rotary on adjacent pairs (GGML's normal mode), then the new rows join the cache
          for (int64_t r = 0; r < rows; ++r) {
            for (int64_t h = 0; h < H + M.n_kv; ++h) {
              float* v = h < H ? &q[r * E + h * D] : &kv_k[r * KV + (h - H) * D];
              for (int64_t i = 0; i < D / 2; ++i) {
                const float c = rot_cos[r * D / 2 + i], s = rot_sin[r * D / 2 + i];
                const float x0 = v[2 * i], x1 = v[2 * i + 1];
                v[2 * i] = x0 * c - x1 * s;
                v[2 * i + 1] = x0 * s + x1 * c;
              }
            }
            const int64_t p8 = pos + r;
            for (int64_t i = 0; i < KV; ++i) {
              k[li][((p8 / 8) * KV + i) * 8 + p8 % 8] = to_half(kv_k[r * KV + i]);
              v[li][(pos + r) * KV + i] = to_half(kv_v[r * KV + i]);
            }
          }
        }
        const float scale = 1.f / std::sqrt(static_cast<float>(D));
#pragma omp for schedule(static)
        for (size_t it = 0; it < items.size(); ++it) {
          const Item& w = items[it];
          const int64_t h0 = w.kvh * group, j0 = w.c * ATT_CHUNK, j1 = std::min(j0 + ATT_CHUNK, pos + w.r + 1);
          attend_group(group, &q[w.r * E + h0 * D], D, &k[li][w.kvh * D * 8], KV * 8, &v[li][w.kvh * D], KV, D, j0, j1,
                       scale, &parts[((w.r * H + h0) * chunks + w.c) * P], chunks * P);
        }
#pragma omp for schedule(static)
        for (int64_t rh = 0; rh < rows * H; ++rh) {
          const int64_t r = rh / H;
          attend_merge(&parts[rh * chunks * P], (pos + r + ATT_CHUNK) / ATT_CHUNK, P, D, &att[rh * D]);
        }
        qe.set_for(att.data());
        linears(L, lo, {WO}, {o.data()}, qe, att.data());
#pragma omp single
        {
          for (int64_t i = 0; i < rows * E; ++i) x[i] += o[i];
          for (int64_t r = 0; r < rows; ++r) rms_norm(&x[r * E], L.ffn_norm.data_ptr<float>(), &xn[r * E], E, M.eps);
        }
        qe.set_for(xn.data());
        linears(L, lo, {WGATE, WUP}, {g.data(), u.data()}, qe, xn.data());
        silu_mul_set_for(g.data(), u.data(), qf);
        linears(L, lo, {WDOWN}, {down.data()}, qf, g.data());
#pragma omp single
        for (int64_t i = 0; i < rows * E; ++i) x[i] += down[i];
      }
#pragma omp single
      {
        rms_norm(&x[(rows - 1) * E], M.out_norm.data_ptr<float>(), hidden_out, E, M.eps);
        qe.resize(1, E);
      }
      qe.set_for(hidden_out);
      linear_for(head ? head->w : M.head, qe, head ? kept.data() : logits.data());
    }
    if (!head) return torch::from_blob(logits.data(), {M.vocab}, torch::kFloat32).clone();
    torch::Tensor out = torch::full({M.vocab}, -std::numeric_limits<float>::infinity(), torch::kFloat32);
    float* all = out.data_ptr<float>();
    for (size_t i = 0; i < head->ids.size(); ++i) all[head->ids[i]] = kept[i];
    return out;
  }
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<Model, std::shared_ptr<Model>>(m, "Model")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, double, double>())
      .def("add_layer", &Model::add_layer)
      .def("set_output", &Model::set_output)
      .def("head_rows", &Model::head_rows, "a pruned head: the head's rows for these ascending token ids");
  pybind11::class_<HeadRows, std::shared_ptr<HeadRows>>(m, "HeadRows")
      .def_property_readonly("size", [](const HeadRows& h) { return static_cast<int64_t>(h.ids.size()); });
  pybind11::class_<Cache>(m, "Cache")
      .def(pybind11::init<std::shared_ptr<Model>>())
      .def("forward", &Cache::forward, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("set_lora", &Cache::set_lora)
      .def("clear_lora", &Cache::clear_lora)
      .def("swap_lora", &Cache::swap_lora)
      .def("clear_stash", &Cache::clear_stash)
      .def("set_head", &Cache::set_head, pybind11::arg("rows").none(true))
      .def("drop", &Cache::drop)
      .def_readonly("hidden", &Cache::hidden);
  m.def("use_vnni", [](bool on) {
    vnni_on = on && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
    return vnni_on;
  }, "the products on AVX512-VNNI where the CPU has it (the same bits either way); returns whether they are");
  m.def("use_amx", [](bool on) {
    static const bool usable = amx_usable();
    amx_on = on && usable;
    return amx_on;
  }, "a long read's products on AMX tiles where the CPU has them; returns whether they are");
  m.attr("long_read_default") = LONG_ROWS;
  m.def("long_reads", []() { return std::make_pair(long_rows, amx_on); },
        "(rows from which reads take the float32 products, whether those of 32+ rows take AMX tiles)");
  m.def("long_read_rows", [](int64_t rows) {
    TORCH_CHECK(rows >= 0, "rows must be >= 0");
    const int64_t before = long_rows;
    long_rows = rows;
    return before;
  }, "reads of at least this many rows take their products in float32 (0: never); returns the earlier value");
}
