// x @ W.T on a CPU with W in GGUF blocks (quant_blocks.h) and each row's activations quantized to
// int8 per block of 32, as llama.cpp does (ggml's quantize_row_q8_1), with integer dot products
// against the weights' codes (quant_linear.cpp multiplies the float32 rows).
//
// Why: with float32 activations every code becomes a float and costs a multiply-add per row;
// here 4 codes times 4 activation bytes are one instruction (vpdpbusd on VNNI, about three on
// AVX2), and floats come in once per block and row.
//
// Activations, per row and block from that row alone: amax = max |x|, d_x = amax / 127,
// q = x * (127 / amax) rounded half to even (0 where amax is 0), so |q| <= 127, and s = sum q.
// Finite inputs only (a non-finite one gives an undefined block). Per output and block,
// isum = sum(code * q) exactly in int32, then in block order, one chain per output:
//   Q8_0: acc = fma(d_w * d_x, isum, acc)
//   Q4_0: acc = fma(d_w * d_x, isum - 8 s, acc)           (codes 0..15, exact integer offset)
//   Q4_1, Q4_K, Q5: acc = fma(d_w * d_x, isum, acc), acc_m = fma(m_w, d_x * s, acc_m); out = acc + acc_m
//   Q6_K: acc = fma(d_low * d_x, isum_low, acc), then acc = fma(d_high * d_x, isum_high, acc), each
//         isum over its 16 weights
// Nothing is split across vector lanes, so an output depends neither on the vector width, the
// rows or outputs multiplied beside it, the threads, nor on the instructions that summed isum
// (integer sums are exact): q8_scalar computes exactly this, and the tests hold the AVX2 and
// VNNI paths to its bits (quant_linear_q8_path switches paths at run time).
//
// Layout: the integer products are vectorised across outputs, not inputs. Each tile of 8 (ymm)
// or 16 (zmm) outputs is repacked once into a panel the thread keeps in L1, 4 consecutive codes
// of every output of the tile side by side; 4 bytes of a row's activations, broadcast, multiply
// them all, and each int32 lane accumulates its own output's block sum: no horizontal sums.
// Every row tile (V::rows rows) then reads the panel, so a weight is unpacked once per call.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "kernels.h"
#include "quant_blocks.h"

namespace {

using namespace nasd_blocks;

// Instructions for the integer sums (all give the same bits): scalar; AVX2's maddubs; VNNI's
// vpdpbusd on 8 outputs at a time (AVX-VNNI or AVX-512 VL) or 16 (AVX-512); AMX's tile dot
// products on 16 rows x 16 outputs at a time (Intel from Sapphire Rapids on).
enum Q8Path : int64_t { kQ8Scalar = 0, kQ8Avx2 = 1, kQ8Vnni = 2, kQ8Vnni512 = 3, kQ8Amx = 4 };

#if defined(NASD_AVX2) && ((defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__))
#define NASD_VNNI 1
#endif
#if defined(NASD_VNNI) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define NASD_VNNI512 1
#endif
#if defined(NASD_VNNI512) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define NASD_AMX 1
constexpr int64_t kQ8Best = kQ8Amx;
#elif defined(NASD_VNNI512)
constexpr int64_t kQ8Best = kQ8Vnni512;
#elif defined(NASD_VNNI)
constexpr int64_t kQ8Best = kQ8Vnni;
#elif defined(NASD_AVX2)
constexpr int64_t kQ8Best = kQ8Avx2;
#else
constexpr int64_t kQ8Best = kQ8Scalar;
#endif

#ifdef NASD_AMX
// Linux hands a process the tile registers' state only when asked (arch_prctl, once per process).
bool amx_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return permitted;
}
#endif

// The best path this build and this process can run.
int64_t q8_best() {
#ifdef NASD_AMX
  if (!amx_permitted()) return kQ8Vnni512;
#endif
  return kQ8Best;
}

std::atomic<int64_t> q8_path{q8_best()};  // the tests switch it to compare the paths' bits

// A call's activations, quantized: [rows, in_features] codes, [rows, num_blocks] the rest.
struct Q8Rows {
  std::vector<int8_t> codes;
  std::vector<float> scale;    // d_x
  std::vector<float> offset;   // d_x * s: Q4_1's and Q4_K's m_w term
  // What isum starts from: -8 s (Q4_0), -128 s (int8 codes on VNNI), else 0. With two halves
  // (Q6_K), `start` is the first 16 weights' and `start_high` the last 16's (from their own s).
  std::vector<int32_t> start;
  std::vector<int32_t> start_high;
};

// Int8 codes on VNNI are multiplied as code + 128 (vpdpbusd takes unsigned bytes), so isum
// starts at -128 s.
template <int64_t Kind, int64_t Path>
constexpr int32_t kStartPerSum = Kind == kQ4_0 ? -8 : kSignedBytes<Kind> && Path == kQ8Vnni ? -128 : 0;

// A block whose largest magnitude is below this is taken as zeros: 127 / amax would overflow
// float32 (and the codes with it) below ~3.7e-37.
constexpr float kQ8MinAmax = 1e-36f;

