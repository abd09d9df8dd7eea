// speculative::w8a8_linear: y = x @ (q * scales[:, None]).T (+ bias) (+ residual), on CPU, with the
// activations quantized to int8 on the fly: each row of x, a block of 32 values at a time, becomes
// int8 values and one float32 scale (d = absmax / 127, round to nearest even), and each dot product is
// a sum over blocks of d * (the exact integer dot product of 32 int8 pairs), times the weight row's
// scale. Built by models/w8a8.py (torch.utils.cpp_extension) the first time a model uses it.
//
// Every output value is computed by one thread, by the same sequence of instructions whatever the
// number of rows and threads: a row's result is bitwise the same in a call of one row and of many,
// which is what keeps speculative decoding exact (a verification of k + 1 rows gives each row what a
// one-row decoding step gives it).
//
// With AVX2 (compiled with -mavx2 -mfma), a block's 32 products are summed by
// _mm256_maddubs_epi16(|x|, w * sign(x)) (no int16 saturation: |x|, |w| <= 127) and
// _mm256_madd_epi16(., 1) into 8 int32 lanes, converted to float and accumulated with d as a fused
// multiply-add per lane; the 8 lanes are summed at the end. Without AVX2, scalar code does the same
// arithmetic in the same order.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;

// x [rows, in] -> q [rows, in] int8 in [-127, 127] and d [rows, in / 32]
void quantize_rows(const float* x, int64_t rows, int64_t in, int8_t* q, float* d) {
  const int64_t blocks = in / kBlock;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + r * in + b * kBlock;
      int8_t* qb = q + r * in + b * kBlock;
#if defined(__AVX2__)
      const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
      __m256 v[4];
      __m256 amax = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(xb + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], magnitude));
      }
      __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      m = _mm_max_ps(m, _mm_movehl_ps(m, m));
      m = _mm_max_ss(m, _mm_movehdup_ps(m));
      const float absmax = _mm_cvtss_f32(m);
#else
      float absmax = 0.f;
      for (int64_t i = 0; i < kBlock; ++i) absmax = std::max(absmax, std::fabs(xb[i]));
#endif
      const float inverse = absmax > 0.f ? 127.f / absmax : 0.f;
      d[r * blocks + b] = absmax / 127.f;
#if defined(__AVX2__)
      const __m256 scale = _mm256_set1_ps(inverse);
      __m256i n[4];
      for (int i = 0; i < 4; ++i) {
        const __m256 rounded =
            _mm256_round_ps(_mm256_mul_ps(v[i], scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        n[i] = _mm256_cvtps_epi32(rounded);
      }
      // pack 32 int32 to 32 int8; the packs interleave 128-bit lanes, the permute puts them back in order
      const __m256i words = _mm256_packs_epi32(n[0], n[1]);
      const __m256i words2 = _mm256_packs_epi32(n[2], n[3]);
      const __m256i bytes = _mm256_packs_epi16(words, words2);
      const __m256i ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), ordered);
#else
      for (int64_t i = 0; i < kBlock; ++i) qb[i] = static_cast<int8_t>(std::nearbyint(xb[i] * inverse));
#endif
    }
  }
}

// For each of R rows i of x (row stride `in`, block scales stride `blocks`): out[i] = the sum over
// blocks b of d_i[b] * (the dot product of w's and x_i's 32 int8 values of block b). The R rows are
// R independent chains of the same instructions (a row's result is the same for any R), interleaved
// so that one row's fused multiply-add latency does not hold the others up.
template <int R>
inline void dot_rows(const int8_t* w, const int8_t* x, const float* d, int64_t in, int64_t blocks, float* out) {
#if defined(__AVX2__)
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * kBlock));
    for (int i = 0; i < R; ++i) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i * in + b * kBlock));
      const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(xv, xv), _mm256_sign_epi8(wv, xv));
      const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
      acc[i] = _mm256_fmadd_ps(sums, _mm256_set1_ps(d[i * blocks + b]), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[i]), _mm256_extractf128_ps(acc[i], 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    out[i] = _mm_cvtss_f32(s);
  }
