// x @ W.T on a CPU with W kept as a GGUF file ships it: blocks of 32 weights along each output's
// inputs, a float16 scale (and, for Q4_1, a float16 offset) per block, codes of 4 or 8 bits.
//
// Why a kernel: a decode step on a CPU is bound by reading the weights, and these blocks are a
// quarter to an eighth of float32's bytes. PyTorch's own weight-only CPU kernels reread the
// weights for every input row (benchmarks/quant_matmul.py), which is what verification must not
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

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace {

constexpr int64_t kBlock = 32;  // weights per block, in every format here
constexpr int64_t kRowTile = 4;  // input rows multiplied per pass over a tile of outputs
// From this many rows on, dequantizing each weight once into a float panel beats dequantizing it
// in registers once per row tile (benchmarks/quant_matmul.py: 1.1x at 17 rows, 1.3x at 64-256;
// 0.8x at 8, where the panel's stores and loads cost more than the repeated decoding).
constexpr int64_t kPanelMinRows = 9;

// ggml's type ids (gguf.GGMLQuantizationType).
enum Kind : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };

// Bytes of one block: a float16 scale (Q4_1: and a float16 offset), then the 32 codes.
template <int64_t Kind>
constexpr int64_t kBlockBytes = Kind == kQ4_0 ? 2 + 16 : Kind == kQ4_1 ? 2 + 2 + 16 : 2 + 32;

int64_t block_bytes(int64_t kind) {
  switch (kind) {
    case kQ4_0: return kBlockBytes<kQ4_0>;
    case kQ4_1: return kBlockBytes<kQ4_1>;
    case kQ8_0: return kBlockBytes<kQ8_0>;
    default: TORCH_CHECK(false, "quant_linear: unsupported block type ", kind);
  }
  return 0;
}

float half_to_float(const uint8_t* bytes) {
  uint16_t h;
  std::memcpy(&h, bytes, sizeof(h));
#ifdef NASD_AVX2
  return _cvtsh_ss(h);
#else
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff, bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000 | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exponent = 113;
    while (!(mantissa & 0x400)) mantissa <<= 1, --exponent;
    bits = sign | (exponent << 23) | ((mantissa & 0x3ff) << 13);
  }
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
#endif
}

// One block's 32 weights as floats, in input order.
template <int64_t Kind>
inline void dequantize_block(const uint8_t* block, float* w) {
  if constexpr (Kind == kQ8_0) {
    const float d = half_to_float(block);
    const int8_t* q = reinterpret_cast<const int8_t*>(block + 2);
    for (int i = 0; i < 32; ++i) w[i] = float(q[i]) * d;
  } else {
    const float d = half_to_float(block);
    const float m = Kind == kQ4_1 ? half_to_float(block + 2) : -8.0f * d;
    const uint8_t* q = block + (Kind == kQ4_1 ? 4 : 2);
    // Byte j holds weight j in its low nibble and weight j + 16 in its high one.
    for (int j = 0; j < 16; ++j) {
      w[j] = float(q[j] & 0x0f) * d + m;
      w[j + 16] = float(q[j] >> 4) * d + m;
    }
  }
}

#ifdef NASD_AVX2
// The same 32 weights in four registers of 8 (the products q * d are exact, so the fused
// multiply-add rounds exactly as q * d + m does).
template <int64_t Kind>
inline void dequantize_block(const uint8_t* block, __m256* w) {
  const __m256 d = _mm256_set1_ps(half_to_float(block));
  if constexpr (Kind == kQ8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(block + 2);
    _Pragma("GCC unroll 4") for (int part = 0; part < 4; ++part) {
      const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * part));
      w[part] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)), d);
    }
  } else {
    const __m256 m = Kind == kQ4_1 ? _mm256_set1_ps(half_to_float(block + 2))
                                   : _mm256_mul_ps(_mm256_set1_ps(-8.0f), d);
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + (Kind == kQ4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i low = _mm_and_si128(bytes, mask);                      // weights 0..15
    const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);  // weights 16..31
    const __m128i parts[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
    _Pragma("GCC unroll 4") for (int part = 0; part < 4; ++part) {
      const __m256 codes = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[part]));
      w[part] = _mm256_fmadd_ps(codes, d, m);
    }
  }
}

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
        switch (std::min(kPanelRows, rows - r)) {
          case 1: panel_outputs<1>(count, panel.data(), in_features, xs, os, out_features); break;
          case 2: panel_outputs<2>(count, panel.data(), in_features, xs, os, out_features); break;
          case 3: panel_outputs<3>(count, panel.data(), in_features, xs, os, out_features); break;
          case 4: panel_outputs<4>(count, panel.data(), in_features, xs, os, out_features); break;
          case 5: panel_outputs<5>(count, panel.data(), in_features, xs, os, out_features); break;
          default: panel_outputs<6>(count, panel.data(), in_features, xs, os, out_features);
        }
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
      switch (std::min(kRowTile, rows - r)) {
        case 1: dot_outputs<Kind, 4, 1>(begin, end, weight, row_bytes, num_blocks, xs, in_features, os, out_features); break;
        case 2: dot_outputs<Kind, 2, 2>(begin, end, weight, row_bytes, num_blocks, xs, in_features, os, out_features); break;
        case 3: dot_outputs<Kind, 2, 3>(begin, end, weight, row_bytes, num_blocks, xs, in_features, os, out_features); break;
        default: dot_outputs<Kind, 2, 4>(begin, end, weight, row_bytes, num_blocks, xs, in_features, os, out_features);
      }
    }
  });
}

}  // namespace

namespace nasd {

at::Tensor quant_linear(const at::Tensor& input, const at::Tensor& weight, int64_t kind) {
  TORCH_CHECK(input.scalar_type() == at::kFloat, "quant_linear: input must be float32");
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2, "quant_linear: weight must be 2-d uint8 blocks");
  const int64_t in_features = input.size(-1);
  TORCH_CHECK(in_features % kBlock == 0, "quant_linear: input width ", in_features, " is not a multiple of 32");
  TORCH_CHECK(weight.size(1) == in_features / kBlock * block_bytes(kind), "quant_linear: weight has ",
              weight.size(1), " bytes per output, expected ", in_features / kBlock * block_bytes(kind));
  const at::Tensor x = input.reshape({-1, in_features}).contiguous();
  const at::Tensor w = weight.contiguous();
  const int64_t rows = x.size(0), out_features = w.size(0);
  at::Tensor out = at::empty({rows, out_features}, x.options());
  if (rows > 0) {
    const float* xp = x.data_ptr<float>();
    const uint8_t* wp = w.data_ptr<uint8_t>();
    float* op = out.data_ptr<float>();
    switch (kind) {
      case kQ4_0: quant_linear_impl<kQ4_0>(xp, rows, in_features, wp, out_features, op); break;
      case kQ4_1: quant_linear_impl<kQ4_1>(xp, rows, in_features, wp, out_features, op); break;
      case kQ8_0: quant_linear_impl<kQ8_0>(xp, rows, in_features, wp, out_features, op); break;
      default: TORCH_CHECK(false, "quant_linear: unsupported block type ", kind);
    }
  }
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end() - 1);
  shape.push_back(out_features);
  return out.view(shape);
}

}  // namespace nasd

TORCH_LIBRARY_FRAGMENT(nasd, m) {
  m.def("quant_linear(Tensor input, Tensor weight, int kind) -> Tensor");
  m.impl("quant_linear", c10::DispatchKey::CPU, TORCH_FN(nasd::quant_linear));
}