// One block of 32 activations (finite): codes into `q`, s into `sum` (and the first 16 codes' sum
// into `low_sum`); returns d_x.
template <int64_t Path>
inline float quantize_block_q8(const float* x, int8_t* q, int32_t* sum, int32_t* low_sum) {
#ifdef NASD_AVX2
  if constexpr (Path != kQ8Scalar) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], top = _mm256_setzero_ps();
    for (int part = 0; part < 4; ++part) {
      v[part] = _mm256_loadu_ps(x + 8 * part);
      top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[part]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    const __m256 inverse = _mm256_set1_ps(amax >= kQ8MinAmax ? 127.0f / amax : 0.0f);
    __m256i c[4];
    for (int part = 0; part < 4; ++part)
      c[part] = _mm256_cvtps_epi32(
          _mm256_round_ps(_mm256_mul_ps(v[part], inverse), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const auto total = [](__m256i v) {
      __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
      return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1)));
    };
    *low_sum = total(_mm256_add_epi32(c[0], c[1]));
    *sum = *low_sum + total(_mm256_add_epi32(c[2], c[3]));
    // The packs interleave 128-bit lanes; the permutation puts the bytes back in input order.
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    return amax / 127.0f;
  }
#endif
  float amax = 0.0f;
  for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float inverse = amax >= kQ8MinAmax ? 127.0f / amax : 0.0f;
  int32_t total = 0;
  for (int i = 0; i < kBlock; ++i) {
    // nearbyint rounds half to even in the default rounding mode (which the kernels never
    // change), as _MM_FROUND_TO_NEAREST_INT does.
    q[i] = static_cast<int8_t>(std::nearbyint(x[i] * inverse));
    total += q[i];
    if (i == kBlock / 2 - 1) *low_sum = total;
  }
  *sum = total;
  return amax / 127.0f;
}

// `padded_rows` (>= rows) rows are allocated, the ones past `rows` zeros (AMX reads whole tiles).
template <int64_t Kind, int64_t Path>
Q8Rows quantize_rows(const float* x, int64_t rows, int64_t in_features, int64_t padded_rows = 0) {
  const int64_t num_blocks = in_features / kBlock;
  const int64_t allocated = std::max(rows, padded_rows);
  Q8Rows q;
  q.codes.resize(allocated * in_features);
  q.scale.resize(allocated * num_blocks);
  q.offset.resize(allocated * num_blocks);
  q.start.resize(allocated * num_blocks);
  q.start_high.resize(kHalves<Kind> ? allocated * num_blocks : 0);
  at::parallel_for(0, rows * num_blocks, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      int32_t sum, low_sum;
      const float d = quantize_block_q8<Path>(x + i * kBlock, q.codes.data() + i * kBlock, &sum, &low_sum);
      q.scale[i] = d;
      q.offset[i] = d * static_cast<float>(sum);
      q.start[i] = kStartPerSum<Kind, Path> * (kHalves<Kind> ? low_sum : sum);
      if constexpr (kHalves<Kind>) q.start_high[i] = kStartPerSum<Kind, Path> * (sum - low_sum);
    }
  });
  return q;
}

// `count` int8 codes times as many int8 activations. Kept scalar: GCC 12 vectorises this loop
// into vpdpbusd on AVX-VNNI hosts, an instruction that reads one side as unsigned (wrong sums).
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("no-tree-vectorize")))
#endif
int32_t signed_dot(const uint8_t* codes, const int8_t* x, int count) {
  int32_t sum = 0;
  for (int i = 0; i < count; ++i) sum += static_cast<int8_t>(codes[i]) * x[i];
  return sum;
}

// The definition above, one output and row at a time: the fallback without AVX2 and the
// reference the SIMD paths are tested against.
template <int64_t Kind>
void q8_scalar(const Q8Rows& q, int64_t rows, int64_t in_features, const uint8_t* weight, int64_t out_features,
               float* out) {
  const int64_t num_blocks = in_features / kBlock;
  constexpr int64_t stride = kBlockBytes<Kind>;
  const int64_t row_bytes = num_blocks * stride;
  at::parallel_for(0, out_features, 32, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      for (int64_t r = 0; r < rows; ++r) {
        float acc = 0.0f, acc_m = 0.0f;
        for (int64_t b = 0; b < num_blocks; ++b) {
          const uint8_t* block = weight + o * row_bytes + b * stride;
          const int8_t* x = q.codes.data() + r * in_features + b * kBlock;
          const int64_t at = r * num_blocks + b;
          int32_t isum = q.start[at];
          if constexpr (kHalves<Kind>) {
            const int32_t high = q.start_high[at] + signed_dot(block + kCodesAt<Kind> + 16, x + 16, 16);
            isum += signed_dot(block + kCodesAt<Kind>, x, 16);
            acc = std::fma(block_scale<Kind>(block) * q.scale[at], static_cast<float>(isum), acc);
            acc = std::fma(block_scale<Kind>(block, 1) * q.scale[at], static_cast<float>(high), acc);
            continue;
          } else if constexpr (kSignedBytes<Kind>) {
            isum += signed_dot(block + kCodesAt<Kind>, x, kBlock);
          } else if constexpr (!kNibbles<Kind>) {
            const uint8_t* codes = block + kCodesAt<Kind>;
            for (int j = 0; j < kBlock; ++j) isum += codes[j] * x[j];
          } else {
            const uint8_t* codes = block + kCodesAt<Kind>;
            for (int j = 0; j < 16; ++j) isum += (codes[j] & 0x0f) * x[j] + (codes[j] >> 4) * x[j + 16];
          }
          acc = std::fma(block_scale<Kind>(block) * q.scale[at], static_cast<float>(isum), acc);
          if constexpr (kOffset<Kind>) acc_m = std::fma(block_offset<Kind>(block), q.offset[at], acc_m);
        }
        out[r * out_features + o] = kOffset<Kind> ? acc + acc_m : acc;
      }
    }
  });
}

