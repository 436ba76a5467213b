"""A verify's Linear layers as one pass over the weights: a probe, not yet a kernel omnidraft uses.

    .venv/bin/pip install ninja && taskset -c 0 .venv/bin/python scripts/skinny_gemm_probe.py

Verifying k proposals multiplies every weight matrix by k + 1 rows. A model's weights do not fit in
cache, so one row is memory-bound, and k + 1 rows should cost about the same. On CPUs where torch's
MKL takes its AVX2 path (lscpu "AMD EPYC" here) small-row GEMMs are compute-bound instead: two rows
cost 1.5-1.8x one, which is why a verify of one proposal costs 1.3-1.9 plain steps on the torch
target (docs/remote.md) and speculation pays so little there.

This compiles (torch.utils.cpp_extension, ~50 s once) a 40-line AVX2/FMA kernel that reads each
weight row once and accumulates its dot product with each of up to 8 input rows in the same order
whatever their number, so every output row is bit-identical to the one-row product (a verify and a
plain step would agree exactly), and times it against torch's kernels with cold caches: 8 weight
matrices of one Qwen2.5-0.5B MLP shape per call, 256 MB written between calls, one thread.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from torch.utils.cpp_extension import load_inline

SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>

template <int M>
static void rows(const float* x, const float* w, float* y, int64_t n_in, int64_t j0, int64_t j1, int64_t n_out) {
  for (int64_t j = j0; j < j1; ++j) {
    const float* wr = w + j * n_in;
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n_in; i += 8) {  // the weight row is loaded once for all M input rows
      __m256 wv = _mm256_loadu_ps(wr + i);
      for (int m = 0; m < M; ++m) acc[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * n_in + i), acc[m]);
    }
    for (int m = 0; m < M; ++m) {
      __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1));
      s = _mm_add_ps(s, _mm_movehl_ps(s, s));
      s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
      float r = _mm_cvtss_f32(s);
      for (int64_t t = i; t < n_in; ++t) r += wr[t] * x[m * n_in + t];
      y[m * n_out + j] = r;
    }
  }
}

torch::Tensor skinny(torch::Tensor x, torch::Tensor w) {  // x: [M <= 8, in], w: [out, in], fp32, contiguous
  int64_t M = x.size(0), n_in = x.size(1), n_out = w.size(0);
  TORCH_CHECK(M >= 1 && M <= 8 && x.is_contiguous() && w.is_contiguous(), "1..8 contiguous rows");
  auto y = torch::empty({M, n_out}, x.options());
  const float* xp = x.data_ptr<float>(); const float* wp = w.data_ptr<float>(); float* yp = y.data_ptr<float>();
  at::parallel_for(0, n_out, 64, [&](int64_t j0, int64_t j1) {
    switch (M) {
      case 1: rows<1>(xp, wp, yp, n_in, j0, j1, n_out); break;
      case 2: rows<2>(xp, wp, yp, n_in, j0, j1, n_out); break;
      case 3: rows<3>(xp, wp, yp, n_in, j0, j1, n_out); break;
      case 4: rows<4>(xp, wp, yp, n_in, j0, j1, n_out); break;
      case 5: rows<5>(xp, wp, yp, n_in, j0, j1, n_out); break;
      case 6: rows<6>(xp, wp, yp, n_in, j0, j1, n_out); break;
      case 7: rows<7>(xp, wp, yp, n_in, j0, j1, n_out); break;
      default: rows<8>(xp, wp, yp, n_in, j0, j1, n_out); break;
    }
  });
  return y;
}
"""


def cold_ms(fn, scratch: torch.Tensor, repeats: int = 5) -> float:
    """Median ms of ``fn`` with the caches flushed before each call (weights come from memory)."""
    times = []
    for _ in range(repeats):
        scratch.add_(1.0)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2] * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=int, default=4864, help="weight rows (Qwen2.5-0.5B MLP: 4864)")
    parser.add_argument("--in", dest="n_in", type=int, default=896, help="weight columns (hidden size)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as build:
        start = time.time()
        module = load_inline("omnidraft_skinny_probe", cpp_sources=SOURCE, functions=["skinny"],
                             extra_cflags=["-O3", "-mavx2", "-mfma"], build_directory=build)
        print(f"compiled in {time.time() - start:.0f} s")
        torch.set_num_threads(args.threads)
        weights = [torch.randn(args.out, args.n_in) for _ in range(8)]
        x8 = torch.randn(8, args.n_in)
        outs = [module.skinny(x8[:m].contiguous(), weights[0]) for m in range(1, 9)]
        same = all(torch.equal(o[:1], outs[0]) for o in outs)
        err = (outs[-1] - torch.nn.functional.linear(x8, weights[0])).abs().max().item()
        print(f"row 0 bit-identical for 1..8 rows: {same}; max |difference| from F.linear: {err:.1e}")
        scratch = torch.empty(64 * 2**20)
        print("| rows | torch.mm(W, x.T) ms | F.linear ms | one pass ms |\n|---|---|---|---|")
        for rows in (1, 2, 3, 4, 6, 8):
            x = torch.randn(rows, args.n_in)
            mm = cold_ms(lambda: [torch.mm(w, x.t()) for w in weights], scratch)
            lin = cold_ms(lambda: [torch.nn.functional.linear(x, w) for w in weights], scratch)
            one = cold_ms(lambda: [module.skinny(x, w) for w in weights], scratch)
            print(f"| {rows} | {mm:.1f} | {lin:.1f} | {one:.1f} |")


if __name__ == "__main__":
    main()
