// float32 matmuls of a few rows on CPU (models/few_rows.py; built with int8_activations.cpp into one
// extension by models/cpu_kernels.py):
//
//   speculative::few_rows_linear: y = x @ weight.T (+ bias) (+ residual), x [rows, in] and weight
//     [out, in] float32, in a multiple of 32.
//
// A decoding step or a verification multiplies a few rows by every weight matrix, so its cost is
// reading the weights. Each thread takes a share of the outputs and reads each of their weight rows once
// for up to kRows rows of x at a time (more rows: the weight row again, from cache). An output value is
// two chains of fused multiply-adds over 8 lanes (the even and the odd 8-value halves of each 16
// values), whose 16 lanes are summed at the end: the same instructions whatever the number of rows and
// threads, so a verification's rows are bitwise a one-row step's. Without AVX2, scalar code does the
// same arithmetic in the same order. Where the build prefetches (linear_kernels.h), each 64-byte line of
// a weight row is prefetched that far ahead as it is read.

#include "linear_kernels.h"

#include <cmath>

namespace {

using namespace speculative_kernels;

constexpr int64_t kRows = 6;  // two accumulators a row: 12 of the 16 vector registers

// out[i] = the dot product of w and row i of x (row stride `in`), for R rows.
template <int R>
inline void dot_rows(const float* w, const float* x, int64_t in, float* out) {
#if defined(__AVX2__)
  __m256 even[R], odd[R];
  for (int i = 0; i < R; ++i) even[i] = odd[i] = _mm256_setzero_ps();
  for (int64_t j = 0; j < in; j += 16) {  // 16 floats: a 64-byte cache line
    prefetch(w + j);
    const __m256 w0 = _mm256_loadu_ps(w + j), w1 = _mm256_loadu_ps(w + j + 8);
    for (int i = 0; i < R; ++i) {
      even[i] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + i * in + j), even[i]);
      odd[i] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + i * in + j + 8), odd[i]);
    }
  }
  for (int i = 0; i < R; ++i) out[i] = lane_sum(_mm256_add_ps(even[i], odd[i]));
#else
  for (int i = 0; i < R; ++i) {
    float even[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, odd[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int64_t j = 0; j < in; j += 16) {
      for (int64_t lane = 0; lane < 8; ++lane) {
        even[lane] = std::fma(w[j + lane], x[i * in + j + lane], even[lane]);
        odd[lane] = std::fma(w[j + 8 + lane], x[i * in + j + 8 + lane], odd[lane]);
      }
    }
    float lanes[8];
    for (int64_t lane = 0; lane < 8; ++lane) lanes[lane] = even[lane] + odd[lane];
    out[i] = lane_sum(lanes);
  }
#endif
}

at::Tensor few_rows_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                           const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat,
              "few_rows_linear: weight must be float32 [out, in]");
  const Operands o = operands("few_rows_linear", x, weight.size(0), bias, residual);
  TORCH_CHECK(weight.size(1) == o.in, "few_rows_linear: x and weight must have the same in_features");
  const at::Tensor wc = weight.contiguous();
  const float* w = wc.data_ptr<float>();
  const float* xp = o.x.data_ptr<float>();
  const int64_t in = o.in;
  const auto group = [=](int64_t n, int64_t r0, int64_t count, float* dots) {
    const float* wn = w + n * in;
    const float* xr = xp + r0 * in;
    switch (count) {
      case 6: dot_rows<6>(wn, xr, in, dots); break;
      case 5: dot_rows<5>(wn, xr, in, dots); break;
      case 4: dot_rows<4>(wn, xr, in, dots); break;
      case 3: dot_rows<3>(wn, xr, in, dots); break;
      case 2: dot_rows<2>(wn, xr, in, dots); break;
      default: dot_rows<1>(wn, xr, in, dots);
    }
  };
  return outputs<kRows>(o, group, [](int64_t, float v) { return v; });
}

}  // namespace

TORCH_LIBRARY_IMPL(speculative, CPU, m) { m.impl("few_rows_linear", &few_rows_linear); }