#ifdef NASD_AVX2
// 8 float16 values, one per output, at `offset` in each output's block.
inline __m256 tile_halves(const uint8_t* const* rows, int64_t offset) {
  const auto half = [&](int j) { return load_unaligned<uint16_t>(rows[j] + offset); };
  return _mm256_cvtph_ps(_mm_setr_epi16(half(0), half(1), half(2), half(3), half(4), half(5), half(6), half(7)));
}

// Q4_1's d and m of 8 outputs (one 4-byte load each) as two vectors of floats.
inline void tile_scale_offset(const uint8_t* const* rows, int64_t offset, float* scales, float* offsets) {
  const auto word = [&](int j) { return load_unaligned<int32_t>(rows[j] + offset); };
  const __m256i words = _mm256_setr_epi32(word(0), word(1), word(2), word(3), word(4), word(5), word(6), word(7));
  // Per 128-bit half, the 4 low float16 values (d), then the 4 high ones (m); then d, m of all 8.
  const __m256i split = _mm256_shuffle_epi8(words, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14,
                                                                    15, 0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11,
                                                                    14, 15));
  const __m256i halves = _mm256_permute4x64_epi64(split, 0xd8);
  _mm256_storeu_ps(scales, _mm256_cvtph_ps(_mm256_castsi256_si128(halves)));
  _mm256_storeu_ps(offsets, _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1)));
}

// A tile's Outs outputs (rows[j]: output j's first block) as a panel. Per block, 8 groups of
// 4 * Outs bytes: group g holds codes 4g..4g+3 of output j at bytes 4j..4j+3 (Q4: the nibbles
// 0..15; Q8_0, Q6_K: the int8 codes; Q5: the codes 0..31); then d_w of the Outs outputs as floats,
// and in `offsets` their m_w (Q4_1, Q4_K, Q5) or the second half's d_w (Q6_K).
// Meanwhile it prefetches the next tile's `next_bytes` (contiguous from `next`): a tile's outputs
// are a few KB of short rows, which the hardware prefetchers barely start on (1.6x at 1 row on 1
// thread of this Xeon).
template <int64_t Kind, int64_t Outs>
void repack_tile(const uint8_t* const* rows, int64_t num_blocks, uint8_t* codes, float* scales, float* offsets,
                 const uint8_t* next, int64_t next_bytes) {
  constexpr int64_t stride = kBlockBytes<Kind>, group = 4 * Outs;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t at = b * stride;
    for (int64_t line = b * Outs * stride; line < std::min((b + 1) * Outs * stride, next_bytes); line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(next + line), _MM_HINT_T0);
    for (int64_t half = 0; half < Outs / 8; ++half) {  // 8 outputs at a time
      const uint8_t* const* eight = rows + 8 * half;
      __m256i g[8];
      if constexpr (!kNibbles<Kind>) {
        __m256i r[8], t[8];
        for (int j = 0; j < 8; ++j)
          r[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(eight[j] + at + kCodesAt<Kind>));
        // An 8 x 8 transpose of 4-byte groups.
        for (int j = 0; j < 8; j += 4) {
          const __m256i a = _mm256_unpacklo_epi32(r[j], r[j + 1]), c = _mm256_unpackhi_epi32(r[j], r[j + 1]);
          const __m256i e = _mm256_unpacklo_epi32(r[j + 2], r[j + 3]), f = _mm256_unpackhi_epi32(r[j + 2], r[j + 3]);
          t[j] = _mm256_unpacklo_epi64(a, e);      // groups 0 | 4 of outputs j..j+3
          t[j + 1] = _mm256_unpackhi_epi64(a, e);  // 1 | 5
          t[j + 2] = _mm256_unpacklo_epi64(c, f);  // 2 | 6
          t[j + 3] = _mm256_unpackhi_epi64(c, f);  // 3 | 7
        }
        for (int i = 0; i < 4; ++i) {
          g[i] = _mm256_permute2x128_si256(t[i], t[i + 4], 0x20);
          g[i + 4] = _mm256_permute2x128_si256(t[i], t[i + 4], 0x31);
        }
      } else {
        constexpr int64_t skip = kCodesAt<Kind>;
        __m256i r[4];
        for (int j = 0; j < 4; ++j)  // outputs j and j + 4 in the two 128-bit halves
          r[j] = _mm256_inserti128_si256(
              _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(eight[j] + at + skip))),
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(eight[j + 4] + at + skip)), 1);
        // A 4 x 4 transpose of 4-byte groups in each half: packed[i] holds bytes 4i..4i+3, whose
        // low nibbles are codes 4i..4i+3 and high ones codes 16 + 4i.. (groups i and i + 4).
        const __m256i a = _mm256_unpacklo_epi32(r[0], r[1]), c = _mm256_unpackhi_epi32(r[0], r[1]);
        const __m256i e = _mm256_unpacklo_epi32(r[2], r[3]), f = _mm256_unpackhi_epi32(r[2], r[3]);
        const __m256i packed[4] = {_mm256_unpacklo_epi64(a, e), _mm256_unpackhi_epi64(a, e),
                                   _mm256_unpacklo_epi64(c, f), _mm256_unpackhi_epi64(c, f)};
        const __m256i mask = _mm256_set1_epi8(0x0f);
        for (int i = 0; i < 4; ++i) {
          g[i] = _mm256_and_si256(packed[i], mask);
          g[i + 4] = _mm256_and_si256(_mm256_srli_epi16(packed[i], 4), mask);
        }
      }
      uint8_t* panel = codes + b * 8 * group + 32 * half;
      for (int i = 0; i < 8; ++i) _mm256_storeu_si256(reinterpret_cast<__m256i*>(panel + i * group), g[i]);
      if constexpr (Kind == kQ4_1) {
        tile_scale_offset(eight, at, scales + b * Outs + 8 * half, offsets + b * Outs + 8 * half);
      } else if constexpr (Kind == kQ4_K || Kind == kQ6_K || Kind == kQ5) {
        for (int j = 0; j < 8; ++j) {
          scales[b * Outs + 8 * half + j] = load_unaligned<float>(eight[j] + at);
          offsets[b * Outs + 8 * half + j] = load_unaligned<float>(eight[j] + at + 4);
        }
      } else {
        _mm256_storeu_ps(scales + b * Outs + 8 * half, tile_halves(eight, at));
      }
    }
  }
}

