// A long read's products on AMX tiles (Sapphire Rapids and later), included by qdraft.cpp inside an
// AMX + AVX-512 target region. The same product as qdraft_gemm.h, y [rows, out] = x W^T on W dequantized a tile
// of OUT_TILE rows at a time, but with each float32 operand split into two bfloat16 (v = hi + lo, hi the nearest
// bfloat16 to v, lo the nearest to the rest) and three tile products summed in float32:
//   x w ~ xh wh + xh wl + xl wh
// (the dropped xl wl is ~2^-16 of the product), so the result follows float32 closely, where one bfloat16
// product would round every weight and activation to 8 bits of mantissa. A tile product (TDPBF16PS) takes
// 16 x 16 x 32 multiply-adds; the float32 path needs 512 FMAs of 16 lanes for the same.
//
// Layout (Intel's AMX: C [M, N] += A [M, K] B [K/2, 2N], B holding pairs of consecutive K per column):
//   A: 16 weight rows of the tile, 32 K values each (bfloat16, row-major: the dequantized tile as it is)
//   B: 16 activation rows as columns: row k2 holds (x[r][2 k2], x[r][2 k2 + 1]) for r = 0..15, packed once per
//      product input by amx_pack_for (shared by the products that read it: q, k and v; gate and up)
//   C: [16 outputs, 16 rows] float32, written to y transposed.
// Tiles: 0, 1 the C of two blocks of 16 rows; 2, 3 A's hi and lo; 4, 5 and 6, 7 B's hi and lo of the two blocks.

constexpr int64_t AMX_ROWS = 16;  // activation rows per B tile
constexpr int64_t AMX_K = 32;     // K values per tile product

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void amx_configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) { cfg.colsb[t] = 64; cfg.rows[t] = 16; }
  _tile_loadconfig(&cfg);
}

// 16 floats -> their nearest bfloat16 (hi) and the nearest bfloat16 to what hi leaves (lo)
inline void split16(const float* v, uint16_t* hi, uint16_t* lo) {
  const __m512 x = _mm512_loadu_ps(v);
  const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
  const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi), h);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_sub_ps(x, hf))));
}

// x [rows, in] float32 -> B tiles: pack [2 (hi, lo)][blocks of 16 rows][in / 2][16] pairs of bfloat16 (as uint32),
// rows past `rows` zero. The team shares the rows (call inside a parallel region; ends at a barrier).
inline void amx_pack_for(const float* x, int64_t rows, int64_t in, uint32_t* pack) {
  const int64_t blocks = (rows + AMX_ROWS - 1) / AMX_ROWS, half = blocks * (in / 2) * AMX_ROWS;
#pragma omp for schedule(static)
  for (int64_t r = 0; r < blocks * AMX_ROWS; ++r) {
    alignas(64) uint16_t hi[MAX_BLOCKS * QK], lo[MAX_BLOCKS * QK];
    if (r < rows) {
      for (int64_t i = 0; i < in; i += 16) split16(x + r * in + i, hi + i, lo + i);
    } else {
      std::memset(hi, 0, in * sizeof(uint16_t)); std::memset(lo, 0, in * sizeof(uint16_t));
    }
    uint32_t* ph = pack + (r / AMX_ROWS) * (in / 2) * AMX_ROWS + r % AMX_ROWS;
    const uint32_t* h32 = reinterpret_cast<const uint32_t*>(hi);
    const uint32_t* l32 = reinterpret_cast<const uint32_t*>(lo);
    for (int64_t k2 = 0; k2 < in / 2; ++k2) { ph[k2 * AMX_ROWS] = h32[k2]; ph[half + k2 * AMX_ROWS] = l32[k2]; }
  }
}

// C tile(s) [16 outputs, 16 rows] -> y rows r0.. (only the first `valid` of the block's rows exist)
inline void amx_store(const float* c, int64_t r0, int64_t valid, int64_t o0, int64_t out, float* y) {
  for (int64_t o = 0; o < OUT_TILE; ++o)
    for (int64_t r = 0; r < valid; ++r) y[(r0 + r) * out + o0 + o] = c[o * AMX_ROWS + r];
}

