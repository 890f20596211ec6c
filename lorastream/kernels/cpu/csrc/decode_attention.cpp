// Decode attention over the paged KV cache on the CPU, read in place (no gathered copy).
//
// Two ops, registered as torch.ops.lorastream.decode_scores / decode_values; the softmax between
// them is torch's. Semantics, shapes and the reference: lorastream/kernels/cpu_attention.py. Built once by
// torch.utils.cpp_extension at first use, with lora_rows.cpp as one extension
// (lorastream/kernels/cpu_ops.py).
//
// Layout (kv_cache.py): cache [blocks, bs, kvh, d]; token p of row b lives in block
// tables[b, p / bs] at row p % bs. Row b's query sees positions lo .. context[b] - 1 with
// lo = max(0, context[b] - window) (window <= 0: lo = 0); its score row starts at position
// first * bs, first = lo / bs, the first block it gathers, as attention.py's torch path lays it
// out. Query head i reads kv head i / (H / kvh) (GQA, as transformers' repeat_kv).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace {

struct Span {
  int64_t lo, hi, first;  // visible positions [lo, hi); the score row starts at first * bs
};

inline Span span_of(int64_t context, int64_t window, int64_t bs) {
  const int64_t lo = window > 0 ? std::max<int64_t>(0, context - window) : 0;
  return {lo, context, lo / bs};
}

// Calls f(p, entry) for each visible position p of a span in block order, entry = the [d] of this
// kv head at p: cache[table[p / bs], p % bs] (cache already offset to the head; row_stride =
// kvh * d floats between the rows of a block).
template <typename F>
inline void for_each_position(const float* cache, const int64_t* table, Span s, int64_t bs,
                              int64_t row_stride, F&& f) {
  for (int64_t blk = s.first; blk * bs < s.hi; ++blk) {
    const float* block = cache + table[blk] * bs * row_stride;
    const int64_t p0 = std::max(blk * bs, s.lo), p1 = std::min((blk + 1) * bs, s.hi);
    for (int64_t p = p0; p < p1; ++p) f(p, block + (p - blk * bs) * row_stride);
  }
}

// The scores of one kv head's g query heads: q [g, d], out [g, width] (row stride width).
// DT > 0 fixes the head size at compile time (unrolled); 0 reads it from d.
template <int64_t DT>
void scores_of_head(const float* q, const float* k, const int64_t* table, Span s, int64_t bs,
                    int64_t kvh, int64_t d_rt, int64_t g, float scale, float cap, float* out,
                    int64_t width) {
  const int64_t d = DT > 0 ? DT : d_rt;
  const int64_t base = s.first * bs;
  const float neg = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < g; ++j) {  // positions gathered but not visible
    float* row = out + j * width;
    std::fill(row, row + (s.lo - base), neg);
    std::fill(row + (s.hi - base), row + width, neg);
  }
  for_each_position(k, table, s, bs, kvh * d, [&](int64_t p, const float* key) {
    for (int64_t j = 0; j < g; ++j) {
      const float* qj = q + j * d;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < d; ++i) dot += qj[i] * key[i];
      float v = dot * scale;
      if (cap > 0.f) v = cap * std::tanh(v / cap);
      out[j * width + (p - base)] = v;
    }
  });
}

// One kv head's g output rows: o [g, d] = sum_p w[j, p] * value[p] over the visible positions.
template <int64_t DT>
void values_of_head(const float* w, const float* v, const int64_t* table, Span s, int64_t bs,
                    int64_t kvh, int64_t d_rt, int64_t g, int64_t width, float* o) {
  const int64_t d = DT > 0 ? DT : d_rt;
  const int64_t base = s.first * bs;
  std::fill(o, o + g * d, 0.f);
  for_each_position(v, table, s, bs, kvh * d, [&](int64_t p, const float* val) {
    for (int64_t j = 0; j < g; ++j) {
      const float wp = w[j * width + (p - base)];
      float* oj = o + j * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) oj[i] += wp * val[i];
    }
  });
}

struct Shapes {
  int64_t rows, heads, d, bs, kvh, nb, g, width;
};

