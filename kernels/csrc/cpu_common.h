// What the C++ CPU ops share: the AVX2 switch and the check of a float32 CPU tensor argument.
// Copied beside the sources into each build (kernels/cpu_ops.py), and part of its digest.

#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

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

}  // namespace lorastream_cpu
