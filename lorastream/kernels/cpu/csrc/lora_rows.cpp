// The LoRA delta of decode-like steps on the CPU: each row's adapter read once, straight from the
// slot storage, the delta added into the projection's output in place.
//
// Registered as torch.ops.lorastream.lora_rows (slot-major rows) and expert_lora_rows (a MoE
// layer's (token, expert) assignments). Semantics, shapes and the reference:
// lorastream/kernels/cpu/lora.py. Built with decode_attention.cpp as one extension (lorastream/kernels/cpu_ops.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "cpu_common.h"

namespace {

using lorastream_cpu::check_float;
using lorastream_cpu::dot;

#ifdef LORASTREAM_AVX2
using lorastream_cpu::hsum;

// lanes where the chunk of 8 starting at ``k0`` is below ``rank``
inline __m256i lanes_below(int64_t k0, int64_t rank) {
  const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(k0)),
                                       _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(rank)), idx);
}
#endif

// o[n] += s * sum_{k < rank} h[k] * b[n * ldb + k] for n < n_rows. Eight rows of b at a time:
// their 8-lane products reduced into one vector of 8 sums (a transposing hadd tree), added into
// o with one FMA.
void expand(const float* b, int64_t ldb, const float* h, int64_t rank, int64_t n_rows, float s,
            float* o) {
  int64_t n = 0;
#ifdef LORASTREAM_AVX2
  const int64_t chunks = (rank + 7) / 8;
  if (chunks > 0) {
    const __m256 sv = _mm256_set1_ps(s);
    // the last chunk's lanes at or past rank are read neither from b (they may lie past its
    // row) nor from h (another group's, or past its end): both load as zero
    const __m256i tail = lanes_below((chunks - 1) * 8, rank);
    const __m256 h_tail = _mm256_maskload_ps(h + (chunks - 1) * 8, tail);
    auto row = [&](const float* bn) {  // 8 lanes whose sum is h . b[n, :rank]
      __m256 v = _mm256_mul_ps(_mm256_maskload_ps(bn + (chunks - 1) * 8, tail), h_tail);
      for (int64_t c = 0; c + 1 < chunks; ++c) {
        v = _mm256_fmadd_ps(_mm256_loadu_ps(bn + c * 8), _mm256_loadu_ps(h + c * 8), v);
      }
      return v;
    };
    for (; n + 8 <= n_rows; n += 8) {
      __m256 v[8];
      for (int j = 0; j < 8; ++j) v[j] = row(b + (n + j) * ldb);
      const __m256 c0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
      const __m256 c1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
      // c0 = [rows 0-3, low lanes | rows 0-3, high lanes], c1 the same for rows 4-7
      const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(c0, c1, 0x20),
                                        _mm256_permute2f128_ps(c0, c1, 0x31));
      _mm256_storeu_ps(o + n, _mm256_fmadd_ps(sv, sums, _mm256_loadu_ps(o + n)));
    }
    for (; n < n_rows; ++n) o[n] += s * hsum(row(b + n * ldb));
  }
  return;
#endif
  for (; n < n_rows; ++n) {
    float acc = 0.f;
    for (int64_t k = 0; k < rank; ++k) acc += h[k] * b[n * ldb + k];
    o[n] += s * acc;
  }
}

void lora_rows(const at::Tensor& x, const at::Tensor& a, at::TensorList bs, at::IntArrayRef cols,
               const at::Tensor& scale, int64_t slot_lo, int64_t per_slot, int64_t rank,
               at::Tensor& out) {
  check_float(x, "lora_rows", "x");
  check_float(a, "lora_rows", "a");
  check_float(scale, "lora_rows", "scale");
  check_float(out, "lora_rows", "out");
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
    check_float(b, "lora_rows", "b");
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
          h[g * r_slot + k] = dot(xt, a_slot + (g * r_slot + k) * k_in, k_in);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        expand(b_ptr[g] + slot * b_slot_stride[g], r_slot, h.data() + g * r_slot, rank,
               b_rows[g], s, op + t * ldo + cols[g]);
      }
    }
  });
}

