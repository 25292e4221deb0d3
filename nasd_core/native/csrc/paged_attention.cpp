// Ragged attention over the paged KV-cache on a CPU: every row's few new queries (its last token
// plus its drafts) against that row's own blocks, all rows in one call. Queries and arithmetic are
// float32; the pool is float32 or float16 (half the bytes a step reads, llama.cpp's default cache
// type), widened exactly as it is read.
//
// Why a kernel: a decode step reads every row's whole cache once per layer and does little
// arithmetic with it. One SDPA call per row splits its work by heads only (3 key/value heads
// on 2 cores leaves a core idle a third of the time) and costs a Python round trip per row and
// layer. Here the work is cut into (row, key/value head, run of keys) units that torch's
// thread pool shares out; each unit computes a partial softmax over its keys for every query
// of its row and head, and the partials are merged per query (split-K, as flash-decoding does).
//
// Layout (nasd_core/layers/kv_cache.py): a layer's pool is [kv_heads, slots, head_dim]; a block is
// `block_size` consecutive slots; key t of row r lives in slot
// block_table[r][t / block_size] * block_size + t % block_size.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels.h"
#include "simd.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();

struct Unit {
  int64_t row;
  int64_t kv_head;
  int64_t first_key;  // the unit covers keys [first_key, end_key) of its row
  int64_t end_key;
  int64_t first_partial;  // index of its first partial result (one per query)
};

struct Shape {
  int64_t num_heads, num_kv_heads, groups, head_dim, num_slots, block_size, max_blocks;
};

