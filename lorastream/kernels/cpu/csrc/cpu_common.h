// What the C++ CPU ops share: the AVX2 switch, the check of a float32 CPU tensor argument and
// the grain of their parallel loops.
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

}  // namespace lorastream_cpu
