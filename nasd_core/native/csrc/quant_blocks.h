// GGUF weight blocks as the CPU kernels read them (quant_linear.cpp, quant_linear_q8.cpp): the
// block kinds and their layout, one block's weights as floats, and the checks and dispatch on the
// block kind that both operators share.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace nasd_blocks {

// Calls body(std::integral_constant<int, n>()) for a run-time n in [1, Max] (the callers' row
// counts), so that a template can take it.
template <int Max, typename Body>
inline void with_rows(int64_t n, Body body) {
  if constexpr (Max > 1) {
    if (n < Max) return with_rows<Max - 1>(n, body);
  }
  body(std::integral_constant<int, Max>());
}

constexpr int64_t kBlock = 32;  // weights per block, in every format here

// ggml's type ids (gguf.GGMLQuantizationType). The K-quants and Q5 types come repacked into blocks
// of 32 by the loader (nasd_core/loader/gguf.py), their scales multiplied out (exactly) into
// float32 ones: Q4_K as Q4_1 with float32 d and m, Q6_K as Q8_0 with a float32 d for each half (and
// Q3_K likewise: the kernels read its blocks as Q6_K's), Q5_0, Q5_1 and Q5_K as a byte per code
// (0..31) with float32 d and m (Kind kQ5 below).
enum Kind : int64_t {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14
};
// The one layout Q5_0, Q5_1 and Q5_K are repacked into (the kernels' template argument for all three).
constexpr int64_t kQ5 = kQ5_K;

// Bytes of one block: its scale(s) and offset, then the 32 codes:
//   Q4_0: float16 d, 16 bytes of nibbles             w = q * d - 8 d
//   Q4_1: float16 d, float16 m, 16 bytes of nibbles  w = q * d + m
//   Q8_0: float16 d, 32 int8 codes                   w = c * d
//   Q4_K: float32 d, float32 m, 16 bytes of nibbles  w = q * d + m
//   Q6_K: float32 d (weights 0-15), float32 d (16-31), 32 int8 codes   w = c * d_half
//   Q5:   float32 d, float32 m, 32 codes 0..31 a byte each          w = q * d + m
template <int64_t Kind>
constexpr int64_t kBlockBytes = Kind == kQ4_0   ? 2 + 16
                                : Kind == kQ4_1 ? 2 + 2 + 16
                                : Kind == kQ8_0 ? 2 + 32
                                : Kind == kQ4_K ? 4 + 4 + 16
                                                : 4 + 4 + 32;  // Q6_K, Q5
// Nibbles (byte j: weight j low, weight j + 16 high), int8 codes, or (Q5) unsigned byte codes.
template <int64_t Kind>
constexpr bool kNibbles = Kind == kQ4_0 || Kind == kQ4_1 || Kind == kQ4_K;
template <int64_t Kind>
constexpr bool kSignedBytes = Kind == kQ8_0 || Kind == kQ6_K;
// Where the codes start.
template <int64_t Kind>
constexpr int64_t kCodesAt = kBlockBytes<Kind> - (kNibbles<Kind> ? 16 : 32);
// An offset m per block (Q4_0's -8 d is folded into its integer sums instead).
template <int64_t Kind>
constexpr bool kOffset = Kind == kQ4_1 || Kind == kQ4_K || Kind == kQ5;
// Two scales per block, one for each 16 weights.
template <int64_t Kind>
constexpr bool kHalves = Kind == kQ6_K;

inline int64_t block_bytes(int64_t kind) {
  switch (kind) {
    case kQ4_0: return kBlockBytes<kQ4_0>;
    case kQ4_1: return kBlockBytes<kQ4_1>;
    case kQ8_0: return kBlockBytes<kQ8_0>;
    case kQ4_K: return kBlockBytes<kQ4_K>;
    case kQ3_K:
    case kQ6_K: return kBlockBytes<kQ6_K>;
    case kQ5_0:
    case kQ5_1:
    case kQ5_K: return kBlockBytes<kQ5>;
    default: TORCH_CHECK(false, "quant_linear: unsupported block type ", kind);
  }
  return 0;
}

// A T at any byte address (blocks of 18 or 20 bytes leave their fields unaligned).
template <typename T>
inline T load_unaligned(const void* bytes) {
  T value;
  std::memcpy(&value, bytes, sizeof(value));
  return value;
}

