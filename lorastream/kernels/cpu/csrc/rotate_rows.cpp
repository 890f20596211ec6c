// int8-dynamic's input rotation on the CPU: each row's blocks through a fast Walsh-Hadamard
// transform, then the small orthogonal factor across the blocks, in one pass per row.
//
// Registered as torch.ops.lorastream.rotate_rows. Semantics, shapes and the reference:
// lorastream/kernels/cpu_rotation.py. Built with the other ops as one extension (lorastream/kernels/cpu_ops.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "cpu_common.h"

namespace {

// v [b] <- v @ H_b (unnormalized Sylvester-Hadamard, b a power of two), in place: the butterfly
// of stage h pairs entries h apart, (u, w) -> (u + w, u - w).
void walsh_hadamard(float* v, int64_t b) {
  int64_t h = 1;
#ifdef LORASTREAM_AVX2
  if (b >= 8) {
    // stages 1, 2 and 4 inside each 8-float register: swap partners, add, subtract, blend
    for (int64_t i = 0; i < b; i += 8) {
      __m256 x = _mm256_loadu_ps(v + i);
      __m256 p = _mm256_permute_ps(x, 0b10110001);  // partners 1 apart
      x = _mm256_blend_ps(_mm256_add_ps(x, p), _mm256_sub_ps(p, x), 0b10101010);
      p = _mm256_permute_ps(x, 0b01001110);  // partners 2 apart
      x = _mm256_blend_ps(_mm256_add_ps(x, p), _mm256_sub_ps(p, x), 0b11001100);
      p = _mm256_permute2f128_ps(x, x, 1);  // partners 4 apart
      x = _mm256_blend_ps(_mm256_add_ps(x, p), _mm256_sub_ps(p, x), 0b11110000);
      _mm256_storeu_ps(v + i, x);
    }
    for (h = 8; h < b; h *= 2) {  // whole registers h apart
      for (int64_t i = 0; i < b; i += 2 * h) {
        for (int64_t j = i; j < i + h; j += 8) {
          const __m256 u = _mm256_loadu_ps(v + j), w = _mm256_loadu_ps(v + j + h);
          _mm256_storeu_ps(v + j, _mm256_add_ps(u, w));
          _mm256_storeu_ps(v + j + h, _mm256_sub_ps(u, w));
        }
      }
    }
    return;
  }
#endif
  for (; h < b; h *= 2) {
    for (int64_t i = 0; i < b; i += 2 * h) {
      for (int64_t j = i; j < i + h; ++j) {
        const float u = v[j], w = v[j + h];
        v[j] = u + w;
        v[j + h] = u - w;
      }
    }
  }
}

// dst [a, b] = left [a, a] @ blocks [a, b]
void mix_blocks(float* dst, const float* blocks, const float* left, int64_t a, int64_t b) {
  int64_t col = 0;
#ifdef LORASTREAM_AVX2
  for (; col + 8 <= b; col += 8) {
    for (int64_t i = 0; i < a; ++i) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t j = 0; j < a; ++j) {
        acc = _mm256_fmadd_ps(_mm256_set1_ps(left[i * a + j]),
                              _mm256_loadu_ps(blocks + j * b + col), acc);
      }
      _mm256_storeu_ps(dst + i * b + col, acc);
    }
  }
#endif
  for (; col < b; ++col) {
    for (int64_t i = 0; i < a; ++i) {
      float acc = 0.0f;
      for (int64_t j = 0; j < a; ++j) acc += left[i * a + j] * blocks[j * b + col];
      dst[i * b + col] = acc;
    }
  }
}

// The largest |v[i]| of v [k].
float abs_max(const float* v, int64_t k) {
  float best = 0.0f;
  int64_t i = 0;
#ifdef LORASTREAM_AVX2
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= k; i += 8) {
    acc = _mm256_max_ps(acc, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + i)));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float lane : lanes) best = std::max(best, lane);