// exp(x) for x <= 0 in a form the compiler vectorises (the loop calling it has no libm call):
// 2^n * p(r) with x = n ln2 + r, |r| <= ln2/2, p a degree-6 polynomial (relative error ~2e-7,
// below float32 rounding of the softmax sums). Very negative inputs flush to 0.
inline float fast_exp(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// A pool element as float32 (exact for both types).
inline float widen(float x) { return x; }
inline float widen(at::Half x) { return static_cast<float>(x); }

// Lanes of the score and value loops: 16 on AVX-512, else 8. Both give the same bits (each score
// and each output dimension is one chain in a fixed order, whatever the register holding it);
// the tests switch it to compare them (nasd::paged_attention_lanes).
#ifdef __AVX512F__
constexpr int64_t kBestLanes = 16;
#else
constexpr int64_t kBestLanes = 8;
#endif
std::atomic<int64_t> loop_lanes{kBestLanes};

inline void add_scaled(float weight, const float* __restrict x, float* __restrict y, int64_t size) {
#pragma omp simd
  for (int64_t i = 0; i < size; ++i) y[i] += weight * x[i];
}

constexpr int64_t kTile = 32;  // keys per tile: the unit of prefetching
constexpr int64_t kMaxTransposedDim = 128;  // the widest head score_tile transposes (64 and 128 dispatched)

// Per-thread scratch, reused across units.
struct Scratch {
  std::vector<float> queries;  // [kVectorBlock, head_dim], pre-scaled
  std::vector<float> scores;   // [kVectorBlock, keys_per_unit rounded up to 8]
  alignas(64) float transposed[kMaxTransposedDim * kTile];  // a key tile, [head_dim, kTile]
};

// Calls `body(first key, keys in the tile, pointer to the tile's first slot)` for the unit's
// keys in tiles of consecutive slots (a tile never crosses a block). The next tile is
// prefetched before the body runs, so its memory reads overlap this tile's arithmetic (the
// cache is read once per step, from memory, not from a CPU cache); `also_prefetch`, when not
// null, is a second pool of the same layout whose next tile is prefetched too (the values,
// while the keys are scored, so the values pass finds them in cache).
template <typename KV, typename Body>
inline void for_each_tile(const Unit& unit, const int32_t* block_row, int64_t block_size,
                          const KV* head_pool, int64_t head_dim, const KV* also_prefetch, Body body) {
  const auto tile_at = [&](int64_t key, int64_t* run) {
    const int64_t in_block = key % block_size;
    *run = std::min({kTile, block_size - in_block, unit.end_key - key});
    return head_pool + (int64_t(block_row[key / block_size]) * block_size + in_block) * head_dim;
  };
  int64_t run = 0;
  const KV* tile = tile_at(unit.first_key, &run);
  for (int64_t key = unit.first_key; key < unit.end_key;) {
    const int64_t next_key = key + run;
    int64_t next_run = 0;
    const KV* next_tile = next_key < unit.end_key ? tile_at(next_key, &next_run) : nullptr;
    const char* bytes = reinterpret_cast<const char*>(next_tile);
    const char* also = also_prefetch == nullptr || next_tile == nullptr
                           ? nullptr
                           : reinterpret_cast<const char*>(also_prefetch + (next_tile - head_pool));
    for (int64_t offset = 0; offset < next_run * head_dim * int64_t(sizeof(KV)); offset += 64) {
      __builtin_prefetch(bytes + offset);
      if (also != nullptr) __builtin_prefetch(also + offset);
    }
    body(key, run, tile);
    key = next_key;
    run = next_run;
    tile = next_tile;
  }
}

#ifdef NASD_AVX2
// Heads the AVX2 loops below take (whole 64-float chunks, a transposed tile within Scratch).
template <int64_t HeadDim>
constexpr bool kSimdHead = HeadDim > 0 && HeadDim % 64 == 0 && HeadDim <= kMaxTransposedDim;
#else
template <int64_t HeadDim>
constexpr bool kSimdHead = false;
#endif

// scores[0, visible) <- exp(score - max) over the query's visible scores; returns (max, their
// sum). With AVX2 the scores go 8 at a time (nasd_simd::exp; 16 at a time on AVX-512, still summed
// 8 at a time), the last 8 padded (the row holds visible rounded up to 8) and masked to 0, so each
// score's lane and the sum's order depend on `visible` alone; elsewhere in order, one at a time.
inline std::pair<float, float> softmax_scores(float* scores, int64_t visible) {
#ifdef NASD_AVX2
  {
    const int64_t padded = (visible + 7) / 8 * 8;
    std::fill(scores + visible, scores + padded, kNegativeInfinity);
    __m256 top = _mm256_set1_ps(kNegativeInfinity);
    for (int64_t i = 0; i < padded; i += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(scores + i));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, top);
    const float max_score = *std::max_element(lanes, lanes + 8);
    const __m256 shift = _mm256_set1_ps(max_score);
    __m256 total = _mm256_setzero_ps();
    int64_t i = 0;
#ifdef __AVX512F__
    // 16 scores at a time; the sum still adds them 8 at a time in order (the same bits).
    if (loop_lanes.load(std::memory_order_relaxed) == 16) {
      const __m512 shift16 = _mm512_set1_ps(max_score);
      const __m512 lane = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      for (; i + 16 <= padded; i += 16) {
        const __mmask16 seen = _mm512_cmp_ps_mask(_mm512_set1_ps(float(visible - i)), lane, _CMP_GT_OQ);
        const __m512 x = _mm512_sub_ps(_mm512_loadu_ps(scores + i), shift16);
        const __m512 e = _mm512_maskz_mov_ps(seen, nasd_simd::exp16(x));
        _mm512_storeu_ps(scores + i, e);
        const __m512d halves = _mm512_castps_pd(e);  // the high 8 as doubles: AVX-512F, not DQ
        total = _mm256_add_ps(total, _mm512_castps512_ps256(e));
        total = _mm256_add_ps(total, _mm256_castpd_ps(_mm512_extractf64x4_pd(halves, 1)));
      }
    }
#endif
    for (; i < padded; i += 8) {
      const __m256 seen = _mm256_cmp_ps(_mm256_set1_ps(float(visible - i)),
                                        _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), _CMP_GT_OQ);
      const __m256 e = _mm256_and_ps(seen, nasd_simd::exp(_mm256_sub_ps(_mm256_loadu_ps(scores + i), shift)));
      _mm256_storeu_ps(scores + i, e);
      total = _mm256_add_ps(total, e);
    }
    return {max_score, nasd_simd::lanes_sum(total)};
  }