// One int32 / float32 lane per output: 8 (AVX2, AVX-VNNI) or 16 (AVX-512) outputs a tile.
struct Lanes8 {
  static constexpr int64_t outs = 8;
  static constexpr int rows = 4;  // rows per pass over a panel: 4 sums and 4 accumulators of 16 registers
  using Int = __m256i;
  using Float = __m256;
  static Int load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static Int splat(int32_t v) { return _mm256_set1_epi32(v); }
  static Int zero() { return _mm256_setzero_si256(); }
  static Int flip(Int w) { return _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80))); }
  static Float loadf(const float* p) { return _mm256_loadu_ps(p); }
  static Float splatf(float v) { return _mm256_set1_ps(v); }
  static Float zerof() { return _mm256_setzero_ps(); }
  // acc + a * b with b's integer value (exact: |isum| < 2^24) in one rounding.
  static Float fma_int(Float a, Int b, Float acc) { return _mm256_fmadd_ps(a, _mm256_cvtepi32_ps(b), acc); }
  static Float fma(Float a, Float b, Float acc) { return _mm256_fmadd_ps(a, b, acc); }
  static Float mul(Float a, Float b) { return _mm256_mul_ps(a, b); }
  static Float add(Float a, Float b) { return _mm256_add_ps(a, b); }
  static void store(float* p, Float v) { _mm256_storeu_ps(p, v); }
#ifdef NASD_VNNI
  // 4 unsigned times 4 signed bytes, summed into each int32 lane (no saturation).
  static Int dot4(Int acc, Int u8, Int s8) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u8, s8);
#else
    return _mm256_dpbusd_avx_epi32(acc, u8, s8);
#endif
  }
#endif
};

#ifdef NASD_VNNI512
struct Lanes16 {
  // 8 rows (16 of the 32 registers): 1.1x 4 rows' speed at 8 and 17 rows, the same at 70.
  static constexpr int64_t outs = 16;
  static constexpr int rows = 8;
  using Int = __m512i;
  using Float = __m512;
  static Int load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static Int splat(int32_t v) { return _mm512_set1_epi32(v); }
  static Int zero() { return _mm512_setzero_si512(); }
  static Int flip(Int w) { return _mm512_xor_si512(w, _mm512_set1_epi8(static_cast<char>(0x80))); }
  static Float loadf(const float* p) { return _mm512_loadu_ps(p); }
  static Float splatf(float v) { return _mm512_set1_ps(v); }
  static Float zerof() { return _mm512_setzero_ps(); }
  static Float fma_int(Float a, Int b, Float acc) { return _mm512_fmadd_ps(a, _mm512_cvtepi32_ps(b), acc); }
  static Float fma(Float a, Float b, Float acc) { return _mm512_fmadd_ps(a, b, acc); }
  static Float mul(Float a, Float b) { return _mm512_mul_ps(a, b); }
  static Float add(Float a, Float b) { return _mm512_add_ps(a, b); }
  static void store(float* p, Float v) { _mm512_storeu_ps(p, v); }
  static Int dot4(Int acc, Int u8, Int s8) { return _mm512_dpbusd_epi32(acc, u8, s8); }
};
#endif

// One block's integer sums into the rows' accumulators, every path's float step:
// acc[r] = fma(d_w * d_x, isum, acc[r]) (`dw`: the block's d_w of V::outs outputs; `dx`: the
// block's d_x of row 0, rows num_blocks apart; isum_of(r): row r's sums).
template <typename V, int Rows, typename Sums>
inline void add_block(typename V::Float* acc, const float* dw, const float* dx, int64_t num_blocks, Sums isum_of) {
  const typename V::Float scale = V::loadf(dw);
  _Pragma("GCC unroll 16") for (int r = 0; r < Rows; ++r) acc[r] =
      V::fma_int(V::mul(scale, V::splatf(dx[r * num_blocks])), isum_of(r), acc[r]);
}

// sums[r] = sum over blocks (in order) of m_w * d_x s, for Q4_1, Q4_K and Q5 (`sx`: the rows' d_x
// s). Rows go up to 8 at a time through the blocks, so their chains of multiply-adds overlap (one
// row's chain alone waits out every multiply-add's latency).
template <typename V, int Rows>
inline void offset_chains(typename V::Float* sums, const float* offsets, const float* sx, int64_t num_blocks) {
  constexpr int part = Rows / ((Rows + 7) / 8);  // at most 8, dividing Rows (12: two of 6)
  static_assert(Rows % part == 0);
  for (int first = 0; first < Rows; first += part) {
    typename V::Float acc_m[part];
    _Pragma("GCC unroll 8") for (int r = 0; r < part; ++r) acc_m[r] = V::zerof();
    for (int64_t b = 0; b < num_blocks; ++b) {
      const typename V::Float m = V::loadf(offsets + b * V::outs);
      _Pragma("GCC unroll 8") for (int r = 0; r < part; ++r) acc_m[r] =
          V::fma(m, V::splatf(sx[(first + r) * num_blocks + b]), acc_m[r]);
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < part; ++r) sums[first + r] = acc_m[r];
  }
}