// A MoE layer's expert deltas, one (token, expert) assignment at a time: the assignment's
// (slot, expert) A and B read where the expert storage holds them, the delta added in place.
void expert_lora_rows(const at::Tensor& x, const at::Tensor& token, const at::Tensor& expert,
                      const at::Tensor& row_slot, const at::Tensor& row_scale, const at::Tensor& a,
                      at::TensorList bs, at::IntArrayRef cols, int64_t rank, at::Tensor& out) {
  check_float(x, "expert_lora_rows", "x");
  check_float(a, "expert_lora_rows", "a");
  check_float(row_scale, "expert_lora_rows", "row_scale");
  check_float(out, "expert_lora_rows", "out");
  const int64_t rows = x.size(0), k_in = x.size(1), group = static_cast<int64_t>(bs.size());
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "expert_lora_rows: x is [P, K] contiguous");
  TORCH_CHECK(a.dim() == 4 && a.size(3) == k_in && a.stride(3) == 1 && a.stride(2) == k_in,
              "expert_lora_rows: a is [S, E, G*R, K] with x's K, each [G*R, K] contiguous");
  TORCH_CHECK(group >= 1 && static_cast<int64_t>(cols.size()) == group && a.size(2) % group == 0,
              "expert_lora_rows: one column offset per B, and a's rows a multiple of their count");
  const int64_t slots = a.size(0), experts = a.size(1), r_slot = a.size(2) / group;
  TORCH_CHECK(rank >= 0 && rank <= r_slot, "expert_lora_rows: rank ", rank, " outside 0..", r_slot);
  for (const at::Tensor* t : {&token, &expert, &row_slot}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->device().is_cpu() && t->dim() == 1 &&
                    t->is_contiguous(),
                "expert_lora_rows: token, expert and row_slot are contiguous int64 CPU vectors");
  }
  TORCH_CHECK(token.numel() == rows && expert.numel() == rows,
              "expert_lora_rows: one token and one expert per row of x");
  const int64_t tokens = row_slot.numel();
  TORCH_CHECK(row_scale.numel() == tokens && row_scale.is_contiguous(),
              "expert_lora_rows: one scale per token");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == rows && out.stride(1) == 1,
              "expert_lora_rows: out is [P, N_total] with unit column stride");
  std::vector<const float*> b_ptr(group);
  std::vector<int64_t> b_rows(group), b_ld(group), b_slot_stride(group), b_expert_stride(group);
  for (int64_t g = 0; g < group; ++g) {
    const at::Tensor& b = bs[g];
    check_float(b, "expert_lora_rows", "b");
    TORCH_CHECK(b.dim() == 4 && b.size(0) == slots && b.size(1) == experts &&
                    b.size(3) == r_slot && b.stride(3) == 1,
                "expert_lora_rows: each b is [S, E, N, R], S, E and R as a's, unit last stride");
    TORCH_CHECK(cols[g] >= 0 && cols[g] + b.size(2) <= out.size(1),
                "expert_lora_rows: columns ", cols[g], "..", cols[g] + b.size(2), " outside out");
    b_ptr[g] = b.data_ptr<float>();
    b_rows[g] = b.size(2);
    b_ld[g] = b.stride(2);
    b_slot_stride[g] = b.stride(0);
    b_expert_stride[g] = b.stride(1);
  }
  const float* xp = x.data_ptr<float>();
  const int64_t* tp = token.data_ptr<int64_t>();
  const int64_t* ep = expert.data_ptr<int64_t>();
  const int64_t* slot_of = row_slot.data_ptr<int64_t>();
  const float* scale_of = row_scale.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldo = out.stride(0), a_rows = a.size(2);
  const int64_t a_slot_stride = a.stride(0), a_expert_stride = a.stride(1);
  for (int64_t p = 0; p < rows; ++p) {  // checked once, before the threads start
    TORCH_CHECK(tp[p] >= 0 && tp[p] < tokens && ep[p] >= 0 && ep[p] < experts,
                "expert_lora_rows: row ", p, " names token ", tp[p], ", expert ", ep[p]);
  }
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> h(a_rows);  // [G*R] this assignment's shrunk input
    for (int64_t p = begin; p < end; ++p) {
      const int64_t t = tp[p], slot = slot_of[t];
      const float s = scale_of[t];
      if (slot < 0 || slot >= slots || s == 0.f) continue;  // no expert adapter
      const int64_t e = ep[p];
      const float* xr = xp + p * k_in;
      const float* a_se = ap + slot * a_slot_stride + e * a_expert_stride;
      for (int64_t g = 0; g < group; ++g) {
        for (int64_t k = 0; k < rank; ++k) {
          h[g * r_slot + k] = dot(xr, a_se + (g * r_slot + k) * k_in, k_in);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        expand(b_ptr[g] + slot * b_slot_stride[g] + e * b_expert_stride[g], b_ld[g],
               h.data() + g * r_slot, rank, b_rows[g], s, op + p * ldo + cols[g]);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lorastream, m) {
  m.def(
      "lora_rows(Tensor x, Tensor a, Tensor[] bs, int[] cols, Tensor scale, int slot_lo, "
      "int per_slot, int rank, Tensor(a!) out) -> ()");
  m.def(
      "expert_lora_rows(Tensor x, Tensor token, Tensor expert, Tensor row_slot, "
      "Tensor row_scale, Tensor a, Tensor[] bs, int[] cols, int rank, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(lorastream, CPU, m) {
  m.impl("lora_rows", lora_rows);
  m.impl("expert_lora_rows", expert_lora_rows);
}
