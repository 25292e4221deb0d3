// x @ W.T on a CPU with W kept as a GGUF file ships it: blocks of 32 weights along each output's
// inputs, a float16 scale (and, for Q4_1, a float16 offset) per block, codes of 4 or 8 bits; or
// the K-quants' and Q5 types' blocks, repacked at load into blocks of 32 with float32 scales (Kind below).
//
// Why a kernel: a decode step on a CPU is bound by reading the weights, and these blocks are a
// quarter to an eighth of float32's bytes. PyTorch's own weight-only CPU kernels reread the
// weights for every input row (docs/results.md, the kernel against PyTorch's), which verification must not
// do. Here each block is turned into floats in registers and multiplied by 4 input rows while it
// is there; a thread's slice of the weights is read once per 4 rows. From 9 rows on (long
// verifications, prompt chunks) each weight is decoded once into a float panel that every row
// then reads: the multiply is then bound by the float multiply-adds (about 1.8 ms a row for the
// embedded model on 2 AVX2 cores), no longer by decoding.
//
// Exactness: block values are computed as the GGUF reference does (q * d + m, exact in float32),
// and each output's sum runs in one fixed order (8 float32 lanes over the blocks, then the lanes
// in a fixed tree) whatever the number of rows or threads. A row's outputs are therefore the same
// bits alone and among others (what deterministic mode needs of every Linear).
//
// quant_linear_q8.cpp is the same product with int8 activations, llama.cpp's scheme.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "kernels.h"
#include "quant_blocks.h"

namespace {

using namespace nasd_blocks;

constexpr int64_t kRowTile = 4;  // input rows multiplied per pass over a tile of outputs
// From this many rows on, dequantizing each weight once into a float panel beats dequantizing it
// in registers once per row tile; below it the panel's stores and loads cost more than the repeated
// decoding (docs/results.md).
constexpr int64_t kPanelMinRows = 9;

#ifdef NASD_AVX2
using nasd_simd::lanes_sum;

// Outs consecutive outputs times Rows rows of `x`. Each (output, row) sum is one chain of
// fused multiply-adds in input order whatever the tile, so tiling changes speed, not bits;
// several outputs per tile give the processor independent chains to overlap.
template <int64_t Kind, int Outs, int Rows>
inline void dot_tile(const uint8_t* blocks, int64_t row_bytes, int64_t num_blocks, const float* x,
                     int64_t x_stride, float* out, int64_t out_stride) {
  constexpr int64_t stride = kBlockBytes<Kind>;
  __m256 acc[Outs][Rows];
  _Pragma("GCC unroll 16") for (int o = 0; o < Outs; ++o)
    for (int r = 0; r < Rows; ++r) acc[o][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b) {
    _Pragma("GCC unroll 16") for (int o = 0; o < Outs; ++o) {
      __m256 w[4];
      _mm_prefetch(reinterpret_cast<const char*>(blocks + o * row_bytes + (b + 8) * stride), _MM_HINT_T0);
      dequantize_block<Kind>(blocks + o * row_bytes + b * stride, w);
      _Pragma("GCC unroll 16") for (int r = 0; r < Rows; ++r) {
        const float* xs = x + r * x_stride + b * kBlock;
        _Pragma("GCC unroll 4") for (int part = 0; part < 4; ++part)
          acc[o][r] = _mm256_fmadd_ps(w[part], _mm256_loadu_ps(xs + 8 * part), acc[o][r]);
      }
    }
  }
  _Pragma("GCC unroll 16") for (int o = 0; o < Outs; ++o)
    for (int r = 0; r < Rows; ++r) out[r * out_stride + o] = lanes_sum(acc[o][r]);
}

// Outputs [0, count) of a weight slice as floats, `in_features` per output: the values
// dequantize_block gives in registers, so a sum over them is the same bits as one over those.
template <int64_t Kind>
void dequantize_outputs(const uint8_t* blocks, int64_t row_bytes, int64_t num_blocks, int64_t count,
                        float* panel) {
  constexpr int64_t stride = kBlockBytes<Kind>;
  for (int64_t o = 0; o < count; ++o) {
    float* dst = panel + o * num_blocks * kBlock;
    for (int64_t b = 0; b < num_blocks; ++b) {
      __m256 w[4];
      dequantize_block<Kind>(blocks + o * row_bytes + b * stride, w);
      _Pragma("GCC unroll 4") for (int part = 0; part < 4; ++part) _mm256_storeu_ps(dst + b * kBlock + 8 * part, w[part]);
    }
  }
}

// dot_tile's sums over weights already in floats (a panel from dequantize_outputs): the same
// chain of fused multiply-adds per (output, row), so the same bits.
template <int Outs, int Rows>
inline void panel_tile(const float* w, int64_t in_features, const float* x, int64_t x_stride, float* out,
                       int64_t out_stride) {
  __m256 acc[Outs][Rows];
  _Pragma("GCC unroll 16") for (int o = 0; o < Outs; ++o)
    for (int r = 0; r < Rows; ++r) acc[o][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < in_features; k += 8) {
    __m256 wv[Outs];
    _Pragma("GCC unroll 4") for (int o = 0; o < Outs; ++o) wv[o] = _mm256_loadu_ps(w + o * in_features + k);
    _Pragma("GCC unroll 8") for (int r = 0; r < Rows; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * x_stride + k);
      _Pragma("GCC unroll 4") for (int o = 0; o < Outs; ++o) acc[o][r] = _mm256_fmadd_ps(wv[o], xv, acc[o][r]);
    }
  }
  _Pragma("GCC unroll 16") for (int o = 0; o < Outs; ++o)
    for (int r = 0; r < Rows; ++r) out[r * out_stride + o] = lanes_sum(acc[o][r]);
}