// acc[r] += the offset sums (AMX's epilogue, for the rows of a 16-row tile it keeps).
template <typename V, int Rows>
inline void add_offsets(typename V::Float* acc, const float* offsets, const float* sx, int64_t num_blocks) {
  typename V::Float sums[Rows];
  offset_chains<V, Rows>(sums, offsets, sx, num_blocks);
  _Pragma("GCC unroll 16") for (int r = 0; r < Rows; ++r) acc[r] = V::add(acc[r], sums[r]);
}

// A tile's offset sums for the call's rows (`sx`: their d_x s), into sums[r * V::outs + j], 8 rows
// at a time: AVX2's passes over the panel take 4 rows, whose 4 chains alone are bound by latency.
template <typename V>
void offset_rows(float* sums, const float* offsets, const float* sx, int64_t rows, int64_t num_blocks) {
  for (int64_t first = 0; first < rows; first += 8) {
    with_rows<8>(std::min<int64_t>(8, rows - first), [&](auto n) {
      constexpr int count = decltype(n)::value;
      typename V::Float chains[count];
      offset_chains<V, count>(chains, offsets, sx + first * num_blocks, num_blocks);
      _Pragma("GCC unroll 8") for (int r = 0; r < count; ++r) V::store(sums + (first + r) * V::outs, chains[r]);
    });
  }
}

// The tile's V::outs outputs for `Rows` rows from `row` on, into out[r * stride + j]; Q4_1, Q4_K
// and Q5 add the rows' offset sums (`offset_sums`, V::outs a row: offset_rows below).
template <int64_t Kind, int64_t Path, typename V, int Rows>
inline void q8_tile(const uint8_t* codes, const float* scales, const float* offsets, int64_t num_blocks,
                    const Q8Rows& q, int64_t row, float* out, int64_t stride, const float* offset_sums) {
  using Int = typename V::Int;
  using Float = typename V::Float;
  constexpr int64_t group = 4 * V::outs;
  constexpr bool starts = kStartPerSum<Kind, Path> != 0;
  const int64_t in_features = num_blocks * kBlock;
  const int8_t* x = q.codes.data() + row * in_features;
  const float* dx = q.scale.data() + row * num_blocks;
  const int32_t* start = q.start.data() + row * num_blocks;
  const int32_t* start_high = kHalves<Kind> ? q.start_high.data() + row * num_blocks : nullptr;
  Float acc[Rows];
  _Pragma("GCC unroll 8") for (int r = 0; r < Rows; ++r) acc[r] = V::zerof();
  for (int64_t b = 0; b < num_blocks; ++b) {
    const uint8_t* panel = codes + b * 8 * group;
    const int8_t* xb = x + b * kBlock;
    // Q6_K sums its two halves (groups 0-3, 4-7) apart; other kinds sum all 8 groups in isum.
    Int isum[Rows], high[Rows];
    _Pragma("GCC unroll 8") for (int r = 0; r < Rows; ++r) {
      isum[r] = starts ? V::splat(start[r * num_blocks + b]) : V::zero();
      if constexpr (kHalves<Kind>) high[r] = starts ? V::splat(start_high[r * num_blocks + b]) : V::zero();
    }
    if constexpr (Path == kQ8Avx2 && kNibbles<Kind>) {
      // maddubs' 16-bit pair sums (|2 * 15 * 127| each) add up over the 8 groups without
      // overflow (30480 < 32767): one widening per block instead of one per group.
      __m256i pairs[Rows];
      _Pragma("GCC unroll 8") for (int r = 0; r < Rows; ++r) pairs[r] = _mm256_setzero_si256();
      _Pragma("GCC unroll 8") for (int g = 0; g < 8; ++g) {
        const __m256i w = V::load(panel + g * group);
        _Pragma("GCC unroll 8") for (int r = 0; r < Rows; ++r) pairs[r] = _mm256_add_epi16(
            pairs[r], _mm256_maddubs_epi16(w, V::splat(load_unaligned<int32_t>(xb + r * in_features + 4 * g))));
      }
      _Pragma("GCC unroll 8") for (int r = 0; r < Rows; ++r) isum[r] =
          _mm256_add_epi32(isum[r], _mm256_madd_epi16(pairs[r], _mm256_set1_epi16(1)));
    } else if constexpr (Path == kQ8Avx2 && !kSignedBytes<Kind>) {  // Q5's codes 0..31
      // Pair sums of |2 * 31 * 127| would overflow 16 bits past 4 groups: widened per group.
      _Pragma("GCC unroll 8") for (int g = 0; g < 8; ++g) {
        const __m256i w = V::load(panel + g * group);
        _Pragma("GCC unroll 8") for (int r = 0; r < Rows; ++r) isum[r] = _mm256_add_epi32(
            isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(w, V::splat(load_unaligned<int32_t>(xb + r * in_features + 4 * g))),
                                       _mm256_set1_epi16(1)));
      }
    } else if constexpr (Path == kQ8Avx2) {  // int8 codes
      // |w| times x with w's sign (ggml's mul_sum_i8_pairs): |w| <= 128 and |x| <= 127, so
      // maddubs' pair sums cannot saturate.
      const auto add_group = [&](Int(&sums)[Rows], int g) {
        const __m256i w = V::load(panel + g * group);
        const __m256i magnitude = _mm256_sign_epi8(w, w);
        _Pragma("GCC unroll 8") for (int r = 0; r < Rows; ++r) {
          const __m256i xs = _mm256_sign_epi8(V::splat(load_unaligned<int32_t>(xb + r * in_features + 4 * g)), w);
          sums[r] = _mm256_add_epi32(sums[r],
                                     _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, xs), _mm256_set1_epi16(1)));
        }
      };
      _Pragma("GCC unroll 8") for (int g = 0; g < 4; ++g) add_group(isum, g);
      _Pragma("GCC unroll 8") for (int g = 4; g < 8; ++g) add_group(kHalves<Kind> ? high : isum, g);
    }
