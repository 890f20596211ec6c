// What the C++ CPU ops share: the AVX2 switch, the check of a float32 CPU tensor argument, the
// grain of their parallel loops and the fp32 dot product of the row-by-row products.
// Copied beside the sources into each build (lorastream/kernels/cpu_ops.py), and part of its digest.

#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LORASTREAM_AVX2 1
#endif

namespace lorastream_cpu {

// ``op: name must be a float32 CPU tensor`` unless it is one
inline void check_float(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu(), op, ": ", name,
              " must be a float32 CPU tensor");
}

// Items per parallel task (at::parallel_for's grain): enough that a task holds about 64 Ki
// units of work (elements, or bytes), so that a thread's start is small beside its work
inline int64_t grain(int64_t work_per_item) {
  return std::max<int64_t>(1, 65536 / std::max<int64_t>(work_per_item, 1));
}

#ifdef LORASTREAM_AVX2
// the sum of v's 8 lanes
inline float hsum(__m256 v) {
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  q = _mm_hadd_ps(q, q);
  return _mm_cvtss_f32(_mm_hadd_ps(q, q));
}
#endif

// Floats ahead of a streamed weight that dot() asks the cache for: hardware prefetchers stop
// at each 4 KiB page, and the row-by-row ops read weights in page-sized rows
constexpr int64_t kPrefetchAhead = 512;

// sum_i x[i] * a[i], i < n: four 8-lane FMA chains side by side, then the scalar tail; ``a``
// (the weight, read once) is prefetched kPrefetchAhead floats ahead, past its end too (the next
// row of a contiguous weight; a prefetch never faults)
inline float dot(const float* x, const float* a, int64_t n) {
  int64_t i = 0;
  float acc = 0.f;
#ifdef LORASTREAM_AVX2
  __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
  for (; i + 32 <= n; i += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(a + i + kPrefetchAhead), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(a + i + kPrefetchAhead + 16), _MM_HINT_T0);
    c0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(a + i), c0);
    c1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(a + i + 8), c1);
    c2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 16), _mm256_loadu_ps(a + i + 16), c2);
    c3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 24), _mm256_loadu_ps(a + i + 24), c3);
  }
  for (; i + 8 <= n; i += 8) {
    c0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(a + i), c0);
  }
  acc = hsum(_mm256_add_ps(_mm256_add_ps(c0, c1), _mm256_add_ps(c2, c3)));
#endif
  for (; i < n; ++i) acc += x[i] * a[i];
  return acc;
}

}  // namespace lorastream_cpu
