// The LoRA delta of decode-like steps on the CPU: each row's adapter read once, straight from the
// slot storage, the delta added into the projection's output in place.
//
// Registered as torch.ops.lorastream.lora_rows. Semantics, shapes and the reference:
// kernels/cpu_lora.py. Built with decode_attention.cpp as one extension (kernels/cpu_ops.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

namespace {

void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu(), "lora_rows: ", name,
              " must be a float32 CPU tensor");
}

void lora_rows(const at::Tensor& x, const at::Tensor& a, at::TensorList bs, at::IntArrayRef cols,
               const at::Tensor& scale, int64_t slot_lo, int64_t per_slot, int64_t rank,
               at::Tensor& out) {
  check_float(x, "x");
  check_float(a, "a");
  check_float(scale, "scale");
  check_float(out, "out");
  const int64_t rows = x.size(0), k_in = x.size(1), group = static_cast<int64_t>(bs.size());
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "lora_rows: x is [T, K] contiguous");
  TORCH_CHECK(a.dim() == 3 && a.size(2) == k_in && a.stride(2) == 1 && a.stride(1) == k_in,
              "lora_rows: a is [S, G*R, K] with x's K, each slot's [G*R, K] contiguous");
  TORCH_CHECK(group >= 1 && static_cast<int64_t>(cols.size()) == group && a.size(1) % group == 0,
              "lora_rows: one column offset per B, and a's rows a multiple of their count");
  const int64_t r_slot = a.size(1) / group;
  TORCH_CHECK(rank >= 0 && rank <= r_slot, "lora_rows: rank ", rank, " outside 0..", r_slot);
  TORCH_CHECK(per_slot >= 1 && slot_lo >= 0 &&
                  slot_lo + (rows + per_slot - 1) / per_slot <= a.size(0),
              "lora_rows: rows map past the slots");
  TORCH_CHECK(scale.numel() == rows && scale.is_contiguous(), "lora_rows: one scale per row");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == rows && out.stride(1) == 1,
              "lora_rows: out is [T, N_total] with unit column stride");
  std::vector<const float*> b_ptr(group);
  std::vector<int64_t> b_rows(group), b_slot_stride(group);
  for (int64_t g = 0; g < group; ++g) {
    const at::Tensor& b = bs[g];
    check_float(b, "b");
    TORCH_CHECK(b.dim() == 3 && b.size(0) == a.size(0) && b.size(2) == r_slot &&
                    b.stride(2) == 1 && b.stride(1) == r_slot,
                "lora_rows: each b is [S, N, R], R as a's, each slot's [N, R] contiguous");
    TORCH_CHECK(cols[g] >= 0 && cols[g] + b.size(1) <= out.size(1),
                "lora_rows: columns ", cols[g], "..", cols[g] + b.size(1), " outside out");
    b_ptr[g] = b.data_ptr<float>();
    b_rows[g] = b.size(1);
    b_slot_stride[g] = b.stride(0);
  }
  const float* xp = x.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  const float* sp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldo = out.stride(0), a_rows = a.size(1), a_slot_stride = a.stride(0);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> h(a_rows);  // [G*R] this row's shrunk input
    for (int64_t t = begin; t < end; ++t) {
      const float s = sp[t];
      if (s == 0.f) continue;  // a base-model row
      const int64_t slot = slot_lo + t / per_slot;
      const float* xt = xp + t * k_in;
      const float* a_slot = ap + slot * a_slot_stride;
      for (int64_t g = 0; g < group; ++g) {
        for (int64_t k = 0; k < rank; ++k) {
          const float* ak = a_slot + (g * r_slot + k) * k_in;
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int64_t i = 0; i < k_in; ++i) acc += xt[i] * ak[i];
          h[g * r_slot + k] = acc;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        const float* b = b_ptr[g] + slot * b_slot_stride[g];
        const float* hg = h.data() + g * r_slot;
        float* o = op + t * ldo + cols[g];
        for (int64_t n = 0; n < b_rows[g]; ++n) {
          const float* bn = b + n * r_slot;
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int64_t k = 0; k < rank; ++k) acc += hg[k] * bn[k];
          o[n] += s * acc;
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lorastream, m) {
  m.def(
      "lora_rows(Tensor x, Tensor a, Tensor[] bs, int[] cols, Tensor scale, int slot_lo, "
      "int per_slot, int rank, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(lorastream, CPU, m) { m.impl("lora_rows", lora_rows); }