#else
  for (int i = 0; i < R; ++i) {
    float lanes[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int64_t b = 0; b < blocks; ++b) {
      for (int64_t lane = 0; lane < 8; ++lane) {
        int32_t sum = 0;
        for (int64_t k = 0; k < 4; ++k) {
          const int64_t j = b * kBlock + 4 * lane + k;
          sum += static_cast<int32_t>(w[j]) * static_cast<int32_t>(x[i * in + j]);
        }
        lanes[lane] = std::fma(static_cast<float>(sum), d[i * blocks + b], lanes[lane]);
      }
    }
    out[i] = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
  }
#endif
}

constexpr int64_t kRows = 8;  // rows of x a weight row's blocks are loaded for at once

at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "w8a8_linear: x must be float32 [rows, in]");
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar,
              "w8a8_linear: qweight must be int8 [out, in]");
  const int64_t rows = x.size(0), in = x.size(1), out = qweight.size(0);
  TORCH_CHECK(qweight.size(1) == in && in % kBlock == 0,
              "w8a8_linear: x and qweight must have the same in_features, a multiple of 32");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == out,
              "w8a8_linear: scales must be float32 [out]");
  const at::Tensor xc = x.contiguous(), wc = qweight.contiguous(), sc = scales.contiguous();
  at::Tensor bc, rc;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == out, "w8a8_linear: bias must be float32 [out]");
    bc = bias->contiguous();
  }
  if (residual.has_value()) {
    TORCH_CHECK(residual->scalar_type() == at::kFloat && residual->dim() == 2 && residual->size(0) == rows &&
                    residual->size(1) == out,
                "w8a8_linear: residual must be float32 [rows, out]");
    rc = residual->contiguous();
  }
  at::Tensor q = at::empty({rows, in}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({rows, in / kBlock}, x.options());
  quantize_rows(xc.data_ptr<float>(), rows, in, q.data_ptr<int8_t>(), d.data_ptr<float>());
  at::Tensor y = at::empty({rows, out}, x.options());
  const int8_t* w = wc.data_ptr<int8_t>();
  const int8_t* qx = q.data_ptr<int8_t>();
  const float* dx = d.data_ptr<float>();
  const float* s = sc.data_ptr<float>();
  const float* bp = bc.defined() ? bc.data_ptr<float>() : nullptr;
  const float* rp = rc.defined() ? rc.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t blocks = in / kBlock;
  at::parallel_for(0, out, 16, [&](int64_t begin, int64_t end) {
    float dots[kRows];
    for (int64_t n = begin; n < end; ++n) {
      const int8_t* wn = w + n * in;
      for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
        const int64_t count = std::min(kRows, rows - r0);
        const int8_t* xr = qx + r0 * in;
        const float* dr = dx + r0 * blocks;
        switch (count) {
          case 8: dot_rows<8>(wn, xr, dr, in, blocks, dots); break;
          case 7: dot_rows<7>(wn, xr, dr, in, blocks, dots); break;
          case 6: dot_rows<6>(wn, xr, dr, in, blocks, dots); break;
          case 5: dot_rows<5>(wn, xr, dr, in, blocks, dots); break;
          case 4: dot_rows<4>(wn, xr, dr, in, blocks, dots); break;
          case 3: dot_rows<3>(wn, xr, dr, in, blocks, dots); break;
          case 2: dot_rows<2>(wn, xr, dr, in, blocks, dots); break;
          default: dot_rows<1>(wn, xr, dr, in, blocks, dots);
        }
        for (int64_t i = 0; i < count; ++i) {
          const int64_t r = r0 + i;
          float v = dots[i] * s[n];
          if (bp) v += bp[n];
          if (rp) v += rp[r * out + n];
          yp[r * out + n] = v;
        }
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(speculative, CPU, m) { m.impl("w8a8_linear", &w8a8_linear); }
