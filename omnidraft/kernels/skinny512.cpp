// skinny.cpp's one-pass Linear for a few rows, with AVX-512 registers (fp32), bit-identical to it.
//
// Why: on a CPU with AVX-512 there are 32 vector registers, so a tile can hold 4 weight rows by 4
// input rows (16 accumulators) where the AVX2 kernel holds one weight row by 4: each input load
// serves 4 weight rows; and up to 8 input rows pass over the weights at once (AVX2: 4), so a verify
// of up to 7 proposals reads the weights once. With the next tile requested ahead
// (prefetch_next_tile), a product of 1.5B-sized weights for 8 rows costs ~1.04x one row's on two
// cores of an AMD EPYC (docs/performance.md). fastlinear times both builds and keeps the faster per shape.
//
// Same bits: skinny.cpp accumulates each output in two 8-lane registers (the first and second 8 of
// every 16 inputs), adds them, sums the 8 lanes in a fixed order and adds a scalar tail. A 16-lane
// register holds exactly those two accumulators (lanes 0-7 and 8-15; an 8-input remainder goes to
// lanes 0-7 only), and the end takes the same steps, so every output has the same bits as there.
#include "skinny_common.h"

// A tile multiplies weight rows j .. j+J-1 by input rows x[0 .. M-1] (y points at output row 0, column
// j). What every tile ends with, after its steps of 16 inputs (up to input i): 8 more inputs in the
// first accumulator's lanes, then each output's sum in the order every build takes.
template <int M, int J>
static inline __attribute__((always_inline)) void finish_tile(__m512 (&acc)[J][M], const float* x, const float* w,
                                                               float* y, int64_t i, int64_t n_in, int64_t n_out) {
  if (i + 8 <= n_in) {
    _Pragma("GCC unroll 16") for (int a = 0; a < J; ++a) {
      const __m512 wv = _mm512_maskz_loadu_ps(0x00FF, w + a * n_in + i);
      _Pragma("GCC unroll 16") for (int m = 0; m < M; ++m)
        acc[a][m] = _mm512_mask3_fmadd_ps(wv, _mm512_maskz_loadu_ps(0x00FF, x + m * n_in + i), acc[a][m], 0x00FF);
    }
    i += 8;
  }
  _Pragma("GCC unroll 16") for (int a = 0; a < J; ++a) {
    const float* wr = w + a * n_in;
    _Pragma("GCC unroll 16") for (int m = 0; m < M; ++m) {
      const __m256 lo = _mm512_castps512_ps256(acc[a][m]);
      const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[a][m]), 1));
      y[m * n_out + a] = finish(lo, hi, wr, x + m * n_in, i, n_in);
    }
  }
}

// up to 8 input rows: each step loads them all, then streams the J weight rows past them
template <int M, int J>
struct Tile {
static inline void run(const float* x, const float* w, float* y, int64_t n_in, int64_t n_out) {
  __m512 acc[J][M];
  _Pragma("GCC unroll 8") for (int a = 0; a < J; ++a)
    _Pragma("GCC unroll 8") for (int m = 0; m < M; ++m) acc[a][m] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n_in; i += 16) {
    __m512 xv[M];
    _Pragma("GCC unroll 8") for (int m = 0; m < M; ++m) xv[m] = _mm512_loadu_ps(x + m * n_in + i);
    _Pragma("GCC unroll 8") for (int a = 0; a < J; ++a) {
      prefetch_next_tile<J>(w, a, n_in, i);
      const __m512 wv = _mm512_loadu_ps(w + a * n_in + i);
      _Pragma("GCC unroll 8") for (int m = 0; m < M; ++m) acc[a][m] = _mm512_fmadd_ps(wv, xv[m], acc[a][m]);
    }
  }
  finish_tile<M, J>(acc, x, w, y, i, n_in, n_out);
}
};

