// The cores' multiply-add peak, per kind of product a decode step can run: the roofline that
// bounds a batch whose projections are multiply-bound (bench engine --quantization, the page's
// "Roofline"). Each thread runs ten independent accumulator chains of one instruction sequence in
// registers (no loads, no stores), enough chains to cover the latency on any AVX2 core, so the
// rate is the execution units' and nothing else's.
//
// Registered as torch.ops.lorastream.multiply_add_peak. Semantics and kinds:
// lorastream/kernels/cpu_peak.py. Built with the other ops as one extension (lorastream/kernels/cpu_ops.py).

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <chrono>
#include <cstdint>
#include <string>

#include "cpu_common.h"

namespace {

#ifdef LORASTREAM_AVX2

// Ten accumulators kept in registers across the loop: the empty asm says each may have changed,
// so the compiler neither hoists the loop-invariant products out nor folds the chains together.
#define LS_TEN(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9)
#define LS_PIN(a) \
  __asm__ volatile("" : "+x"(a##0), "+x"(a##1), "+x"(a##2), "+x"(a##3), "+x"(a##4), \
                   "+x"(a##5), "+x"(a##6), "+x"(a##7), "+x"(a##8), "+x"(a##9))

// fp32 FMA: 8 multiply-adds per instruction (vfmadd on ymm)
float fp32_fma(int64_t iterations) {
  __m256 x = _mm256_set1_ps(0.999f), y = _mm256_set1_ps(0.001f);
#define LS_INIT(j) __m256 a##j = _mm256_set1_ps(float(j));
  LS_TEN(LS_INIT)
#undef LS_INIT
  for (int64_t i = 0; i < iterations; ++i) {
#define LS_STEP(j) a##j = _mm256_fmadd_ps(a##j, x, y);
    LS_TEN(LS_STEP)
#undef LS_STEP
    LS_PIN(a);
  }
  __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                           _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
  s = _mm256_add_ps(s, _mm256_add_ps(a8, a9));
  return _mm256_cvtss_f32(s);
}

// Ten int32 accumulator chains a_j += step(u_j, w), u_j = lanes(j + 1): the integer kinds below
template <typename Lanes, typename Step>
float int_chains(int64_t iterations, Lanes lanes, __m256i w, Step step) {
#define LS_INIT(j) __m256i a##j = _mm256_setzero_si256(), u##j = lanes(j + 1);
  LS_TEN(LS_INIT)
#undef LS_INIT
  for (int64_t i = 0; i < iterations; ++i) {
#define LS_STEP(j) a##j = _mm256_add_epi32(a##j, step(u##j, w));
    LS_TEN(LS_STEP)
#undef LS_STEP
    LS_PIN(a);
    LS_PIN(u);
  }
  __m256i s = _mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi32(a2, a3));
  s = _mm256_add_epi32(s, _mm256_add_epi32(_mm256_add_epi32(a4, a5), _mm256_add_epi32(a6, a7)));
  s = _mm256_add_epi32(s, _mm256_add_epi32(a8, a9));
  return float(_mm256_extract_epi32(s, 0));
}

// 8-bit integers with exact int32 sums, as AVX2 kernels without VNNI multiply them (fbgemm's
// u8 x s8): vpmaddubsw (32 products, pairs summed into int16) + vpmaddwd by ones (pairs summed
// into int32) + vpaddd: 32 multiply-adds per group
float int8_madd(int64_t iterations) {
  const __m256i ones = _mm256_set1_epi16(1);
  return int_chains(
      iterations, [](int v) { return _mm256_set1_epi8(char(v)); }, _mm256_set1_epi8(-3),
      [ones](__m256i u, __m256i w) {
        return _mm256_madd_epi16(_mm256_maddubs_epi16(u, w), ones);
      });
}

// 16-bit integers with int32 sums: vpmaddwd (16 products, pairs summed into int32) + vpaddd
float int16_madd(int64_t iterations) {
  return int_chains(
      iterations, [](int v) { return _mm256_set1_epi16(short(v)); }, _mm256_set1_epi16(-3),
      [](__m256i u, __m256i w) { return _mm256_madd_epi16(u, w); });
}

#undef LS_PIN
#undef LS_TEN

#endif  // LORASTREAM_AVX2

// multiply-adds per iteration of one thread's loop (ten chains), and the loop
struct Kind {
  int64_t per_iteration;
  float (*run)(int64_t);
};

Kind kind_of(const std::string& kind) {
#ifdef LORASTREAM_AVX2
  if (kind == "fp32") return {10 * 8, fp32_fma};
  if (kind == "int8") return {10 * 32, int8_madd};
  if (kind == "int16") return {10 * 16, int16_madd};
  TORCH_CHECK(false, "multiply_add_peak: kind is fp32, int8 or int16, not '", kind, "'");
#else
  TORCH_CHECK(false, "multiply_add_peak: built without AVX2 and FMA (this CPU or compiler)");
#endif
  return {0, nullptr};
}

volatile float sink;  // each thread's result lands here: the loops cannot be dropped

// Multiply-adds per second over ``threads`` threads (torch's intra-op pool), each running
// ``iterations`` iterations; wall time from before the first starts to after the last ends.
double multiply_add_peak(const std::string& kind, int64_t iterations, int64_t threads) {
  TORCH_CHECK(iterations > 0, "multiply_add_peak: iterations must be positive");
  TORCH_CHECK(threads > 0 && threads <= at::get_num_threads(), "multiply_add_peak: threads is 1 "
              "to torch's thread count (", at::get_num_threads(), "), not ", threads);
  const Kind k = kind_of(kind);
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) sink = k.run(iterations);
  });
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return double(k.per_iteration) * double(iterations) * double(threads) / seconds;
}

}  // namespace

// no tensor argument to dispatch on: one kernel for every dispatch key
TORCH_LIBRARY_FRAGMENT(lorastream, m) {
  m.def("multiply_add_peak(str kind, int iterations, int threads) -> float", multiply_add_peak);
}
