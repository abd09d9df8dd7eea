// What the C++ linear kernels beside this file share (int8_activations.cpp, few_rows.cpp; built into one
// extension by models/cpu_kernels.py): operand checks, lane sums, and the loop over outputs that gives
// every output value to one thread, computed by the same instructions whatever the number of rows and
// threads.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace speculative_kernels {

constexpr int64_t kBlock = 32;  // in_features must be a multiple of this

#if defined(__AVX2__)
// the sum of acc's 8 lanes: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))
inline float lane_sum(__m256 acc) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

inline float lane_sum(const float* lanes) {
  return ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
}

// Where SPECULATIVE_PREFETCH is defined (models/cpu_kernels.py: on Intel CPUs, where it was measured
// to pay), a kernel's loop asks the CPU to fetch the weights that many bytes ahead into cache: there a
// thread streaming its share of a weight matrix does not keep enough reads in flight on its own to
// reach the memory's bandwidth. A prefetch past the matrix's end is harmless: it never faults.
inline void prefetch(const void* weights) {
#if defined(__AVX2__) && defined(SPECULATIVE_PREFETCH)
  _mm_prefetch(static_cast<const char*>(weights) + SPECULATIVE_PREFETCH, _MM_HINT_T0);
#else
  (void)weights;
#endif
}

// x [rows, in] float32 (+ bias [out]) (+ residual [rows, out]) checked and made contiguous, for `name`.
struct Operands {
  at::Tensor x, bias, residual;
  int64_t rows, in, out;
};

inline Operands operands(const char* name, const at::Tensor& x, int64_t out, const c10::optional<at::Tensor>& bias,
                  const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, name, ": x must be float32 [rows, in]");
  TORCH_CHECK(x.size(1) % kBlock == 0, name, ": in_features must be a multiple of 32");
  Operands o{x.contiguous(), at::Tensor(), at::Tensor(), x.size(0), x.size(1), out};
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == out, name, ": bias must be float32 [out]");
    o.bias = bias->contiguous();
  }
  if (residual.has_value()) {
    TORCH_CHECK(residual->scalar_type() == at::kFloat && residual->dim() == 2 && residual->size(0) == o.rows &&
                    residual->size(1) == out,
                name, ": residual must be float32 [rows, out]");
    o.residual = residual->contiguous();
  }
  return o;
}

// y [rows, out] of `o`: for each output n (the outputs split between threads) and each group of up to
// Rows rows from r0, group(n, r0, count, dots) writes the group's count dot products, each then
// row_scale(n, dot), plus bias and residual.
template <int64_t Rows, typename Group, typename Scale>
at::Tensor outputs(const Operands& o, Group group, Scale row_scale) {
  const int64_t rows = o.rows, out = o.out;
  at::Tensor y = at::empty({rows, out}, o.x.options());
  const float* bp = o.bias.defined() ? o.bias.data_ptr<float>() : nullptr;
  const float* rp = o.residual.defined() ? o.residual.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, out, 16, [&](int64_t begin, int64_t end) {
    float dots[Rows];
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t r0 = 0; r0 < rows; r0 += Rows) {
        const int64_t count = std::min(Rows, rows - r0);
        group(n, r0, count, dots);
        for (int64_t i = 0; i < count; ++i) {
          const int64_t r = r0 + i;
          float v = row_scale(n, dots[i]);
          if (bp) v += bp[n];
          if (rp) v += rp[r * out + n];
          yp[r * out + n] = v;
        }
      }
    }
  });
  return y;
}

}  // namespace speculative_kernels
