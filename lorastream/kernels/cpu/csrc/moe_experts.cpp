// A MoE layer's routed experts at decode: each expert's few assignments times its weight, the
// weight streamed once, row by row, straight from where the model holds it.
//
// Registered as torch.ops.lorastream.expert_segments_mm. Semantics, shapes and the reference:
// lorastream/kernels/cpu/moe.py. Built with the other ops as one extension
// (lorastream/kernels/cpu/ops.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_common.h"

namespace {

using lorastream_cpu::check_float;
using lorastream_cpu::dot;

constexpr int64_t kBlock = 32;  // weight rows (output columns) per parallel task

void expert_segments_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& ends,
                        at::Tensor& out) {
  check_float(x, "expert_segments_mm", "x");
  check_float(w, "expert_segments_mm", "w");
  check_float(out, "expert_segments_mm", "out");
  const int64_t rows = x.size(0), k_in = x.size(1);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "expert_segments_mm: x is [P, K] contiguous");
  TORCH_CHECK(w.dim() == 3 && w.size(2) == k_in && w.stride(2) == 1,
              "expert_segments_mm: w is [E, N, K] with x's K and unit last stride");
  const int64_t experts = w.size(0), n_out = w.size(1);
  TORCH_CHECK(ends.scalar_type() == at::kLong && ends.device().is_cpu() && ends.dim() == 1 &&
                  ends.numel() == experts && ends.is_contiguous(),
              "expert_segments_mm: ends is a contiguous int64 CPU vector, one per expert");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == rows && out.size(1) == n_out &&
                  out.stride(1) == 1,
              "expert_segments_mm: out is [P, N] with unit column stride");
  const int64_t* ep = ends.data_ptr<int64_t>();
  std::vector<int64_t> starts(experts);
  int64_t start = 0;
  for (int64_t e = 0; e < experts; ++e) {  // checked once, before the threads start
    TORCH_CHECK(ep[e] >= start && ep[e] <= rows, "expert_segments_mm: ends not cumulative");
    starts[e] = start;
    start = ep[e];
  }
  TORCH_CHECK(start == rows, "expert_segments_mm: ends[-1] ", start, " is not x's rows ", rows);
  std::vector<int64_t> tasks;  // (expert, first column) of each block, experts with rows only
  const int64_t blocks = (n_out + kBlock - 1) / kBlock;
  for (int64_t e = 0; e < experts; ++e) {
    if (ep[e] > starts[e]) {
      for (int64_t b = 0; b < blocks; ++b) tasks.push_back(e * blocks + b);
    }
  }
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldw = w.stride(1), w_expert_stride = w.stride(0), ldo = out.stride(0);
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t e = tasks[task] / blocks, n0 = (tasks[task] % blocks) * kBlock;
      const int64_t n1 = std::min(n0 + kBlock, n_out);
      const float* we = wp + e * w_expert_stride;
      for (int64_t n = n0; n < n1; ++n) {  // one weight row, read from memory once
        const float* wn = we + n * ldw;
        for (int64_t p = starts[e]; p < ep[e]; ++p) op[p * ldo + n] = dot(xp + p * k_in, wn, k_in);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lorastream, m) {
  m.def("expert_segments_mm(Tensor x, Tensor w, Tensor ends, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(lorastream, CPU, m) { m.impl("expert_segments_mm", expert_segments_mm); }