#endif
  for (; i < k; ++i) best = std::max(best, std::fabs(v[i]));
  return best;
}

// The rotation of row t of x into out_row [k] (blocks: [k] scratch where a > 1).
void rotate_row(const float* row, float* out_row, float* blocks, const float* left, int64_t a,
                int64_t b, float norm) {
  const int64_t k = a * b;
  float* v = a > 1 ? blocks : out_row;  // a = 1: transform in the output row
  for (int64_t i = 0; i < k; ++i) v[i] = row[i] * norm;
  for (int64_t i = 0; i < a; ++i) walsh_hadamard(v + i * b, b);
  if (a > 1) mix_blocks(out_row, v, left, a, b);
}

void check_args(const at::Tensor& x, const at::Tensor& left, int64_t b, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu() && x.dim() == 2 &&
                  x.is_contiguous(),
              op, ": x must be a contiguous [T, K] float32 CPU tensor");
  TORCH_CHECK(b >= 1 && (b & (b - 1)) == 0 && x.size(1) % b == 0,
              op, ": b must be a power of two dividing K");
  const int64_t a = x.size(1) / b;
  TORCH_CHECK(left.scalar_type() == at::kFloat && left.device().is_cpu() && left.dim() == 2 &&
                  left.size(0) == a && left.size(1) == a && left.is_contiguous(),
              op, ": left must be a contiguous [a, a] float32 CPU tensor, a = K / b");
}

// out [T, K] <- each row of x rotated, then finish(t, out row) in the same pass (over rows, on
// torch's threads)
template <typename Finish>
at::Tensor rotate_each_row(const at::Tensor& x, const at::Tensor& left, int64_t b,
                           const char* op, Finish&& finish) {
  check_args(x, left, b, op);
  const int64_t rows = x.size(0), k = x.size(1), a = k / b;
  at::Tensor out = at::empty({rows, k}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* lp = left.data_ptr<float>();
  float* outp = out.data_ptr<float>();
  const float norm = 1.0f / std::sqrt(static_cast<float>(b));
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> blocks(a > 1 ? k : 0);  // [a, b] the row's blocks, transformed
    for (int64_t t = begin; t < end; ++t) {
      rotate_row(xp + t * k, outp + t * k, blocks.data(), lp, a, b, norm);
      finish(t, outp + t * k, k);
    }
  });
  return out;
}

at::Tensor rotate_rows(const at::Tensor& x, const at::Tensor& left, int64_t b) {
  return rotate_each_row(x, left, b, "rotate_rows", [](int64_t, float*, int64_t) {});
}

// The rotated rows scaled to [-qmax, qmax] by their largest |value|, and each row's step.
std::tuple<at::Tensor, at::Tensor> rotate_scale_rows(const at::Tensor& x, const at::Tensor& left,
                                                     int64_t b, double qmax) {
  at::Tensor step = at::empty({x.size(0), 1}, x.options());
  float* sp = step.data_ptr<float>();
  const float q = static_cast<float>(qmax);
  at::Tensor out = rotate_each_row(x, left, b, "rotate_scale_rows",
                                   [&](int64_t t, float* o, int64_t k) {
    const float amax = std::max(abs_max(o, k), 1e-12f);
    const float inv = (1.0f / amax) * q;  // torch's qmax / amax: reciprocal, then times qmax
    int64_t i = 0;
#ifdef LORASTREAM_AVX2
    const __m256 f = _mm256_set1_ps(inv);
    for (; i + 8 <= k; i += 8) _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(o + i), f));
#endif
    for (; i < k; ++i) o[i] *= inv;
    sp[t] = amax / q;
  });
  return {out, step};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lorastream, m) {
  m.def("rotate_rows(Tensor x, Tensor left, int b) -> Tensor");
  m.def("rotate_scale_rows(Tensor x, Tensor left, int b, float qmax) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(lorastream, CPU, m) {
  m.impl("rotate_rows", rotate_rows);
  m.impl("rotate_scale_rows", rotate_scale_rows);
}
