// int8 weight-only product on the CPU: fp32 activations times int8 weights with per-output
// scales, fp32 sums, over weights packed once at load in blocks of 16 output channels
// ([N / 16, K, 16]: the 16 channels' weights at one k are 16 contiguous bytes).
//
// Few rows (decode of a few streams: the weights' bytes bound it) convert each 16 bytes and
// multiply them into every row at once. More rows convert a block to an fp32 panel once and run
// a 6 x 16 register tile over it (what the fp32 GEMMs do: 12 FMAs per 2 loads and 6 broadcasts).
//
// Registered as torch.ops.lorastream.int8_weight_mm. Semantics, shapes and the reference:
// lorastream/kernels/cpu_int8.py. Built with the other ops as one extension (lorastream/kernels/cpu_ops.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_common.h"

namespace {

constexpr int64_t kBlock = 16;    // output channels per packed block
constexpr int64_t kTile = 6;      // rows per register tile over a panel
constexpr int64_t kDirect = 4;    // up to this many rows: no panel

// out[r, 0:16] = sum_k x[r, k] * w[k, 0:16] for R rows, w the int8 block [K, 16]; P k's at a
// time in separate sums, so that at least 8 FMA chains run side by side
template <int64_t R>
void direct_rows(const float* x, int64_t ldx, const int8_t* w, int64_t k, float* out) {
  int64_t i = 0;
#ifdef LORASTREAM_AVX2
  constexpr int64_t P = R >= 4 ? 1 : (R >= 2 ? 2 : 4);
  __m256 acc[R][P][2];  // [row][k mod P][half of the 16 channels]
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t p = 0; p < P; ++p) acc[r][p][0] = acc[r][p][1] = _mm256_setzero_ps();
  }
  for (; i + P <= k; i += P) {
    for (int64_t p = 0; p < P; ++p) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (i + p) * 16));
      const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
      const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
      for (int64_t r = 0; r < R; ++r) {
        const __m256 xv = _mm256_broadcast_ss(x + r * ldx + i + p);
        acc[r][p][0] = _mm256_fmadd_ps(xv, lo, acc[r][p][0]);
        acc[r][p][1] = _mm256_fmadd_ps(xv, hi, acc[r][p][1]);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t p = 1; p < P; ++p) {
      acc[r][0][0] = _mm256_add_ps(acc[r][0][0], acc[r][p][0]);
      acc[r][0][1] = _mm256_add_ps(acc[r][0][1], acc[r][p][1]);
    }
    _mm256_storeu_ps(out + r * kBlock, acc[r][0][0]);
    _mm256_storeu_ps(out + r * kBlock + 8, acc[r][0][1]);
  }
#else
  for (int64_t r = 0; r < R * kBlock; ++r) out[r] = 0.0f;
#endif
  for (; i < k; ++i) {
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t c = 0; c < kBlock; ++c) out[r * kBlock + c] += x[r * ldx + i] * w[i * 16 + c];
    }
  }
}

// panel [K, 16] fp32 <- the int8 block [K, 16]
void fill_panel(const int8_t* w, int64_t k, float* panel) {
  int64_t i = 0;
#ifdef LORASTREAM_AVX2
  for (; i < k; ++i) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i * 16));
    _mm256_storeu_ps(panel + i * 16, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
    _mm256_storeu_ps(panel + i * 16 + 8,
                     _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8))));
  }
  return;
#endif
  for (; i < k * 16; ++i) panel[i] = static_cast<float>(w[i]);
}

// out[r, 0:16] = sum_k x[r, k] * panel[k, 0:16] for R (<= kTile) rows
template <int64_t R>
void panel_rows(const float* x, int64_t ldx, const float* panel, int64_t k, float* out) {
#ifdef LORASTREAM_AVX2
  __m256 acc[R][2];
  for (int64_t r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    const __m256 lo = _mm256_loadu_ps(panel + i * 16), hi = _mm256_loadu_ps(panel + i * 16 + 8);
    for (int64_t r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * ldx + i);
      acc[r][0] = _mm256_fmadd_ps(xv, lo, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xv, hi, acc[r][1]);
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * kBlock, acc[r][0]);
    _mm256_storeu_ps(out + r * kBlock + 8, acc[r][1]);
  }