#ifdef NASD_VNNI
    else {
      const auto add_group = [&](Int(&sums)[Rows], int g) {
        Int w = V::load(panel + g * group);
        if constexpr (kSignedBytes<Kind>) w = V::flip(w);  // code + 128 as an unsigned byte (isum starts at -128 s)
        _Pragma("GCC unroll 8") for (int r = 0; r < Rows; ++r) sums[r] =
            V::dot4(sums[r], w, V::splat(load_unaligned<int32_t>(xb + r * in_features + 4 * g)));
      };
      _Pragma("GCC unroll 8") for (int g = 0; g < 4; ++g) add_group(isum, g);
      _Pragma("GCC unroll 8") for (int g = 4; g < 8; ++g) add_group(kHalves<Kind> ? high : isum, g);
    }
#endif
    add_block<V, Rows>(acc, scales + b * V::outs, dx + b, num_blocks, [&](int r) { return isum[r]; });
    if constexpr (kHalves<Kind>)
      add_block<V, Rows>(acc, offsets + b * V::outs, dx + b, num_blocks, [&](int r) { return high[r]; });
  }
  if constexpr (kOffset<Kind>) {
    _Pragma("GCC unroll 8") for (int r = 0; r < Rows; ++r) acc[r] = V::add(acc[r], V::loadf(offset_sums + r * V::outs));
  }
  _Pragma("GCC unroll 8") for (int r = 0; r < Rows; ++r) V::store(out + r * stride, acc[r]);
}

// No per-thread state (the VNNI loops).
struct NoThreadState {};

// Calls body(codes, scales, offsets, first, count) for every tile of Outs outputs of `weight`
// (outputs [first, first + count)), repacked into a panel (repack_tile), the tiles shared out
// among torch's threads `grain` at a time. Each thread constructs a ThreadState before its first
// tile and destroys it after its last.
template <int64_t Kind, int64_t Outs, typename ThreadState, typename Body>
void for_each_panel(const uint8_t* weight, int64_t num_blocks, int64_t out_features, int64_t grain, Body body) {
  const int64_t row_bytes = num_blocks * kBlockBytes<Kind>;
  const int64_t tiles = (out_features + Outs - 1) / Outs;
  const std::vector<uint8_t> zeros(row_bytes, 0);  // the missing outputs of a last partial tile
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    const ThreadState state;
    std::vector<uint8_t> codes(num_blocks * 32 * Outs);
    std::vector<float> scales(num_blocks * Outs), offsets(kOffset<Kind> || kHalves<Kind> ? num_blocks * Outs : 0);
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t first = tile * Outs, count = std::min(Outs, out_features - first);
      const uint8_t* outputs[Outs];
      for (int64_t j = 0; j < Outs; ++j) outputs[j] = j < count ? weight + (first + j) * row_bytes : zeros.data();
      const int64_t next_count = tile + 1 < end ? std::min(Outs, out_features - first - Outs) : 0;
      const uint8_t* next = next_count > 0 ? weight + (first + Outs) * row_bytes : weight;
      repack_tile<Kind, Outs>(outputs, num_blocks, codes.data(), scales.data(), offsets.data(), next,
                              next_count * row_bytes);
      body(codes.data(), scales.data(), offsets.data(), first, count);
    }
  });
}

// Rows [r, r + n) of a tile's outputs [first, first + count) from `tile_out` (stride Outs) into `out`.
inline void copy_partial_tile(const float* tile_out, int64_t outs, int64_t n, int64_t count, float* out,
                              int64_t out_features, int64_t r, int64_t first) {
  for (int64_t i = 0; i < n; ++i)
    std::memcpy(out + (r + i) * out_features + first, tile_out + i * outs, sizeof(float) * count);
}

template <int64_t Kind, int64_t Path, typename V>
void q8_simd(const Q8Rows& q, int64_t rows, int64_t in_features, const uint8_t* weight, int64_t out_features,
             float* out) {
  constexpr int64_t outs = V::outs;
  const int64_t num_blocks = in_features / kBlock;
  for_each_panel<Kind, outs, NoThreadState>(
      weight, num_blocks, out_features, 32 / outs,
      [&](const uint8_t* codes, const float* scales, const float* offsets, int64_t first, int64_t count) {
        alignas(64) float tile_out[V::rows * outs];
        float* offset_sums = nullptr;
        if constexpr (kOffset<Kind>) {
          thread_local std::vector<float> buffer;  // grows to the largest call a thread has seen
          buffer.resize(std::max<size_t>(buffer.size(), rows * outs));
          offset_sums = buffer.data();
          offset_rows<V>(offset_sums, offsets, q.offset.data(), rows, num_blocks);
        }
        for (int64_t r = 0; r < rows; r += V::rows) {
          const int64_t n = std::min<int64_t>(V::rows, rows - r);
          // A whole tile's outputs go straight to `out`; a last partial one's through tile_out.
          float* into = count == outs ? out + r * out_features + first : tile_out;
          const int64_t stride = count == outs ? out_features : outs;
          with_rows<V::rows>(n, [&](auto rows_here) {
            q8_tile<Kind, Path, V, decltype(rows_here)::value>(codes, scales, offsets, num_blocks, q, r, into,
                                                               stride, kOffset<Kind> ? offset_sums + r * outs : nullptr);
          });
          if (count < outs) copy_partial_tile(tile_out, outs, n, count, out, out_features, r, first);
        }
      });
}
#endif

