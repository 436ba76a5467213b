// What skinny.cpp and skinny512.cpp share: the fixed order of a final 8-lane sum, and the loop that
// checks the operands and hands each thread its weight rows (both builds compute the same bits).
#pragma once
#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>

static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// While a tile multiplies its J weight rows, ask for the next tile's rows (the same offset J rows on,
// into L2). With several input rows a tile spends long enough on its FMAs that the hardware
// prefetcher alone let the memory stream stall: a product cost the weight read plus the arithmetic,
// where it can cost the larger of the two. One request per 64-byte line (each caller moves 16 floats
// per step); a request past the weights' end is a hint that never faults. It changes no arithmetic.
template <int J>
static inline void prefetch_next_tile(const float* w, int64_t a, int64_t n_in, int64_t i) {
  _mm_prefetch(reinterpret_cast<const char*>(w + (a + J) * n_in + i), _MM_HINT_T1);
}

// One output from its two 8-lane accumulators (inputs 0-7 and 8-15 of every 16) and the scalar tail
// of inputs [i, n_in): the order every build sums in, so a row's result has the same bits in each.
static inline float finish(__m256 lo, __m256 hi, const float* wr, const float* xr, int64_t i, int64_t n_in) {
  float r = hsum8(_mm256_add_ps(lo, hi));
  for (int64_t t = i; t < n_in; ++t) r = std::fma(wr[t], xr[t], r);  // fused in every build
  return r;
}

// Output columns [j0, j1) for M input rows: Tile<M, J>::run over J weight rows at a time, then one at
// a time.
template <template <int, int> class Tile, int M, int J>
static void span(const float* x, const float* w, float* y, int64_t n_in, int64_t j0, int64_t j1, int64_t n_out) {
  int64_t j = j0;
  for (; j + J <= j1; j += J) Tile<M, J>::run(x, w + j * n_in, y + j, n_in, n_out);
  for (; j < j1; ++j) Tile<M, 1>::run(x, w + j * n_in, y + j, n_in, n_out);
}

// x: [rows, in], w: [out, in], both contiguous float32 on the CPU -> [rows, out]. Each thread takes a
// range of weight rows, `chunk` at a time, over which every block of B input rows passes while they are
// in cache: the weights come from memory once. tiles(m, x, w, y, n_in, c0, c1, n_out) computes columns
// [c0, c1) for m <= B input rows.
template <int B, class Tiles>
torch::Tensor rows_product(torch::Tensor x, torch::Tensor w, int64_t chunk, Tiles tiles) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [rows, in] and w [out, in]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat, "float32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.device().is_cpu() && w.device().is_cpu(),
              "contiguous CPU tensors only");
  const int64_t rows = x.size(0), n_in = x.size(1), n_out = w.size(0);
  auto y = torch::empty({rows, n_out}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n_out, 16, [&](int64_t j0, int64_t j1) {
    for (int64_t c0 = j0; c0 < j1; c0 += chunk) {
      const int64_t c1 = std::min<int64_t>(j1, c0 + chunk);
      for (int64_t r0 = 0; r0 < rows; r0 += B)
        tiles(std::min<int64_t>(B, rows - r0), xp + r0 * n_in, wp, yp + r0 * n_out, n_in, c0, c1, n_out);
    }
  });
  return y;
}