// More than 8 input rows: J * M accumulators leave no room for every input row's register beside
// them, so each input vector is loaded once per step and serves the J weight rows before the next is
// loaded (J * M + J + 1 <= 32 registers). A verify of up to 15 proposals, or 16 sessions' rows,
// then reads the weights once instead of twice. Each output's FMAs run in the same order as in Tile,
// so its bits do not change.
template <int M, int J>
struct WideTile {
static inline void run(const float* x, const float* w, float* y, int64_t n_in, int64_t n_out) {
  __m512 acc[J][M];
  _Pragma("GCC unroll 16") for (int a = 0; a < J; ++a)
    _Pragma("GCC unroll 16") for (int m = 0; m < M; ++m) acc[a][m] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n_in; i += 16) {
    __m512 wv[J];
    _Pragma("GCC unroll 16") for (int a = 0; a < J; ++a) {
      prefetch_next_tile<J>(w, a, n_in, i);
      wv[a] = _mm512_loadu_ps(w + a * n_in + i);
    }
    _Pragma("GCC unroll 16") for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * n_in + i);
      _Pragma("GCC unroll 16") for (int a = 0; a < J; ++a) acc[a][m] = _mm512_fmadd_ps(wv[a], xv, acc[a][m]);
    }
  }
  finish_tile<M, J>(acc, x, w, y, i, n_in, n_out);
}
};

// Up to 8 rows: J * M <= 16 accumulators, so inputs and a weight vector fit beside them in 32
// registers. 9 to 14 rows: WideTile. 15 or 16: two passes over each chunk of weight rows (the second
// finds them in L2), as 9 to 16 rows all took before WideTile.
static void dispatch(int64_t m, const float* x, const float* w, float* y, int64_t n_in, int64_t j0, int64_t j1,
                     int64_t n_out) {
  switch (m) {
    case 1: span<Tile, 1, 8>(x, w, y, n_in, j0, j1, n_out); break;
    case 2: span<Tile, 2, 8>(x, w, y, n_in, j0, j1, n_out); break;
    case 3: span<Tile, 3, 4>(x, w, y, n_in, j0, j1, n_out); break;
    case 4: span<Tile, 4, 4>(x, w, y, n_in, j0, j1, n_out); break;
    case 5: span<Tile, 5, 3>(x, w, y, n_in, j0, j1, n_out); break;
    case 6: span<Tile, 6, 2>(x, w, y, n_in, j0, j1, n_out); break;
    case 7: span<Tile, 7, 2>(x, w, y, n_in, j0, j1, n_out); break;
    case 8: span<Tile, 8, 2>(x, w, y, n_in, j0, j1, n_out); break;
    case 9: span<WideTile, 9, 3>(x, w, y, n_in, j0, j1, n_out); break;
    case 10: span<WideTile, 10, 2>(x, w, y, n_in, j0, j1, n_out); break;
    case 11: span<WideTile, 11, 2>(x, w, y, n_in, j0, j1, n_out); break;
    case 12: span<WideTile, 12, 2>(x, w, y, n_in, j0, j1, n_out); break;
    case 13: span<WideTile, 13, 2>(x, w, y, n_in, j0, j1, n_out); break;
    case 14: span<WideTile, 14, 2>(x, w, y, n_in, j0, j1, n_out); break;
    default:  // 15 or 16: a tile of one weight row is load-bound; two passes, the second from L2
      span<Tile, 8, 2>(x, w, y, n_in, j0, j1, n_out);
      dispatch(m - 8, x + 8 * n_in, w, y + 8 * n_out, n_in, j0, j1, n_out);
  }
}

#ifndef ROWS_PER_PASS
#define ROWS_PER_PASS 16
#endif

// x: [rows, in], w: [out, in] -> [rows, out]; 32 weight rows at a time pass under each block of inputs
torch::Tensor linear_rows(torch::Tensor x, torch::Tensor w) { return rows_product<ROWS_PER_PASS>(x, w, 32, dispatch); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("linear_rows", &linear_rows, "one-pass skinny fp32 linear, AVX-512"); }