Shapes check(const at::Tensor& rows_hd, const at::Tensor& cache, const at::Tensor& tables,
             const at::Tensor& context, const at::Tensor& by_position, int64_t window) {
  TORCH_CHECK(rows_hd.dim() == 3 && cache.dim() == 4 && tables.dim() == 2 &&
                  context.dim() == 1 && by_position.dim() == 3,
              "decode attention: q/out [B, H, d], cache [blocks, bs, kvh, d], tables [B, nb], "
              "context [B], scores/probs [B, H, width]");
  for (const at::Tensor* t : {&rows_hd, &cache, &by_position}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->device().is_cpu(),
                "decode attention: float32 contiguous CPU tensors only");
  }
  for (const at::Tensor* t : {&tables, &context}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->device().is_cpu(),
                "decode attention: tables and context are int64 contiguous CPU tensors");
  }
  Shapes s{rows_hd.size(0), rows_hd.size(1), rows_hd.size(2), cache.size(1), cache.size(2),
           tables.size(1), 0, by_position.size(2)};
  TORCH_CHECK(cache.size(3) == s.d, "decode attention: head size ", s.d, " vs cache ",
              cache.size(3));
  TORCH_CHECK(s.kvh > 0 && s.heads % s.kvh == 0, "decode attention: ", s.heads,
              " query heads over ", s.kvh, " kv heads");
  TORCH_CHECK(tables.size(0) == s.rows && context.size(0) == s.rows &&
                  by_position.size(0) == s.rows && by_position.size(1) == s.heads,
              "decode attention: row counts differ");
  s.g = s.heads / s.kvh;
  const int64_t* cp = context.data_ptr<int64_t>();
  for (int64_t b = 0; b < s.rows; ++b) {
    const Span sp = span_of(cp[b], window, s.bs);
    TORCH_CHECK(cp[b] >= 1 && cp[b] <= s.nb * s.bs, "decode attention: context ", cp[b],
                " of row ", b, " outside 1..", s.nb * s.bs);
    TORCH_CHECK(sp.hi - sp.first * s.bs <= s.width, "decode attention: row ", b, " needs ",
                sp.hi - sp.first * s.bs, " score columns, width is ", s.width);
  }
  return s;
}

// Runs f(DT, b, h, span, first_head) for every row b and kv head h, split over torch's threads;
// DT is the head size as a compile-time constant where it is 64 or 128, else 0 (read at run time).
template <typename F>
void for_each_head(const Shapes& s, const int64_t* context, int64_t window, F&& f) {
  at::parallel_for(0, s.rows * s.kvh, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / s.kvh, h = task % s.kvh;
      const Span span = span_of(context[b], window, s.bs);
      const int64_t first_head = b * s.heads + h * s.g;
      if (s.d == 64) {
        f(std::integral_constant<int64_t, 64>{}, b, h, span, first_head);
      } else if (s.d == 128) {
        f(std::integral_constant<int64_t, 128>{}, b, h, span, first_head);
      } else {
        f(std::integral_constant<int64_t, 0>{}, b, h, span, first_head);
      }
    }
  });
}

void decode_scores(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& tables,
                   const at::Tensor& context, double scale, int64_t window, double softcap,
                   at::Tensor& scores) {
  const Shapes s = check(q, k_cache, tables, context, scores, window);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  float* sp = scores.data_ptr<float>();
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);
  for_each_head(s, context.data_ptr<int64_t>(), window,
                [&](auto dt, int64_t b, int64_t h, Span span, int64_t first_head) {
                  scores_of_head<decltype(dt)::value>(
                      qp + first_head * s.d, kp + h * s.d, tp + b * s.nb, span, s.bs, s.kvh,
                      s.d, s.g, fscale, cap, sp + first_head * s.width, s.width);
                });
}

void decode_values(const at::Tensor& probs, const at::Tensor& v_cache, const at::Tensor& tables,
                   const at::Tensor& context, int64_t window, at::Tensor& out) {
  const Shapes s = check(out, v_cache, tables, context, probs, window);
  const float* pp = probs.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  for_each_head(s, context.data_ptr<int64_t>(), window,
                [&](auto dt, int64_t b, int64_t h, Span span, int64_t first_head) {
                  values_of_head<decltype(dt)::value>(
                      pp + first_head * s.width, vp + h * s.d, tp + b * s.nb, span, s.bs, s.kvh,
                      s.d, s.g, s.width, op + first_head * s.d);
                });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lorastream, m) {
  m.def(
      "decode_scores(Tensor q, Tensor k_cache, Tensor tables, Tensor context, float scale, "
      "int window, float softcap, Tensor(a!) scores) -> ()");
  m.def(
      "decode_values(Tensor probs, Tensor v_cache, Tensor tables, Tensor context, int window, "
      "Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(lorastream, CPU, m) {
  m.impl("decode_scores", decode_scores);
  m.impl("decode_values", decode_values);
}
