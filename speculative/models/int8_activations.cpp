// Linear layers whose activations are quantized to int8 on the fly, on CPU (models/int8_activations.py
// builds this file with torch.utils.cpp_extension the first time a model uses it):
//
//   speculative::w8a8_linear: y = x @ (q * scales[:, None]).T (+ bias) (+ residual), q int8 [out, in],
//     symmetric per output row: each dot product is a sum over blocks of d * (the exact integer dot
//     product of 32 int8 pairs), times the weight row's scale.
//   speculative::w4a8_linear: the same with 4-bit weights in llama.cpp's Q4_1 scheme: per block of 32
//     weights of a row, w = q * dw + mw with q in [0, 15] (two a byte: byte j of a block holds weight j
//     in its low four bits and weight j + 16 in its high four), dw and mw float16. A block's dot
//     product is dw * d * (the exact integer dot product) + mw * s, s = d * (the sum of the block's 32
//     int8 activations), as llama.cpp's Q4_1 x Q8_1 dot products compute it.
//
// Each row of x, a block of 32 values at a time, becomes int8 values and one float32 scale (d = absmax /
// 127, round to nearest even).
//
// Every output value is computed by one thread, by the same sequence of instructions whatever the
// number of rows and threads: a row's result is bitwise the same in a call of one row and of many,
// which is what keeps speculative decoding exact (a verification of k + 1 rows gives each row what a
// one-row decoding step gives it).
//
// With AVX2 (compiled with -mavx2 -mfma -mf16c), a block's 32 products are summed by
// _mm256_maddubs_epi16 (unsigned by signed bytes: |x| and w * sign(x) for int8 weights, the 4-bit
// weights as they are; no int16 saturation, the products being at most 127 * 127 * 2) and
// _mm256_madd_epi16(., 1) into 8 int32 lanes, converted to float and accumulated with the block's scale
// as a fused multiply-add per lane; the 8 lanes are summed at the end. Without AVX2, scalar code does
// the same arithmetic in the same order. On Intel CPUs each block's loop also prefetches the weights a
// few kilobytes ahead (`prefetch`; a thread's share of a matrix is read in order).

#include "linear_kernels.h"

#include <algorithm>
#include <cmath>

namespace {

using namespace speculative_kernels;

// x [rows, in] -> q [rows, in] int8 in [-127, 127], d [rows, in / 32] and, where `sums` is given,
// sums [rows, in / 32]: each block's d times the sum of its 32 int8 values
void quantize_rows(const float* x, int64_t rows, int64_t in, int8_t* q, float* d, float* sums) {
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
      if (sums) {
        int32_t total = 0;
        for (int64_t i = 0; i < kBlock; ++i) total += qb[i];
        sums[r * blocks + b] = d[r * blocks + b] * static_cast<float>(total);
      }
    }
  }
}

// Without AVX2: the integer dot product of lane `lane` of a block (its values 4 lane .. 4 lane + 3),
// weight(j) giving weight j of the block.
template <typename Weight>
inline int32_t lane_dot(Weight weight, const int8_t* x, int64_t lane) {
  int32_t sum = 0;
  for (int64_t k = 0; k < 4; ++k) sum += weight(4 * lane + k) * static_cast<int32_t>(x[4 * lane + k]);
  return sum;
}

// For each of R rows i of x (row stride `in`, block scales stride `blocks`): out[i] = the sum over
// blocks b of d_i[b] * (the dot product of w's and x_i's 32 int8 values of block b). The R rows are
// R independent chains of the same instructions (a row's result is the same for any R), interleaved
// so that one row's fused multiply-add latency does not hold the others up.
template <int R>
inline void dot_rows(const int8_t* w, const int8_t* x, const float* d, const float*, int64_t in,
                     int64_t blocks, float* out) {
#if defined(__AVX2__)
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    prefetch(w + b * kBlock);
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * kBlock));
    for (int i = 0; i < R; ++i) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i * in + b * kBlock));
      const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(xv, xv), _mm256_sign_epi8(wv, xv));
      const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
      acc[i] = _mm256_fmadd_ps(sums, _mm256_set1_ps(d[i * blocks + b]), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) out[i] = lane_sum(acc[i]);
