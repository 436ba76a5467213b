// A Linear layer's product for a few input rows in one pass over the weights (AVX2 + FMA, fp32).
//
// Tiles of J weight rows by M <= 4 input rows keep their partial sums in registers, and a weight
// row stays in L1 while every block of input rows passes over it. Every output element is
// accumulated in two registers (alternate 8-float chunks: two FMA chains per element hide the FMA
// latency), then summed in a fixed order with a scalar tail. That order is the same for every
// element whatever the number of rows, the tile and the layout: a row's result is bit-identical to
// its one-row product, so a verify of k proposals computes exactly what k plain steps would.
// See omnidraft/kernels/__init__.py for why it exists and how it is built.
#include "skinny_common.h"

// weight rows j .. j+J-1 against input rows x[0 .. M-1]; y points at output row 0, column j
template <int M, int J>
struct Tile {
static inline void run(const float* x, const float* w, float* y, int64_t n_in, int64_t n_out) {
  __m256 a0[J][M], a1[J][M];
  _Pragma("GCC unroll 4") for (int a = 0; a < J; ++a)
    _Pragma("GCC unroll 4") for (int m = 0; m < M; ++m) { a0[a][m] = _mm256_setzero_ps(); a1[a][m] = _mm256_setzero_ps(); }
  int64_t i = 0;
  for (; i + 16 <= n_in; i += 16) {
    _Pragma("GCC unroll 4") for (int a = 0; a < J; ++a) {
      prefetch_next_tile<J>(w, a, n_in, i);
      const __m256 w0 = _mm256_loadu_ps(w + a * n_in + i), w1 = _mm256_loadu_ps(w + a * n_in + i + 8);
      _Pragma("GCC unroll 4") for (int m = 0; m < M; ++m) {
        a0[a][m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * n_in + i), a0[a][m]);
        a1[a][m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + m * n_in + i + 8), a1[a][m]);
      }
    }
  }
  if (i + 8 <= n_in) {
    _Pragma("GCC unroll 4") for (int a = 0; a < J; ++a) {
      const __m256 w0 = _mm256_loadu_ps(w + a * n_in + i);
      _Pragma("GCC unroll 4") for (int m = 0; m < M; ++m)
        a0[a][m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * n_in + i), a0[a][m]);
    }
    i += 8;
  }
  _Pragma("GCC unroll 4") for (int a = 0; a < J; ++a) {
    const float* wr = w + a * n_in;
    _Pragma("GCC unroll 4") for (int m = 0; m < M; ++m) {
      y[m * n_out + a] = finish(a0[a][m], a1[a][m], wr, x + m * n_in, i, n_in);
    }
  }
}
};

// tiled: several weight rows per tile (fewer input loads; 2 * J * M <= 8 accumulators), else one
static void dispatch(bool tiled, int64_t m, const float* x, const float* w, float* y, int64_t n_in, int64_t j0,
                     int64_t j1, int64_t n_out) {
  switch (m) {
    case 1: tiled ? span<Tile, 1, 4>(x, w, y, n_in, j0, j1, n_out) : span<Tile, 1, 1>(x, w, y, n_in, j0, j1, n_out); break;
    case 2: tiled ? span<Tile, 2, 2>(x, w, y, n_in, j0, j1, n_out) : span<Tile, 2, 1>(x, w, y, n_in, j0, j1, n_out); break;
    case 3: span<Tile, 3, 1>(x, w, y, n_in, j0, j1, n_out); break;
    default: span<Tile, 4, 1>(x, w, y, n_in, j0, j1, n_out); break;
  }
}

// x: [rows, in], w: [out, in] -> [rows, out]; tiled: the layout. Chunks of 8 weight rows stay in L1/L2.
torch::Tensor linear_rows(torch::Tensor x, torch::Tensor w, bool tiled) {
  return rows_product<4>(x, w, 8, [tiled](int64_t m, const float* xp, const float* wp, float* yp, int64_t n_in,
                                       int64_t c0, int64_t c1, int64_t n_out) {
    dispatch(tiled, m, xp, wp, yp, n_in, c0, c1, n_out);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("linear_rows", &linear_rows, "one-pass skinny fp32 linear"); }