#endif
  float max_score = kNegativeInfinity;
  for (int64_t i = 0; i < visible; ++i) max_score = std::max(max_score, scores[i]);
#pragma omp simd
  for (int64_t i = 0; i < visible; ++i) scores[i] = fast_exp(scores[i] - max_score);
  float total = 0.f;
  for (int64_t i = 0; i < visible; ++i) total += scores[i];
  return {max_score, total};
}

// acc[0, head_dim) += the tile's `run` values weighted by weights[0, run), key by key in order:
// each dimension one chain, which the SIMD loops below keep whatever vectors they take together.
template <int64_t HeadDim, typename KV>
inline void add_weighted_values_scalar(const float* weights, int64_t run, const KV* tile, int64_t head_dim,
                                       float* acc) {
  float local[HeadDim > 0 ? HeadDim : 1];
  float* sum = HeadDim > 0 ? local : acc;
  if (HeadDim > 0) std::copy(acc, acc + head_dim, local);
  for (int64_t i = 0; i < run; ++i) {
    const float weight = weights[i];
    const KV* value = tile + i * head_dim;
#pragma omp simd
    for (int64_t d = 0; d < head_dim; ++d) sum[d] += weight * widen(value[d]);
  }
  if (HeadDim > 0) std::copy(local, local + head_dim, acc);
}

