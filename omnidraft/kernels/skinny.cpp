// A Linear layer's product for a few input rows in one pass over the weights (AVX2 + FMA, fp32).
//
// Tiles of a few weight rows by up to 4 input rows keep their partial sums in registers. Every
// output element is accumulated in its own register in the same order (8 lanes over the inputs, a
// fixed horizontal sum, a scalar tail) whatever the number of rows and whichever tile it falls in:
// a row's result is bit-identical to its one-row product, so a verify of k proposals computes
// exactly what k plain steps would.
// See omnidraft/kernels/__init__.py for why it exists and how it is built.
#include <torch/extension.h>
#include <immintrin.h>

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// J weight rows x M input rows: J * M accumulators in registers, each input chunk loaded once for
// the J weight rows and each weight chunk once for the M input rows.
template <int M, int J>
static inline void tile(const float* x, const float* w, float* y, int64_t n_in, int64_t j, int64_t n_out) {
  __m256 acc[J][M];
  _Pragma("GCC unroll 4") for (int a = 0; a < J; ++a)
    _Pragma("GCC unroll 4") for (int m = 0; m < M; ++m) acc[a][m] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n_in; i += 8) {
    __m256 xv[M];
    _Pragma("GCC unroll 4") for (int m = 0; m < M; ++m) xv[m] = _mm256_loadu_ps(x + m * n_in + i);
    _Pragma("GCC unroll 4") for (int a = 0; a < J; ++a) {
      const __m256 wv = _mm256_loadu_ps(w + (j + a) * n_in + i);
      _Pragma("GCC unroll 4") for (int m = 0; m < M; ++m) acc[a][m] = _mm256_fmadd_ps(wv, xv[m], acc[a][m]);
    }
  }
  for (int a = 0; a < J; ++a) {
    const float* wr = w + (j + a) * n_in;
    for (int m = 0; m < M; ++m) {
      float r = hsum(acc[a][m]);
      for (int64_t t = i; t < n_in; ++t) r += wr[t] * x[m * n_in + t];
      y[m * n_out + j + a] = r;
    }
  }
}

// Output rows [j0, j1) for M <= 4 input rows: tiles of J weight rows, then single rows.
template <int M>
static void block(const float* x, const float* w, float* y, int64_t n_in, int64_t j0, int64_t j1, int64_t n_out) {
  constexpr int J = M <= 2 ? 4 : 2;  // J * M + M + 1 registers of 16
  int64_t j = j0;
  for (; j + J <= j1; j += J) tile<M, J>(x, w, y, n_in, j, n_out);
  for (; j < j1; ++j) tile<M, 1>(x, w, y, n_in, j, n_out);
}

// One weight row at a time against up to 8 input rows: a single sequential stream of weights,
// which is what some shapes' memory traffic likes best (fastlinear times both layouts).
template <int M>
static void rowwise(const float* x, const float* w, float* y, int64_t n_in, int64_t j0, int64_t j1, int64_t n_out) {
  for (int64_t j = j0; j < j1; ++j) tile<M, 1>(x, w, y, n_in, j, n_out);
}

static void dispatch(bool tiled, int64_t m, const float* x, const float* w, float* y, int64_t n_in, int64_t j0,
                     int64_t j1, int64_t n_out) {
  if (tiled) {
    switch (m) {
      case 1: block<1>(x, w, y, n_in, j0, j1, n_out); break;
      case 2: block<2>(x, w, y, n_in, j0, j1, n_out); break;
      case 3: block<3>(x, w, y, n_in, j0, j1, n_out); break;
      default: block<4>(x, w, y, n_in, j0, j1, n_out); break;
    }
    return;
  }
  switch (m) {
    case 1: rowwise<1>(x, w, y, n_in, j0, j1, n_out); break;
    case 2: rowwise<2>(x, w, y, n_in, j0, j1, n_out); break;
    case 3: rowwise<3>(x, w, y, n_in, j0, j1, n_out); break;
    case 4: rowwise<4>(x, w, y, n_in, j0, j1, n_out); break;
    case 5: rowwise<5>(x, w, y, n_in, j0, j1, n_out); break;
    case 6: rowwise<6>(x, w, y, n_in, j0, j1, n_out); break;
    case 7: rowwise<7>(x, w, y, n_in, j0, j1, n_out); break;
    default: rowwise<8>(x, w, y, n_in, j0, j1, n_out); break;
  }
}

// x: [rows, in], w: [out, in], both contiguous float32 on the CPU -> [rows, out]; tiled: the layout
torch::Tensor linear_rows(torch::Tensor x, torch::Tensor w, bool tiled) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [rows, in] and w [out, in]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat, "float32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.device().is_cpu() && w.device().is_cpu(),
              "contiguous CPU tensors only");
  const int64_t rows = x.size(0), n_in = x.size(1), n_out = w.size(0);
  auto y = torch::empty({rows, n_out}, x.options());
  const float* wp = w.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // each thread takes a range of weight rows and runs every block of input rows over it, so a
  // range's weights come from memory once and from cache for the later blocks
  at::parallel_for(0, n_out, 64, [&](int64_t j0, int64_t j1) {
    const int64_t step = tiled ? 4 : 8;
    for (int64_t r0 = 0; r0 < rows; r0 += step)
      dispatch(tiled, std::min<int64_t>(step, rows - r0), xp + r0 * n_in, wp, yp + r0 * n_out, n_in, j0, j1, n_out);
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("linear_rows", &linear_rows, "one-pass skinny fp32 linear"); }
