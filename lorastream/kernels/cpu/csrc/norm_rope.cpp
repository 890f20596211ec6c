// RMSNorm of hidden states and the rotary embedding of q and k on the CPU, each in one pass: the
// six and twelve small torch ops they replace cost 70 and 150 us per call at decode shapes, ~9 ms
// of a step over 30 layers.
//
// Registered as torch.ops.lorastream.rms_norm and torch.ops.lorastream.rotary. Semantics, shapes
// and the reference: lorastream/kernels/cpu_norm_rope.py. Built with the other ops as one extension
// (lorastream/kernels/cpu_ops.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>

#include "cpu_common.h"

namespace {

using lorastream_cpu::check_float;
// rows per parallel task by their elements: a decode step's 32 rows of 576 run on the calling
// thread (~3 us of work, where waking the other thread costs more)
using lorastream_cpu::grain;

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_float(x, "rms_norm", "x");
  check_float(weight, "rms_norm", "weight");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "rms_norm: x is [T, D] contiguous");
  const int64_t rows = x.size(0), d = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == d && weight.is_contiguous(),
              "rms_norm: weight is [D], D as x's");
  at::Tensor out = at::empty({rows, d}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float eps_f = static_cast<float>(eps);
  at::parallel_for(0, rows, grain(d), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* xr = xp + t * d;
      // the squares in fp64 (exact: 24-bit mantissas), summed in fp64 in any order: the mean is
      // rounded once, to fp32, and the order of the sums does not reach it
      double sum = 0.0;
      int64_t j = 0;
#ifdef LORASTREAM_AVX2
      __m256d s0 = _mm256_setzero_pd(), s1 = s0;
      for (; j + 8 <= d; j += 8) {
        const __m256d lo = _mm256_cvtps_pd(_mm_loadu_ps(xr + j));
        const __m256d hi = _mm256_cvtps_pd(_mm_loadu_ps(xr + j + 4));
        s0 = _mm256_fmadd_pd(lo, lo, s0);
        s1 = _mm256_fmadd_pd(hi, hi, s1);
      }
      double lanes[4];
      _mm256_storeu_pd(lanes, _mm256_add_pd(s0, s1));
      sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
#endif
      for (; j < d; ++j) sum += static_cast<double>(xr[j]) * xr[j];
      // torch: rsqrt(mean + eps) is 1 / sqrt, each rounded; then (x * r) * w, each rounded
      const float mean = static_cast<float>(sum / static_cast<double>(d));
      const float r = 1.0f / std::sqrt(mean + eps_f);
      float* o = op + t * d;
      int64_t i = 0;
#ifdef LORASTREAM_AVX2
      const __m256 rv = _mm256_set1_ps(r);
      for (; i + 8 <= d; i += 8) {
        const __m256 xh = _mm256_mul_ps(_mm256_loadu_ps(xr + i), rv);
        _mm256_storeu_ps(o + i, _mm256_mul_ps(xh, _mm256_loadu_ps(wp + i)));
      }
#endif
      for (; i < d; ++i) {
        const float xh = xr[i] * r;
        o[i] = xh * wp[i];
      }
    }
  });
  return out;
}

// out[0:d] = x * cos + rotate_half(x) * sin, out[d:] = x[d:]: two products and a sum, each
// rounded as torch rounds them (no fused multiply-add: the intrinsics are never contracted and
// the scalar tail is compiled without contraction)
__attribute__((optimize("fp-contract=off"))) void rotate_head(const float* x, const float* cos,
                                                              const float* sin, int64_t d,
                                                              int64_t dim, float* out) {
  const int64_t half = d / 2;
  int64_t i = 0;
#ifdef LORASTREAM_AVX2
  for (; i + 8 <= half; i += 8) {
    const __m256 lo = _mm256_loadu_ps(x + i), hi = _mm256_loadu_ps(x + half + i);
    // rotate_half(x) = [-x[half:], x[:half]]; (-a) * s is -(a * s) exactly
    const __m256 out_lo = _mm256_sub_ps(_mm256_mul_ps(lo, _mm256_loadu_ps(cos + i)),
                                        _mm256_mul_ps(hi, _mm256_loadu_ps(sin + i)));
    const __m256 out_hi = _mm256_add_ps(_mm256_mul_ps(hi, _mm256_loadu_ps(cos + half + i)),
                                        _mm256_mul_ps(lo, _mm256_loadu_ps(sin + half + i)));
    _mm256_storeu_ps(out + i, out_lo);
    _mm256_storeu_ps(out + half + i, out_hi);
  }
#endif
  for (; i < half; ++i) {
    const float a = x[i] * cos[i], b = x[half + i] * sin[i];
    const float c = x[half + i] * cos[half + i], e = x[i] * sin[half + i];
    out[i] = a - b;
    out[half + i] = c + e;
  }
  for (int64_t j = d; j < dim; ++j) out[j] = x[j];
}

// x [T, H, D] with unit stride in D -> a contiguous rotated copy
at::Tensor rotate_heads(const at::Tensor& x, const float* cos, const float* sin, int64_t d) {
  const int64_t rows = x.size(0), heads = x.size(1), dim = x.size(2);
  at::Tensor out = at::empty({rows, heads, dim}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  at::parallel_for(0, rows, grain(heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        rotate_head(xp + t * s0 + h * s1, cos + t * d, sin + t * d, d, dim,
                    op + (t * heads + h) * dim);
      }
    }
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& cos, const at::Tensor& sin) {
  check_float(q, "rotary", "q");
  check_float(k, "rotary", "k");
  check_float(cos, "rotary", "cos");
  check_float(sin, "rotary", "sin");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2) &&
                  q.stride(2) == 1 && k.stride(2) == 1,
              "rotary: q is [T, H, D] and k [T, Hkv, D], unit stride in D");
  const int64_t d = cos.size(-1);
  TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.size(0) == q.size(0) &&
                  cos.is_contiguous() && sin.is_contiguous(),
              "rotary: cos and sin are contiguous [T, d]");
  TORCH_CHECK(d % 2 == 0 && d <= q.size(2), "rotary: d (", d, ") even and at most D");
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  return {rotate_heads(q, cp, sp, d), rotate_heads(k, cp, sp, d)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lorastream, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rotary(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(lorastream, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("rotary", rotary);
}