#ifdef NASD_AVX2
// One register of float lanes, the score and value loops written once over it: 8 lanes (AVX2)
// or 16 (AVX-512). Each score and each output dimension is one chain in a fixed order whatever
// the register holding it, so both give the same bits.
struct Ymm {
  using F = __m256;
  static constexpr int64_t lanes = 8;
  static constexpr int max_vectors = 2;  // query vectors a loop takes at once: 16 registers
  static F zero() { return _mm256_setzero_ps(); }
  static F splat(float v) { return _mm256_set1_ps(v); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F load(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  __attribute__((always_inline)) static void transpose(F* r) { nasd_simd::transpose8(r); }  // rows in, columns out
};
#endif
#ifdef __AVX512F__
struct Zmm {
  using F = __m512;
  static constexpr int64_t lanes = 16;
  static constexpr int max_vectors = 4;  // 32 registers
  static F zero() { return _mm512_setzero_ps(); }
  static F splat(float v) { return _mm512_set1_ps(v); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F load(const at::Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  // 64 shuffles where four 8 x 8 take 96; inlined (a call passes the 16 registers through memory).
  __attribute__((always_inline)) static void transpose(F* r) { nasd_simd::transpose16(r); }
};
#endif

#ifdef NASD_AVX2
// Calls body.template operator()<V>() with V the register type of the lanes in use.
template <typename Body>
inline void with_lanes(Body body) {
#ifdef __AVX512F__
  if (loop_lanes.load(std::memory_order_relaxed) == 16) return body.template operator()<Zmm>();
#endif
  body.template operator()<Ymm>();
}

// Splits `count` query vectors into groups of at most V::max_vectors: body.template
// operator()<n>(done) for each, n its vectors, `done` the vectors before it.
template <typename V, typename Body>
inline void for_each_group(int64_t count, Body body) {
  for (int64_t done = 0; done < count;) {
    const int64_t n = std::min<int64_t>(V::max_vectors, count - done);
    switch (n) {
      case 4:
        if constexpr (V::max_vectors >= 4) body.template operator()<4>(done);
        break;
      case 3:
        if constexpr (V::max_vectors >= 3) body.template operator()<3>(done);
        break;
      case 2: body.template operator()<2>(done); break;
      default: body.template operator()<1>(done);
    }
    done += n;
  }
}

// N query vectors' accumulators (acc + j * acc_stride) += the tile's `run` values weighted by
// weights[j * weight_stride + i], key by key in order (each dimension's chain as in
// add_weighted_values_scalar). Why together: each value is widened from the pool once for the
// N vectors instead of once per vector. 4 registers of dimensions at a time.
template <typename V, int64_t HeadDim, typename KV, int N>
inline void weigh_values(const float* weights, int64_t weight_stride, int64_t run, const KV* tile, float* acc,
                         int64_t acc_stride) {
  for (int64_t d0 = 0; d0 < HeadDim; d0 += 4 * V::lanes) {
    typename V::F sum[N][4];
    for (int j = 0; j < N; ++j)
      for (int64_t g = 0; g < 4; ++g) sum[j][g] = V::load(acc + j * acc_stride + d0 + V::lanes * g);
    for (int64_t i = 0; i < run; ++i) {
      const KV* value = tile + i * HeadDim + d0;
      typename V::F v[4];
      for (int64_t g = 0; g < 4; ++g) v[g] = V::load(value + V::lanes * g);
      for (int j = 0; j < N; ++j) {
        const typename V::F weight = V::splat(weights[j * weight_stride + i]);
        for (int64_t g = 0; g < 4; ++g) sum[j][g] = V::fma(weight, v[g], sum[j][g]);
      }
    }
    for (int j = 0; j < N; ++j)
      for (int64_t g = 0; g < 4; ++g) V::store(acc + j * acc_stride + d0 + V::lanes * g, sum[j][g]);
  }
}

// N query vectors' scores (q: [N, HeadDim]) against a transposed tile (kt: [HeadDim, kTile], a
// register holding V::lanes keys' values of one dimension) into target[j * target_stride + i]:
// each score one chain of fused multiply-adds over the dimensions in order, no horizontal sums.
template <typename V, int64_t HeadDim, int N>
inline void score_vectors(const float* q, const float* kt, int64_t run, float* target, int64_t target_stride) {
  constexpr int64_t per = kTile / V::lanes;  // registers of one vector's scores
  typename V::F acc[N * per];
  for (auto& a : acc) a = V::zero();
  for (int64_t d = 0; d < HeadDim; ++d) {
    typename V::F k[per];
    for (int64_t g = 0; g < per; ++g) k[g] = V::load(kt + d * kTile + V::lanes * g);
    for (int j = 0; j < N; ++j) {
      const typename V::F b = V::splat(q[j * HeadDim + d]);
      for (int64_t g = 0; g < per; ++g) acc[j * per + g] = V::fma(b, k[g], acc[j * per + g]);
    }
  }
  alignas(64) float spill[kTile];
  for (int j = 0; j < N; ++j) {
    float* out = target + j * target_stride;
    for (int64_t g = 0; g < per; ++g) V::store((run == kTile ? out : spill) + V::lanes * g, acc[j * per + g]);
    if (run < kTile) std::memcpy(out, spill, sizeof(float) * run);
  }
}

// kt ([HeadDim, kTile]) <- a tile of `run` keys ([run, HeadDim]) transposed, zeros past `run`, in
// pieces of V::lanes x V::lanes (the same kt whatever V).
template <typename V, int64_t HeadDim, typename KV>
inline void transpose_tile(const KV* tile, int64_t run, float* kt) {
  for (int64_t i0 = 0; i0 < kTile; i0 += V::lanes) {
    for (int64_t d0 = 0; d0 < HeadDim; d0 += V::lanes) {
      typename V::F r[V::lanes];
      for (int64_t k = 0; k < V::lanes; ++k) r[k] = i0 + k < run ? V::load(tile + (i0 + k) * HeadDim + d0) : V::zero();
      V::transpose(r);
      for (int64_t j = 0; j < V::lanes; ++j) V::store(kt + (d0 + j) * kTile + i0, r[j]);
    }
  }
}

// score_tile and add_weighted_values on V's registers, for any number of vectors.
template <typename V, int64_t HeadDim, typename KV>
inline void score_tile_simd(const float* q, int64_t count, const KV* tile, int64_t run, float* kt, float* target,
                            int64_t target_stride) {
  transpose_tile<V, HeadDim>(tile, run, kt);
  for_each_group<V>(count, [&]<int N>(int64_t done) {
    score_vectors<V, HeadDim, N>(q + done * HeadDim, kt, run, target + done * target_stride, target_stride);
  });
}

template <typename V, int64_t HeadDim, typename KV>
inline void add_weighted_values_simd(int64_t count, const float* weights, int64_t weight_stride, int64_t run,
                                     const KV* tile, float* acc, int64_t acc_stride) {
  for_each_group<V>(count, [&]<int N>(int64_t done) {
    weigh_values<V, HeadDim, KV, N>(weights + done * weight_stride, weight_stride, run, tile,
                                    acc + done * acc_stride, acc_stride);
  });
}
#endif

// `count` query vectors' accumulators (acc + j * acc_stride) += the tile's `run` values weighted
// by weights[j * weight_stride + i], key by key in order.
template <int64_t HeadDim, typename KV>
inline void add_weighted_values(int64_t count, const float* weights, int64_t weight_stride, int64_t run,
                                const KV* tile, int64_t head_dim, float* acc, int64_t acc_stride) {
#ifdef NASD_AVX2
  if constexpr (kSimdHead<HeadDim>) {
    return with_lanes([&]<typename V>() {
      add_weighted_values_simd<V, HeadDim>(count, weights, weight_stride, run, tile, acc, acc_stride);
    });
  }
#endif
  for (int64_t j = 0; j < count; ++j)
    add_weighted_values_scalar<HeadDim>(weights + j * weight_stride, run, tile, head_dim, acc + j * acc_stride);
}

// The scores of `count` query vectors (pre-scaled, [count, D]) against a tile of `run` keys
// ([run, D], run <= kTile) into target[v * target_stride + i]. Each score is one chain of fused
// multiply-adds over the head's dimensions in order, the same bits whatever vectors or keys are
// computed beside it. With AVX2 the tile is transposed into `kt` ([D, kTile]) so that a register
// holds 8 (or 16) keys' values of one dimension: a vector's 32 scores then take 4 (2) registers
// and no horizontal sums.
template <int64_t HeadDim, typename KV>
inline void score_tile(const float* q, int64_t count, int64_t head_dim, const KV* tile, int64_t run,
                       float* kt, float* target, int64_t target_stride) {
  const int64_t dims = HeadDim > 0 ? HeadDim : head_dim;
#ifdef NASD_AVX2
  if constexpr (kSimdHead<HeadDim>) {
    return with_lanes(
        [&]<typename V>() { score_tile_simd<V, HeadDim>(q, count, tile, run, kt, target, target_stride); });
  }
#endif
  (void)kt;
  for (int64_t i = 0; i < run; ++i) {
    const KV* key = tile + i * dims;
    for (int64_t vector = 0; vector < count; ++vector) {
      const float* qv = q + vector * dims;
      float sum = 0.f;
      for (int64_t d = 0; d < dims; ++d) sum += qv[d] * widen(key[d]);  // in order (no reassociation)
      target[vector * target_stride + i] = sum;
    }
  }
}

// Query vectors a unit scores at a time: their queries (12 KB at D = 64) and their scores over a
// unit of up to 1024 keys (attention.KERNEL_MAX_KEYS_PER_UNIT: 192 KB) stay in the L2 cache
// through the three passes below, where a prompt chunk's hundreds of vectors at once spilled its
// scores to memory (3x slower prefill). Each key tile is transposed once per block, so fewer,
// larger blocks transpose less (and score more keys past early queries' diagonal, masked after).
constexpr int64_t kVectorBlock = 48;

// One unit: for each query of its row that uses this key/value head, the softmax partial over
// the unit's keys it may see: (max score, sum of exponentials, exponential-weighted values).
// The vectors go in blocks, each block over the keys its last query sees. Each vector's numbers
// are computed by the same loops whatever its block, so a query's partial does not depend on
// the row's other queries. HeadDim > 0 fixes the head size at compile time (the loops then
// unroll into registers).
template <int64_t HeadDim, typename KV>
void attend_unit(const Unit& unit, const Shape& shape, const float* query, const KV* keys,
                 const KV* values, const int32_t* block_row, int64_t query_start,
                 int64_t num_queries, int64_t length, float scale, int64_t keys_per_unit,
                 float* partials, Scratch& scratch) {
  const int64_t head_dim = HeadDim > 0 ? HeadDim : shape.head_dim;
  const int64_t groups = shape.groups;
  const int64_t num_vectors = num_queries * groups;  // query vectors: (position, group)
  const int64_t stride = head_dim + 2;
  const KV* head_keys = keys + unit.kv_head * shape.num_slots * head_dim;
  const KV* head_values = values + unit.kv_head * shape.num_slots * head_dim;
  const int64_t num_keys = unit.end_key - unit.first_key;
  // A vector's scores row: room for softmax_scores' last group of 8 within the row.
  const int64_t score_stride = (keys_per_unit + 7) / 8 * 8;
  // Keys [first_key, first_key + visible) of the unit that the j-th new query may see (causal
  // within the step: the row's j-th new query sees its keys up to position length - num_queries + j).
  const auto visible_keys = [&](int64_t position) {
    return std::min(num_keys, length - num_queries + position + 1 - unit.first_key);
  };

  scratch.queries.resize(kVectorBlock * head_dim);
  scratch.scores.resize(kVectorBlock * score_stride);
  float* q = scratch.queries.data();
  float* scores = scratch.scores.data();
  for (int64_t block = 0; block < num_vectors; block += kVectorBlock) {
    const int64_t block_vectors = std::min(kVectorBlock, num_vectors - block);
    const int64_t block_keys = std::max<int64_t>(0, visible_keys((block + block_vectors - 1) / groups));
    for (int64_t i = 0; i < block_vectors; ++i) {
      const int64_t position = (block + i) / groups, group = (block + i) % groups;
      const float* source =
          query + ((query_start + position) * shape.num_heads + unit.kv_head * groups + group) * head_dim;
      float* target = q + i * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) target[d] = source[d] * scale;
    }
    const Unit seen{unit.row, unit.kv_head, unit.first_key, unit.first_key + block_keys, unit.first_partial};

    // Scores: the block's vectors against each tile of the keys they see.
    if (block_keys > 0) {
      for_each_tile(seen, block_row, shape.block_size, head_keys, head_dim, head_values,
                    [&](int64_t first, int64_t run, const KV* tile) {
                      score_tile<HeadDim>(q, block_vectors, head_dim, tile, run, scratch.transposed,
                                          scores + first - unit.first_key, score_stride);
                    });
    }

    // Softmax partials.
    for (int64_t vector = 0; vector < block_vectors; ++vector) {
      const int64_t visible = visible_keys((block + vector) / groups);
      float* out = partials + (unit.first_partial + block + vector) * stride;
      std::fill(out + 2, out + stride, 0.f);
      float* row_scores = scores + vector * score_stride;
      if (visible <= 0) {  // a unit wholly after this query's position: the merge skips it
        out[0] = kNegativeInfinity;
        out[1] = 0.f;
        continue;
      }
      const auto [max_score, total] = softmax_scores(row_scores, visible);
      out[0] = max_score;
      out[1] = total;
    }

    // Weighted values, per tile, each vector over the keys it sees: the vectors that see the same
    // keys of the tile (a position's query heads; every position that sees the whole tile) go
    // through it together, each value widened once for several of them.
    if (block_keys > 0) {
      for_each_tile(seen, block_row, shape.block_size, head_values, head_dim, static_cast<const KV*>(nullptr),
                    [&](int64_t first, int64_t run, const KV* tile) {
                      const int64_t offset = first - unit.first_key;
                      const auto keys_of = [&](int64_t vector) {
                        return std::min(run, visible_keys((block + vector) / groups) - offset);
                      };
                      for (int64_t vector = 0; vector < block_vectors;) {
                        const int64_t keys = keys_of(vector);
                        int n = 1;
                        while (vector + n < block_vectors && keys_of(vector + n) == keys) ++n;
                        if (keys > 0) {
                          add_weighted_values<HeadDim>(n, scores + vector * score_stride + offset, score_stride, keys,
                                                       tile, head_dim,
                                                       partials + (unit.first_partial + block + vector) * stride + 2,
                                                       stride);
                        }
                        vector += n;
                      }
                    });
    }
  }
}

}  // namespace

// query [positions, heads, head_dim] float32: the step's packed queries. keys, values: one layer's
// pool [kv_heads, slots, head_dim], both float32 or both float16. block_table [rows, max_blocks]
// int32. rows [rows, 3] int64: (first packed position, number of new positions, cached length
// including them).
// Returns [positions, heads, head_dim]; positions that belong to no row are zero.
namespace nasd {

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                           const at::Tensor& block_table, const at::Tensor& rows, double scale,
                           int64_t block_size, int64_t keys_per_unit) {
  TORCH_CHECK(query.scalar_type() == at::kFloat &&
                  (keys.scalar_type() == at::kFloat || keys.scalar_type() == at::kHalf) &&
                  values.scalar_type() == keys.scalar_type(),
              "nasd::paged_attention: a float32 query, float32 or float16 pools");
  TORCH_CHECK(query.is_contiguous() && keys.is_contiguous() && values.is_contiguous(),
              "nasd::paged_attention: contiguous tensors only");
  TORCH_CHECK(query.dim() == 3 && keys.dim() == 3 && keys.sizes() == values.sizes() &&
                  query.size(2) == keys.size(2) && query.size(1) % keys.size(0) == 0,
              "nasd::paged_attention: query [T, heads, D], pools [kv_heads, slots, D]");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.is_contiguous() && block_table.dim() == 2,
              "nasd::paged_attention: block_table must be contiguous int32 [rows, max_blocks]");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous() && rows.dim() == 2 &&
                  rows.size(1) == 3 && rows.size(0) == block_table.size(0),
              "nasd::paged_attention: rows must be contiguous int64 [rows, 3]");
  TORCH_CHECK(block_size > 0 && keys_per_unit > 0, "nasd::paged_attention: sizes must be positive");
  const Shape shape{query.size(1), keys.size(0), query.size(1) / keys.size(0), query.size(2),
                    keys.size(1),  block_size,   block_table.size(1)};
  const int64_t num_rows = rows.size(0);
  const int64_t* row_info = rows.data_ptr<int64_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  for (int64_t row = 0; row < num_rows; ++row) {
    const int64_t start = row_info[row * 3], count = row_info[row * 3 + 1], length = row_info[row * 3 + 2];
    TORCH_CHECK(start >= 0 && count >= 0 && start + count <= query.size(0) && count <= length &&
                    length <= shape.max_blocks * block_size,
                "nasd::paged_attention: row ", row, " out of range");
    for (int64_t block = 0; block * block_size < length; ++block) {
      const int64_t id = table[row * shape.max_blocks + block];
      TORCH_CHECK(id >= 0 && (id + 1) * block_size <= shape.num_slots,
                  "nasd::paged_attention: row ", row, " has a block outside the pool");
    }
  }