template <int Rows>
void panel_outputs(int64_t count, const float* panel, int64_t in_features, const float* x, float* out,
                   int64_t out_stride) {
  int64_t o = 0;
  for (; o + 2 <= count; o += 2)
    panel_tile<2, Rows>(panel + o * in_features, in_features, x, in_features, out + o, out_stride);
  for (; o < count; ++o)
    panel_tile<1, Rows>(panel + o * in_features, in_features, x, in_features, out + o, out_stride);
}

// More rows than one tile: each thread turns kPanel outputs at a time into floats once (an L2-sized
// panel) and multiplies every row by them, instead of dequantizing every block once per 4 rows.
template <int64_t Kind>
void quant_linear_panels(const float* x, int64_t rows, int64_t in_features, const uint8_t* weight,
                         int64_t out_features, float* out) {
  constexpr int64_t kPanel = 16;
  constexpr int64_t kPanelRows = 6;  // 2 outputs x 6 rows: 12 accumulators of the 16 registers
  const int64_t num_blocks = in_features / kBlock;
  const int64_t row_bytes = num_blocks * block_bytes(Kind);
  at::parallel_for(0, out_features, 32, [&](int64_t begin, int64_t end) {
    std::vector<float> panel(kPanel * in_features);
    for (int64_t o = begin; o < end; o += kPanel) {
      const int64_t count = std::min(kPanel, end - o);
      dequantize_outputs<Kind>(weight + o * row_bytes, row_bytes, num_blocks, count, panel.data());
      for (int64_t r = 0; r < rows; r += kPanelRows) {
        const float* xs = x + r * in_features;
        float* os = out + r * out_features + o;
        with_rows<kPanelRows>(std::min(kPanelRows, rows - r), [&](auto n) {
          panel_outputs<decltype(n)::value>(count, panel.data(), in_features, xs, os, out_features);
        });
      }
    }
  });
}
#else
template <int64_t Kind, int Outs, int Rows>
inline void dot_tile(const uint8_t* blocks, int64_t row_bytes, int64_t num_blocks, const float* x,
                     int64_t x_stride, float* out, int64_t out_stride) {
  const int64_t stride = block_bytes(Kind);
  float w[kBlock];
  for (int o = 0; o < Outs; ++o) {
    float acc[Rows][8] = {};
    for (int64_t b = 0; b < num_blocks; ++b) {
      dequantize_block<Kind>(blocks + o * row_bytes + b * stride, w);
      for (int r = 0; r < Rows; ++r) {
        const float* xs = x + r * x_stride + b * kBlock;
        for (int part = 0; part < 4; ++part)
          for (int lane = 0; lane < 8; ++lane) acc[r][lane] += w[8 * part + lane] * xs[8 * part + lane];
      }
    }
    for (int r = 0; r < Rows; ++r) {
      const float* a = acc[r];
      const float s0 = a[0] + a[4], s1 = a[1] + a[5], s2 = a[2] + a[6], s3 = a[3] + a[7];
      out[r * out_stride + o] = (s0 + s2) + (s1 + s3);
    }
  }
}
#endif