#else
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < kBlock; ++c) {
      float s = 0.0f;
      for (int64_t i = 0; i < k; ++i) s += x[r * ldx + i] * panel[i * 16 + c];
      out[r * kBlock + c] = s;
    }
  }
#endif
}

// Rows of the next tile, ``left`` rows to go: ``step``, except that 7 and 8 left over a panel
// take a 4-row tile first (4 + 3, 4 + 4) rather than 6 + 1 or 6 + 2: a tile of 1 or 2 rows runs
// only 2 or 4 FMA chains, too few to fill the FMA units, which need 8 side by side
int64_t tile_rows(int64_t step, int64_t left) {
  if (step == kTile && (left == 7 || left == 8)) return 4;
  return std::min(step, left);
}

template <typename F>
void by_rows(int64_t r, F&& f) {
  switch (r) {
    case 6: f(std::integral_constant<int64_t, 6>{}); break;
    case 5: f(std::integral_constant<int64_t, 5>{}); break;
    case 4: f(std::integral_constant<int64_t, 4>{}); break;
    case 3: f(std::integral_constant<int64_t, 3>{}); break;
    case 2: f(std::integral_constant<int64_t, 2>{}); break;
    default: f(std::integral_constant<int64_t, 1>{}); break;
  }
}

at::Tensor int8_weight_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu() && x.dim() == 2 &&
                  x.is_contiguous(),
              "int8_weight_mm: x must be a contiguous [T, K] float32 CPU tensor");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.device().is_cpu() &&
                  packed.dim() == 3 && packed.is_contiguous() && packed.size(1) == x.size(1) &&
                  packed.size(2) == kBlock,
              "int8_weight_mm: packed must be a contiguous [ceil(N / 16), K, 16] int8 CPU "
              "tensor, K as x's");
  const int64_t rows = x.size(0), k = x.size(1), blocks = packed.size(0), n = scale.numel();
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.device().is_cpu() && scale.dim() == 1 &&
                  scale.is_contiguous() && (n + kBlock - 1) / kBlock == blocks,
              "int8_weight_mm: scale must be a contiguous [N] float32 CPU tensor, N / 16 "
              "rounded up the packed blocks");
  at::Tensor out = at::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // blocks per task: about 64 KB of weights
  at::parallel_for(0, blocks, lorastream_cpu::grain(k * kBlock), [&](int64_t begin, int64_t end) {
    std::vector<float> panel(rows > kDirect ? k * kBlock : 0);  // [K, 16]
    float tile[kTile * kBlock];  // [rows of a tile, 16]
    for (int64_t b = begin; b < end; ++b) {
      const int8_t* w = wp + b * k * kBlock;
      const int64_t n0 = b * kBlock, cols = std::min(kBlock, n - n0);
      if (rows > kDirect) fill_panel(w, k, panel.data());
      const int64_t step = rows > kDirect ? kTile : kDirect;
      for (int64_t t = 0, r = 0; t < rows; t += r) {
        r = tile_rows(step, rows - t);
        const float* xr = xp + t * k;
        by_rows(r, [&](auto tag) {
          constexpr int64_t R = decltype(tag)::value;
          if (rows > kDirect) {
            panel_rows<R>(xr, k, panel.data(), k, tile);
          } else if constexpr (R <= kDirect) {
            direct_rows<R>(xr, k, w, k, tile);
          }
        });
        for (int64_t i = 0; i < r; ++i) {
          float* dst = op + (t + i) * n + n0;
          for (int64_t c = 0; c < cols; ++c) dst[c] = tile[i * kBlock + c] * sp[n0 + c];
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lorastream, m) {
  m.def("int8_weight_mm(Tensor x, Tensor packed, Tensor scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(lorastream, CPU, m) { m.impl("int8_weight_mm", int8_weight_mm); }