#ifdef NASD_AMX
// AMX: a tile dot product sums 16 rows' activations against 16 outputs' codes over a block (or,
// Q6_K, each half block) exactly in int32, where VNNI takes one vpdpbusd per row and 4 inputs.
// The float epilogue is Lanes16's, in the same order, so the bits are the other paths'.
// Tiles: 0, 1 the sums (Q6_K: low and high halves); 2, 3 the rows' codes; 4, 5 the panel's.
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "ldtilecfg reads 64 bytes");

template <int64_t Kind>
TileConfig amx_config() {
  constexpr int k = kHalves<Kind> ? kBlock / 2 : kBlock;  // inputs summed per tile product
  TileConfig c;
  for (int t : {0, 1}) c.rows[t] = 16, c.colsb[t] = 64;
  for (int t : {2, 3}) c.rows[t] = 16, c.colsb[t] = k;
  for (int t : {4, 5}) c.rows[t] = k / 4, c.colsb[t] = 64;
  return c;
}

// Blocks summed per pass before their epilogue: each block's sums leave the tile unit through
// memory, so a pass's tile products (alternating between two sets of tiles) run back to back
// and its epilogue then runs on vector registers alone.
constexpr int64_t kAmxBlocks = 8;

// Fewer rows go the VNNI x 16 way (the same bits): below four tiles of rows the tile products gain
// little or lose (verification steps; docs/results.md), while prompt chunks gain.
constexpr int64_t kAmxMinRows = 64;

// Int32 sums a block leaves per 16 rows and outputs: one tile, two for Q6_K's halves.
template <int64_t Kind>
constexpr int64_t kAmxBlockSums = (kHalves<Kind> ? 2 : 1) * 256;

// The integer sums of rows `row`..`row` + 15 and the panel's 16 outputs over blocks [first, end):
// sums[(b - first) * kAmxBlockSums + half * 256 + r * 16 + j] (half 1: Q6_K's high halves).
template <int64_t Kind>
inline void amx_sums(const uint8_t* codes, const int8_t* x, int64_t in_features, int64_t first, int64_t end,
                     int32_t* sums) {
  for (int64_t b = first; b < end; ++b) {
    const uint8_t* panel = codes + b * 8 * 64;
    const int8_t* xb = x + b * kBlock;
    int32_t* into = sums + (b - first) * kAmxBlockSums<Kind>;
    if constexpr (kHalves<Kind>) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_loadd(2, xb, in_features);
      _tile_loadd(4, panel, 64);
      _tile_loadd(3, xb + kBlock / 2, in_features);
      _tile_loadd(5, panel + 4 * 64, 64);
      _tile_dpbssd(0, 2, 4);
      _tile_dpbssd(1, 3, 5);
      _tile_stored(0, into, 64);
      _tile_stored(1, into + 256, 64);
    } else if ((b - first) % 2 == 0) {
      // Written out twice: GCC's tile intrinsics are macros that paste the tile number into the
      // instruction, so it cannot be a template argument or variable.
      _tile_zero(0);
      _tile_loadd(2, xb, in_features);
      _tile_loadd(4, panel, 64);
      if constexpr (kSignedBytes<Kind>) _tile_dpbssd(0, 2, 4);
      else _tile_dpbsud(0, 2, 4);  // activations signed, codes unsigned
      _tile_stored(0, into, 64);
    } else {
      _tile_zero(1);
      _tile_loadd(3, xb, in_features);
      _tile_loadd(5, panel, 64);
      if constexpr (kSignedBytes<Kind>) _tile_dpbssd(1, 3, 5);
      else _tile_dpbsud(1, 3, 5);
      _tile_stored(1, into, 64);
    }
  }
}

// Rows rows (of a tile of 16 read from `row` on; those past the call's rows are zeros) times the
// panel's 16 outputs, into out[r * stride + j].
template <int64_t Kind, int Rows>
inline void amx_tile(const uint8_t* codes, const float* scales, const float* offsets, int64_t num_blocks,
                     const Q8Rows& q, int64_t row, float* out, int64_t stride) {
  using V = Lanes16;
  constexpr bool starts = kStartPerSum<Kind, kQ8Amx> != 0;
  static_assert(!(starts && kHalves<Kind>), "only Q4_0 starts its sums off zero here");
  const int64_t in_features = num_blocks * kBlock;
  const int8_t* x = q.codes.data() + row * in_features;
  const float* dx = q.scale.data() + row * num_blocks;
  const int32_t* start = q.start.data() + row * num_blocks;
  alignas(64) int32_t sums[kAmxBlocks * kAmxBlockSums<Kind>];
  V::Float acc[Rows];
  _Pragma("GCC unroll 16") for (int r = 0; r < Rows; ++r) acc[r] = V::zerof();
  for (int64_t first = 0; first < num_blocks; first += kAmxBlocks) {
    const int64_t end = std::min(num_blocks, first + kAmxBlocks);
    amx_sums<Kind>(codes, x, in_features, first, end, sums);
    for (int64_t b = first; b < end; ++b) {
      const int32_t* block_sums = sums + (b - first) * kAmxBlockSums<Kind>;
      add_block<V, Rows>(acc, scales + b * 16, dx + b, num_blocks, [&](int r) {
        const V::Int isum = _mm512_load_si512(block_sums + 16 * r);
        return starts ? _mm512_add_epi32(isum, V::splat(start[r * num_blocks + b])) : isum;
      });
      if constexpr (kHalves<Kind>)
        add_block<V, Rows>(acc, offsets + b * 16, dx + b, num_blocks,
                           [&](int r) { return _mm512_load_si512(block_sums + 256 + 16 * r); });
    }
  }
  if constexpr (kOffset<Kind>) add_offsets<V, Rows>(acc, offsets, q.offset.data() + row * num_blocks, num_blocks);
  _Pragma("GCC unroll 16") for (int r = 0; r < Rows; ++r) V::store(out + r * stride, acc[r]);
}