#else
  for (int i = 0; i < R; ++i) {
    float lanes[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int64_t b = 0; b < blocks; ++b) {
      const int8_t* wb = w + b * kBlock;
      const auto weight = [wb](int64_t j) { return static_cast<int32_t>(wb[j]); };
      for (int64_t lane = 0; lane < 8; ++lane) {
        const float sum = static_cast<float>(lane_dot(weight, x + i * in + b * kBlock, lane));
        lanes[lane] = std::fma(sum, d[i * blocks + b], lanes[lane]);
      }
    }
    out[i] = lane_sum(lanes);
  }
#endif
}

inline float half_to_float(const at::Half* h) {
#if defined(__AVX2__)
  return _cvtsh_ss(*reinterpret_cast<const uint16_t*>(h));
#else
  return static_cast<float>(*h);
#endif
}

// The sum over b of mw[b] * sx[b] (float16 minimums, float32 block sums): 8 blocks a fused multiply-add
// with AVX2, then the blocks left one by one.
inline float min_dot(const at::Half* mw, const float* sx, int64_t blocks) {
  int64_t b = 0;
  float total = 0.f;
#if defined(__AVX2__)
  __m256 acc = _mm256_setzero_ps();
  for (; b + 8 <= blocks; b += 8) {
    const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mw + b)));
    acc = _mm256_fmadd_ps(m, _mm256_loadu_ps(sx + b), acc);
  }
  total = lane_sum(acc);
#endif
  for (; b < blocks; ++b) total = std::fma(half_to_float(mw + b), sx[b], total);
  return total;
}

// The same for a Q4_1 weight row: w its 4-bit values (16 bytes a block, see the top of this file), dw
// and mw its blocks' scales and minimums (float16); sx the rows' block sums (quantize_rows). out[i] =
// the lanes' sum of (the integer dot product) * dw * d_i[b] over the blocks, plus the dot product of
// mw and sx_i (min_dot).
template <int R>
inline void dot_rows_q4(const uint8_t* w, const at::Half* dw, const at::Half* mw, const int8_t* x,
                        const float* d, const float* sx, int64_t in, int64_t blocks, float* out) {
#if defined(__AVX2__)
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i low = _mm256_set1_epi8(0x0f);
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    prefetch(w + b * kBlock / 2);
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + b * kBlock / 2));
    // weights 0..15 (the low four bits) in the low 128 bits, 16..31 (the high four) in the high
    const __m256i wv = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low);
    const __m256 scale = _mm256_set1_ps(half_to_float(dw + b));
    for (int i = 0; i < R; ++i) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i * in + b * kBlock));
      const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(wv, xv), ones));
      acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(sums, scale), _mm256_set1_ps(d[i * blocks + b]), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) out[i] = lane_sum(acc[i]) + min_dot(mw, sx + i * blocks, blocks);
#else
  for (int i = 0; i < R; ++i) {
    float lanes[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* wb = w + b * kBlock / 2;
      const auto weight = [wb](int64_t j) { return static_cast<int32_t>(j < 16 ? wb[j] & 15 : wb[j - 16] >> 4); };
      const float scale = half_to_float(dw + b);
      for (int64_t lane = 0; lane < 8; ++lane) {
        const float sum = static_cast<float>(lane_dot(weight, x + i * in + b * kBlock, lane));
        lanes[lane] = std::fma(sum * scale, d[i * blocks + b], lanes[lane]);
      }
    }
    out[i] = lane_sum(lanes) + min_dot(mw, sx + i * blocks, blocks);
  }
#endif
}

constexpr int64_t kRows = 8;  // rows of x a weight row's blocks are loaded for at once

