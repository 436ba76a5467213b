// The products of one weight row against M activation rows, Q8_0 and Q4_1. Included twice by qdraft.cpp (no
// include guard, on purpose): once in namespace `avx2` and once in namespace `vnni` inside an AVX512-VNNI
// target region, each namespace giving its own `q8_lanes` / `q41_lanes` for a block's integer products. A GCC
// target attribute does not pass through a template parameter or a functor (a default-target function cannot
// inline a target one), so the loops are written once here and compiled once per instruction set.
//
// Both instruction sets fill the same int32 lanes for a block, so the integers and then every float
// operation below are the same on either path: the same bits on every CPU.

// y[m * ys] for weight row o against activation rows r0..r0+M-1, Q8_0 (`Model::repack`: a row's block scales,
// then its 32-byte blocks). Every row's arithmetic is the same whatever M is (reads in one call give the bits
// of token-by-token reads); two accumulators per row, as a one-row step would otherwise wait on each FMA.
template <int M>
inline void dot_rows_q8(const QLinear& w, int64_t o, const QRows& x, int64_t r0, float* y, int64_t ys) {
  const int64_t nb = w.in / QK;
  const uint16_t* dh = reinterpret_cast<const uint16_t*>(w.row(o));
  const int8_t* qs = reinterpret_cast<const int8_t*>(dh + nb);
  alignas(32) float ds[M][MAX_BLOCKS];
  block_scales<M>(dh, nb, x, r0, ds);
  auto block = [&](int64_t b, __m256* acc) {
    const __m256i wl = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + b * QK)));
    const __m256i wh = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + b * QK + 16)));
    for (int m = 0; m < M; ++m) {
      const __m256i prod = q8_lanes(wl, wh, x.q.data() + ((r0 + m) * nb + b) * QK);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(prod), _mm256_set1_ps(ds[m][b]), acc[m]);
    }
  };
  __m256 even[M], odd[M];
  for (int m = 0; m < M; ++m) even[m] = odd[m] = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    prefetch_ahead(reinterpret_cast<const uint8_t*>(qs + b * QK));
    prefetch_ahead(reinterpret_cast<const uint8_t*>(qs + b * QK + 32));
    block(b, even); block(b + 1, odd);
  }
  if (b < nb) block(b, even);
  for (int m = 0; m < M; ++m) y[m * ys] = hsum(_mm256_add_ps(even[m], odd[m]));
}

// The same for Q4_1 (`Model::repack`: a row's block scales, minimums, then the blocks' 16 bytes of nibbles):
// `q41_unpack` gives the block's 32 nibbles as bytes in order, `q41_lanes` their products with the
// activations' two signed bytes (q = 255 hi + lo), `q41_mins` the minimums' term.
template <int M>
inline void dot_rows_q41(const QLinear& w, int64_t o, const QRows& x, int64_t r0, float* y, int64_t ys) {
  const int64_t nb = w.in / QK;
  const uint16_t* dh = reinterpret_cast<const uint16_t*>(w.row(o));
  const uint8_t* nib = reinterpret_cast<const uint8_t*>(dh + 2 * nb);
  alignas(32) float ds[M][MAX_BLOCKS];
  float mins[M];
  block_scales<M>(dh, nb, x, r0, ds);
  q41_mins<M>(dh + nb, nb, x, r0, mins);
  auto block = [&](int64_t b, __m256* acc) {
    const __m256i wv = q41_unpack(nib + b * 16);
    for (int m = 0; m < M; ++m) {
      const __m256i prod = q41_lanes(wv, x.split.data() + ((r0 + m) * nb + b) * 2 * QK);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(prod), _mm256_set1_ps(ds[m][b]), acc[m]);
    }
  };
  __m256 even[M], odd[M];
  for (int m = 0; m < M; ++m) even[m] = odd[m] = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    prefetch_ahead(nib + b * 16);
    block(b, even); block(b + 1, odd);
  }
  if (b < nb) block(b, even);
  for (int m = 0; m < M; ++m) y[m * ys] = hsum(_mm256_add_ps(even[m], odd[m])) + mins[m];
}