// A thread's tile configuration: loaded before its first tile product, released after its last.
template <int64_t Kind>
struct AmxThreadState {
  AmxThreadState() {
    static const TileConfig config = amx_config<Kind>();
    _tile_loadconfig(&config);
  }
  ~AmxThreadState() { _tile_release(); }
};

// q8_simd's loop with AMX tiles: `q` holds its rows padded to a multiple of 16.
template <int64_t Kind>
void q8_amx(const Q8Rows& q, int64_t rows, int64_t in_features, const uint8_t* weight, int64_t out_features,
            float* out) {
  constexpr int64_t outs = 16;
  const int64_t num_blocks = in_features / kBlock;
  for_each_panel<Kind, outs, AmxThreadState<Kind>>(
      weight, num_blocks, out_features, 2,
      [&](const uint8_t* codes, const float* scales, const float* offsets, int64_t first, int64_t count) {
        alignas(64) float tile_out[16 * outs];
        for (int64_t r = 0; r < rows; r += 16) {
          const int64_t n = std::min<int64_t>(16, rows - r);
          // A whole tile of 16 rows and outputs goes straight to `out`; other tiles through
          // tile_out, their epilogue run for n rounded up to 4 (the padding rows are zeros).
          const bool whole = count == outs && n == 16;
          float* into = whole ? out + r * out_features + first : tile_out;
          const int64_t stride = whole ? out_features : outs;
          const auto multiply = [&]<int Rows>() {
            amx_tile<Kind, Rows>(codes, scales, offsets, num_blocks, q, r, into, stride);
          };
          switch ((n + 3) / 4) {
            case 1: multiply.template operator()<4>(); break;
            case 2: multiply.template operator()<8>(); break;
            case 3: multiply.template operator()<12>(); break;
            default: multiply.template operator()<16>();
          }
          if (!whole) copy_partial_tile(tile_out, outs, n, count, out, out_features, r, first);
        }
      });
}
#endif

template <int64_t Kind>
void quant_linear_q8_impl(const float* x, int64_t rows, int64_t in_features, const uint8_t* weight,
                          int64_t out_features, float* out) {
  switch (q8_path.load()) {
#ifdef NASD_AMX
    case kQ8Amx:
      if (rows >= kAmxMinRows)
        return q8_amx<Kind>(quantize_rows<Kind, kQ8Amx>(x, rows, in_features, (rows + 15) / 16 * 16), rows,
                            in_features, weight, out_features, out);
      [[fallthrough]];
#endif
#ifdef NASD_VNNI512
    case kQ8Vnni512:
      return q8_simd<Kind, kQ8Vnni, Lanes16>(quantize_rows<Kind, kQ8Vnni>(x, rows, in_features), rows, in_features,
                                             weight, out_features, out);
#endif
#ifdef NASD_VNNI
    case kQ8Vnni:
      return q8_simd<Kind, kQ8Vnni, Lanes8>(quantize_rows<Kind, kQ8Vnni>(x, rows, in_features), rows, in_features,
                                            weight, out_features, out);
#endif
#ifdef NASD_AVX2
    case kQ8Avx2:
      return q8_simd<Kind, kQ8Avx2, Lanes8>(quantize_rows<Kind, kQ8Avx2>(x, rows, in_features), rows, in_features,
                                            weight, out_features, out);
#endif
    default:
      return q8_scalar<Kind>(quantize_rows<Kind, kQ8Scalar>(x, rows, in_features), rows, in_features, weight,
                             out_features, out);
  }
}

}  // namespace

namespace nasd {

at::Tensor quant_linear_q8(const at::Tensor& input, const at::Tensor& weight, int64_t kind) {
  static const Multiplies multiplies{quant_linear_q8_impl<kQ4_0>, quant_linear_q8_impl<kQ4_1>,
                                     quant_linear_q8_impl<kQ8_0>, quant_linear_q8_impl<kQ4_K>,
                                     quant_linear_q8_impl<kQ6_K>, quant_linear_q8_impl<kQ5>};
  return multiply_blocks("quant_linear_q8", input, weight, kind, multiplies);
}

int64_t quant_linear_q8_path(int64_t path) {
  if (path >= 0) q8_path = std::min(path, q8_best());
  return q8_path.load();
}

}  // namespace nasd

TORCH_LIBRARY_FRAGMENT(nasd, m) {
  m.def("quant_linear_q8(Tensor input, Tensor weight, int kind) -> Tensor");
  m.impl("quant_linear_q8", c10::DispatchKey::CPU, TORCH_FN(nasd::quant_linear_q8));
  // quant_linear_q8's instructions: 0 scalar, 1 AVX2, 2 VNNI x 8, 3 VNNI x 16, 4 AMX (capped at what this build and the OS allow;
  // -1 leaves it). Returns the one in use. All give the same bits; the tests compare them.
  m.def("quant_linear_q8_path(int path=-1) -> int", TORCH_FN(nasd::quant_linear_q8_path));
}