// y [rows, out] of `o`: x quantized (quantize_rows; with block sums where `sums`), then for each output
// n and each group of up to kRows rows, dot(n, R, rows' int8 values, their scales, their sums, dots)
// writes the group's R dot products, each then row_scale(n, dot), plus bias and residual.
template <typename Dot, typename Scale>
at::Tensor run(const Operands& o, bool sums, Dot dot, Scale row_scale) {
  const int64_t rows = o.rows, in = o.in, blocks = in / kBlock;
  at::Tensor q = at::empty({rows, in}, o.x.options().dtype(at::kChar));
  at::Tensor d = at::empty({rows, blocks}, o.x.options());
  at::Tensor s = sums ? at::empty({rows, blocks}, o.x.options()) : at::Tensor();
  quantize_rows(o.x.data_ptr<float>(), rows, in, q.data_ptr<int8_t>(), d.data_ptr<float>(),
                sums ? s.data_ptr<float>() : nullptr);
  const int8_t* qx = q.data_ptr<int8_t>();
  const float* dx = d.data_ptr<float>();
  const float* sx = sums ? s.data_ptr<float>() : nullptr;
  const auto group = [=](int64_t n, int64_t r0, int64_t count, float* dots) {
    dot(n, count, qx + r0 * in, dx + r0 * blocks, sx ? sx + r0 * blocks : nullptr, dots);
  };
  return outputs<kRows>(o, group, row_scale);
}

// dot_rows-like `kernel<R>` for `count` (1 .. kRows) rows, R a compile-time constant
#define SPECULATIVE_BY_ROWS(count, call)  \
  switch (count) {                        \
    case 8: call(8); break;               \
    case 7: call(7); break;               \
    case 6: call(6); break;               \
    case 5: call(5); break;               \
    case 4: call(4); break;               \
    case 3: call(3); break;               \
    case 2: call(2); break;               \
    default: call(1);                     \
  }

at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar,
              "w8a8_linear: qweight must be int8 [out, in]");
  const int64_t out = qweight.size(0);
  const Operands o = operands("w8a8_linear", x, out, bias, residual);
  TORCH_CHECK(qweight.size(1) == o.in, "w8a8_linear: x and qweight must have the same in_features");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == out,
              "w8a8_linear: scales must be float32 [out]");
  const at::Tensor wc = qweight.contiguous(), sc = scales.contiguous();
  const int8_t* w = wc.data_ptr<int8_t>();
  const float* s = sc.data_ptr<float>();
  const int64_t in = o.in, blocks = in / kBlock;
  const auto dot = [=](int64_t n, int64_t count, const int8_t* xr, const float* dr, const float* sr, float* dots) {
#define SPECULATIVE_W8(R) dot_rows<R>(w + n * in, xr, dr, sr, in, blocks, dots)
    SPECULATIVE_BY_ROWS(count, SPECULATIVE_W8)
#undef SPECULATIVE_W8
  };
  return run(o, false, dot, [=](int64_t n, float v) { return v * s[n]; });
}

at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales_and_mins,
                       const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kByte,
              "w4a8_linear: qweight must be uint8 [out, in / 2] (two 4-bit weights a byte)");
  const int64_t out = qweight.size(0);
  const Operands o = operands("w4a8_linear", x, out, bias, residual);
  const int64_t in = o.in, blocks = in / kBlock;
  TORCH_CHECK(qweight.size(1) * 2 == in, "w4a8_linear: qweight must be [out, in / 2]");
  TORCH_CHECK(scales_and_mins.scalar_type() == at::kHalf && scales_and_mins.numel() == out * 2 * blocks,
              "w4a8_linear: scales_and_mins must be float16 [out, 2, in / 32]");
  const at::Tensor wc = qweight.contiguous(), dmc = scales_and_mins.contiguous();
  const uint8_t* w = wc.data_ptr<uint8_t>();
  const at::Half* dm = dmc.data_ptr<at::Half>();
  const auto dot = [=](int64_t n, int64_t count, const int8_t* xr, const float* dr, const float* sr, float* dots) {
    const at::Half* scales = dm + n * 2 * blocks;
#define SPECULATIVE_W4(R) dot_rows_q4<R>(w + n * in / 2, scales, scales + blocks, xr, dr, sr, in, blocks, dots)
    SPECULATIVE_BY_ROWS(count, SPECULATIVE_W4)
#undef SPECULATIVE_W4
  };
  return run(o, true, dot, [](int64_t, float v) { return v; });
}

#undef SPECULATIVE_BY_ROWS

}  // namespace

TORCH_LIBRARY_IMPL(speculative, CPU, m) {
  m.impl("w8a8_linear", &w8a8_linear);
  m.impl("w4a8_linear", &w4a8_linear);
}