// y [rows, out] = x W^T from `pack` (amx_pack_for of x), tiles of OUT_TILE weight rows shared among the team
// (inside a parallel region; no barrier at the end). `scratch` holds OUT_TILE * in floats per thread, `wsplit`
// 2 * OUT_TILE * in bfloat16 per thread.
inline void amx_gemm_for(const QLinear& w, const uint32_t* pack, int64_t rows, float* y, float* scratch, uint16_t* wsplit) {
  const int64_t in = w.in, tiles = w.out / OUT_TILE, blocks = (rows + AMX_ROWS - 1) / AMX_ROWS;
  const int64_t half = blocks * (in / 2) * AMX_ROWS, bstride = (in / 2) * AMX_ROWS;
  const int thread = omp_get_thread_num();
  float* wf = scratch + thread * OUT_TILE * in;
  uint16_t* wh = wsplit + thread * 2 * OUT_TILE * in;
  uint16_t* wl = wh + OUT_TILE * in;
  alignas(64) float c[2][OUT_TILE * AMX_ROWS];
  amx_configure();
#pragma omp for schedule(static) nowait
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t o0 = t * OUT_TILE;
    for (int64_t o = 0; o < OUT_TILE; ++o) {
      dequantize_row(w, o0 + o, wf + o * in);
      for (int64_t i = 0; i < in; i += 16) split16(wf + o * in + i, wh + o * in + i, wl + o * in + i);
    }
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) {  // two blocks of 16 rows share each A tile
      _tile_zero(0); _tile_zero(1);
      const uint32_t* p0 = pack + b * bstride;
      const uint32_t* p1 = p0 + bstride;
      for (int64_t k = 0; k < in; k += AMX_K) {
        _tile_loadd(2, wh + k, in * 2); _tile_loadd(3, wl + k, in * 2);
        _tile_loadd(4, p0 + k / 2 * AMX_ROWS, 64); _tile_loadd(5, p0 + half + k / 2 * AMX_ROWS, 64);
        _tile_loadd(6, p1 + k / 2 * AMX_ROWS, 64); _tile_loadd(7, p1 + half + k / 2 * AMX_ROWS, 64);
        _tile_dpbf16ps(0, 2, 4); _tile_dpbf16ps(1, 2, 6); _tile_dpbf16ps(0, 2, 5);  // the two C tiles alternate
        _tile_dpbf16ps(1, 2, 7); _tile_dpbf16ps(0, 3, 4); _tile_dpbf16ps(1, 3, 6);
      }
      _tile_stored(0, c[0], 64); _tile_stored(1, c[1], 64);
      amx_store(c[0], b * AMX_ROWS, std::min<int64_t>(AMX_ROWS, rows - b * AMX_ROWS), o0, w.out, y);
      amx_store(c[1], (b + 1) * AMX_ROWS, std::min<int64_t>(AMX_ROWS, rows - (b + 1) * AMX_ROWS), o0, w.out, y);
    }
    if (b < blocks) {
      _tile_zero(0);
      const uint32_t* p0 = pack + b * bstride;
      for (int64_t k = 0; k < in; k += AMX_K) {
        _tile_loadd(2, wh + k, in * 2); _tile_loadd(3, wl + k, in * 2);
        _tile_loadd(4, p0 + k / 2 * AMX_ROWS, 64); _tile_loadd(5, p0 + half + k / 2 * AMX_ROWS, 64);
        _tile_dpbf16ps(0, 2, 4); _tile_dpbf16ps(0, 2, 5); _tile_dpbf16ps(0, 3, 4);
      }
      _tile_stored(0, c[0], 64);
      amx_store(c[0], b * AMX_ROWS, rows - b * AMX_ROWS, o0, w.out, y);
    }
  }
  _tile_release();
}