// Outputs [begin, end) for `Rows` rows: Outs at a time, then one at a time.
template <int64_t Kind, int Outs, int Rows>
void dot_outputs(int64_t begin, int64_t end, const uint8_t* weight, int64_t row_bytes, int64_t num_blocks,
                 const float* x, int64_t x_stride, float* out, int64_t out_stride) {
  int64_t o = begin;
  for (; o + Outs <= end; o += Outs)
    dot_tile<Kind, Outs, Rows>(weight + o * row_bytes, row_bytes, num_blocks, x, x_stride, out + o, out_stride);
  for (; o < end; ++o)
    dot_tile<Kind, 1, Rows>(weight + o * row_bytes, row_bytes, num_blocks, x, x_stride, out + o, out_stride);
}

template <int64_t Kind>
void quant_linear_impl(const float* x, int64_t rows, int64_t in_features, const uint8_t* weight,
                       int64_t out_features, float* out) {
#ifdef NASD_AVX2
  if (rows >= kPanelMinRows) return quant_linear_panels<Kind>(x, rows, in_features, weight, out_features, out);
#endif
  const int64_t num_blocks = in_features / kBlock;
  const int64_t row_bytes = num_blocks * block_bytes(Kind);
  // Each output is one thread's whole sum (threads split outputs, never a sum), so the result
  // does not depend on the thread count either.
  at::parallel_for(0, out_features, 32, [&](int64_t begin, int64_t end) {
    for (int64_t r = 0; r < rows; r += kRowTile) {
      const float* xs = x + r * in_features;
      float* os = out + r * out_features;
      with_rows<kRowTile>(std::min(kRowTile, rows - r), [&](auto n) {
        constexpr int tile_rows = decltype(n)::value;
        constexpr int outs = tile_rows == 1 ? 4 : 2;  // one row: 4 outputs' chains to overlap
        dot_outputs<Kind, outs, tile_rows>(begin, end, weight, row_bytes, num_blocks, xs, in_features, os,
                                           out_features);
      });
    }
  });
}

}  // namespace

namespace nasd {

at::Tensor quant_linear(const at::Tensor& input, const at::Tensor& weight, int64_t kind) {
  static const Multiplies multiplies{quant_linear_impl<kQ4_0>, quant_linear_impl<kQ4_1>, quant_linear_impl<kQ8_0>,
                                     quant_linear_impl<kQ4_K>, quant_linear_impl<kQ6_K>, quant_linear_impl<kQ5>};
  return multiply_blocks("quant_linear", input, weight, kind, multiplies);
}

}  // namespace nasd

TORCH_LIBRARY_FRAGMENT(nasd, m) {
  m.def("quant_linear(Tensor input, Tensor weight, int kind) -> Tensor");
  m.impl("quant_linear", c10::DispatchKey::CPU, TORCH_FN(nasd::quant_linear));
}
