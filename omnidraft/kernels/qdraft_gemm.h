// A long read's products in float32: y [rows, out] = x W^T with W's blocks dequantized a tile at a time. Included
// twice by qdraft.cpp (no include guard, on purpose), as qdraft_rows.h is: once in namespace `gemm256` (AVX2) and
// once in namespace `gemm512` inside an AVX-512F target region, each namespace giving its own vector type `VF`,
// `vload`, `vfma`, `vhsum` and block sizes GR (activation rows) x GC (weight rows).
//
// Why: the integer products (qdraft_rows.h) suit a token, where the weights' bytes are the cost; a read of many
// rows is bound by arithmetic instead, and there an integer block costs two VNNI products, a shift and a float
// FMA per 32 weights and row, where float32 costs two or four FMAs. So a read of enough rows dequantizes each
// tile of OUT_TILE weight rows once (to float32, exactly as the dequantized model holds them) and takes every
// activation row's dot products against it in float32. The result follows the float32 model more closely than
// the 16-bit activations do, but it is not the bits of a token-by-token read.

// GR x GC dot products of activation rows x[r * in ..] against dequantized weight rows wf[c * in ..], over the
// whole row: one accumulator per pair, summed across lanes at the end
template <int R>
inline void dot_block(const float* x, const float* wf, int64_t in, float* y, int64_t ys) {
  VF acc[R][GC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < GC; ++c) acc[r][c] = vzero();
  for (int64_t i = 0; i < in; i += LANES) {
    VF xv[R];
    for (int r = 0; r < R; ++r) xv[r] = vload(x + r * in + i);
    for (int c = 0; c < GC; ++c) {
      const VF wv = vload(wf + c * in + i);
      for (int r = 0; r < R; ++r) acc[r][c] = vfma(xv[r], wv, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < GC; ++c) y[r * ys + c] = vhsum(acc[r][c]);
}

// y [rows, out] = x W^T (x float32 [rows, in]), tiles of OUT_TILE weight rows shared among the team (call inside
// a parallel region; no barrier at the end). `scratch` holds OUT_TILE * in floats per thread.
inline void gemm_for(const QLinear& w, const float* x, int64_t rows, float* y, float* scratch) {
  const int64_t tiles = w.out / OUT_TILE, in = w.in;
  float* wf = scratch + static_cast<int64_t>(omp_get_thread_num()) * OUT_TILE * in;
#pragma omp for schedule(static) nowait
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t o0 = t * OUT_TILE;
    for (int64_t o = 0; o < OUT_TILE; ++o) dequantize_row(w, o0 + o, wf + o * in);
    int64_t r = 0;
    for (; r + GR <= rows; r += GR)
      for (int64_t c = 0; c < OUT_TILE; c += GC) dot_block<GR>(x + r * in, wf + c * in, in, y + r * w.out + o0 + c, w.out);
    for (int64_t c = 0; c < OUT_TILE && r < rows; c += GC) switch (rows - r) {
      case 3: dot_block<3>(x + r * in, wf + c * in, in, y + r * w.out + o0 + c, w.out); break;
      case 2: dot_block<2>(x + r * in, wf + c * in, in, y + r * w.out + o0 + c, w.out); break;
      case 1: dot_block<1>(x + r * in, wf + c * in, in, y + r * w.out + o0 + c, w.out); break;
      default: break;
    }
  }
}