inline float half_to_float(const uint8_t* bytes) {
  const uint16_t h = load_unaligned<uint16_t>(bytes);
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

// A block's scale d (Q6_K: of weights 16 * half ..) and offset m.
template <int64_t Kind>
inline float block_scale(const uint8_t* block, int half = 0) {
  if constexpr (Kind == kQ4_K || Kind == kQ6_K || Kind == kQ5) {
    return load_unaligned<float>(block + 4 * half);
  } else {
    return half_to_float(block);
  }
}

template <int64_t Kind>
inline float block_offset(const uint8_t* block) {
  if constexpr (Kind == kQ4_K || Kind == kQ5) {
    return load_unaligned<float>(block + 4);
  } else if constexpr (Kind == kQ4_1) {
    return half_to_float(block + 2);
  } else {
    return -8.0f * half_to_float(block);  // Q4_0
  }
}

// One block's 32 weights as floats, in input order.
template <int64_t Kind>
inline void dequantize_block(const uint8_t* block, float* w) {
  if constexpr (kSignedBytes<Kind>) {
    const int8_t* q = reinterpret_cast<const int8_t*>(block + kCodesAt<Kind>);
    for (int i = 0; i < 32; ++i) w[i] = float(q[i]) * block_scale<Kind>(block, kHalves<Kind> ? i / 16 : 0);
  } else if constexpr (!kNibbles<Kind>) {
    const float d = block_scale<Kind>(block), m = block_offset<Kind>(block);
    const uint8_t* q = block + kCodesAt<Kind>;
    for (int i = 0; i < 32; ++i) w[i] = float(q[i]) * d + m;
  } else {
    const float d = block_scale<Kind>(block);
    const float m = block_offset<Kind>(block);
    const uint8_t* q = block + kCodesAt<Kind>;
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
  const __m256 d = _mm256_set1_ps(block_scale<Kind>(block));
  if constexpr (kSignedBytes<Kind>) {
    const __m256 d_high = kHalves<Kind> ? _mm256_set1_ps(block_scale<Kind>(block, 1)) : d;
    const int8_t* q = reinterpret_cast<const int8_t*>(block + kCodesAt<Kind>);
    _Pragma("GCC unroll 4") for (int part = 0; part < 4; ++part) {
      const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * part));
      w[part] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)), part < 2 ? d : d_high);
    }
  } else if constexpr (!kNibbles<Kind>) {
    const __m256 m = _mm256_set1_ps(block_offset<Kind>(block));
    const uint8_t* q = block + kCodesAt<Kind>;
    _Pragma("GCC unroll 4") for (int part = 0; part < 4; ++part) {
      const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * part));
      w[part] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes)), d, m);
    }
  } else {
    const __m256 m = _mm256_set1_ps(block_offset<Kind>(block));
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kCodesAt<Kind>));
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
#endif

using Multiply = void (*)(const float* x, int64_t rows, int64_t in_features, const uint8_t* weight,
                          int64_t out_features, float* out);

// One operator's multiply for each block kind (in the order of Kind).
struct Multiplies {
  Multiply q4_0, q4_1, q8_0, q4_k, q6_k, q5;
  Multiply of(int64_t kind) const {
    switch (kind) {
      case kQ4_0: return q4_0;
      case kQ4_1: return q4_1;
      case kQ8_0: return q8_0;
      case kQ4_K: return q4_k;
      case kQ3_K:
      case kQ6_K: return q6_k;
      default: return q5;  // block_bytes checked the kind
    }
  }
};

// input [..., in] times the blocks' weights: the checks, flattening and the dispatch on the block
// kind that both operators share.
inline at::Tensor multiply_blocks(const char* name, const at::Tensor& input, const at::Tensor& weight, int64_t kind,
                           const Multiplies& multiplies) {
  TORCH_CHECK(input.scalar_type() == at::kFloat, name, ": input must be float32");
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2, name, ": weight must be 2-d uint8 blocks");
  const int64_t in_features = input.size(-1);
  TORCH_CHECK(in_features % kBlock == 0, name, ": input width ", in_features, " is not a multiple of 32");
  TORCH_CHECK(weight.size(1) == in_features / kBlock * block_bytes(kind), name, ": weight has ", weight.size(1),
              " bytes per output, expected ", in_features / kBlock * block_bytes(kind));
  const at::Tensor x = input.reshape({-1, in_features}).contiguous();
  const at::Tensor w = weight.contiguous();
  const int64_t rows = x.size(0), out_features = w.size(0);
  at::Tensor out = at::empty({rows, out_features}, x.options());
  if (rows > 0) {
    multiplies.of(kind)(x.data_ptr<float>(), rows, in_features, w.data_ptr<uint8_t>(), out_features, out.data_ptr<float>());
  }
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end() - 1);
  shape.push_back(out_features);
  return out.view(shape);
}

}  // namespace nasd_blocks