  // Units of one (row, head) pair are consecutive; pair_start[p] is where pair p's begin.
  std::vector<Unit> units;
  std::vector<int64_t> pair_start;
  int64_t num_partials = 0;
  for (int64_t row = 0; row < num_rows; ++row) {
    const int64_t count = row_info[row * 3 + 1], length = row_info[row * 3 + 2];
    if (count == 0) continue;
    for (int64_t head = 0; head < shape.num_kv_heads; ++head) {
      pair_start.push_back(int64_t(units.size()));
      for (int64_t first = 0; first < length; first += keys_per_unit) {
        units.push_back({row, head, first, std::min(length, first + keys_per_unit), num_partials});
        num_partials += count * shape.groups;
      }
    }
  }
  const int64_t stride = shape.head_dim + 2;
  std::vector<float> partials(num_partials * stride);
  const float* q = query.data_ptr<float>();
  // Units differ in cost (a row verifying 16 drafts has 17x the queries of a decode row), so
  // threads take them one at a time, dearest first, instead of in fixed contiguous shares.
  std::vector<int64_t> order(units.size());
  for (int64_t index = 0; index < int64_t(units.size()); ++index) order[index] = index;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    const auto cost = [&](const Unit& unit) {
      return row_info[unit.row * 3 + 1] * (unit.end_key - unit.first_key);
    };
    return cost(units[a]) > cost(units[b]);
  });
  const auto attend_units = [&](const auto* k, const auto* v) {
    using KV = std::remove_cv_t<std::remove_pointer_t<decltype(k)>>;
    const auto attend = shape.head_dim == 64    ? attend_unit<64, KV>
                        : shape.head_dim == 128 ? attend_unit<128, KV>
                                                : attend_unit<0, KV>;
    std::atomic<int64_t> next_unit{0};
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      Scratch scratch;
      for (int64_t taken = next_unit++; taken < int64_t(units.size()); taken = next_unit++) {
        const Unit& unit = units[order[taken]];
        const int64_t* info = row_info + unit.row * 3;
        const int32_t* block_row = table + unit.row * shape.max_blocks;
        attend(unit, shape, q, k, v, block_row, info[0], info[1], info[2], float(scale), keys_per_unit,
               partials.data(), scratch);
      }
    });
  };
  if (keys.scalar_type() == at::kHalf) {
    attend_units(keys.data_ptr<at::Half>(), values.data_ptr<at::Half>());
  } else {
    attend_units(keys.data_ptr<float>(), values.data_ptr<float>());
  }

  // Merge: each query's partials (one per unit of its row and head) combine with weights
  // exp(max_u - max), the usual log-sum-exp rescaling.
  at::Tensor out = at::zeros_like(query);
  float* o = out.data_ptr<float>();
  pair_start.push_back(int64_t(units.size()));
  at::parallel_for(0, int64_t(pair_start.size()) - 1, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(shape.head_dim);
    for (int64_t pair = begin; pair < end; ++pair) {
      const Unit& first = units[pair_start[pair]];
      const int64_t num_units = pair_start[pair + 1] - pair_start[pair];
      const int64_t query_start = row_info[first.row * 3], count = row_info[first.row * 3 + 1];
      for (int64_t slot = 0; slot < count * shape.groups; ++slot) {
        float max_score = kNegativeInfinity;
        for (int64_t u = 0; u < num_units; ++u) {
          max_score = std::max(max_score, partials[(units[pair_start[pair] + u].first_partial + slot) * stride]);
        }
        float total = 0.f;
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t u = 0; u < num_units; ++u) {
          const float* part = partials.data() + (units[pair_start[pair] + u].first_partial + slot) * stride;
          if (part[1] == 0.f) continue;  // a unit wholly after this query's position
          const float weight = std::exp(part[0] - max_score);
          total += weight * part[1];
          add_scaled(weight, part + 2, acc.data(), shape.head_dim);
        }
        const int64_t position = slot / shape.groups;
        const int64_t head = first.kv_head * shape.groups + slot % shape.groups;
        float* target = o + ((query_start + position) * shape.num_heads + head) * shape.head_dim;
        for (int64_t d = 0; d < shape.head_dim; ++d) target[d] = acc[d] / total;
      }
    }
  });
  return out;
}

int64_t paged_attention_lanes(int64_t wanted) {
  if (wanted > 0) loop_lanes = wanted >= 16 ? kBestLanes : 8;
  return loop_lanes.load();
}

}  // namespace nasd

TORCH_LIBRARY(nasd, m) {
  m.def(
      "paged_attention(Tensor query, Tensor keys, Tensor values, Tensor block_table, Tensor rows, "
      "float scale, int block_size, int keys_per_unit) -> Tensor");
  m.impl("paged_attention", c10::DispatchKey::CPU, TORCH_FN(nasd::paged_attention));
  // The lanes of paged_attention's loops: 8 or 16 (capped at what this build has; -1 leaves them).
  // Returns the lanes in use. Both give the same bits; the tests compare them.
  m.def("paged_attention_lanes(int lanes=-1) -> int", TORCH_FN(nasd::paged_attention_lanes));
}
