// Ragged attention over the paged KV-cache on a CPU (float32): every row's few new queries
// (its last token plus its drafts) against that row's own blocks, all rows in one call.
//
// Why a kernel: a decode step reads every row's whole cache once per layer and does little
// arithmetic with it. One SDPA call per row splits its work by heads only (3 key/value heads
// on 2 cores leaves a core idle a third of the time) and costs a Python round trip per row and
// layer. Here the work is cut into (row, key/value head, run of keys) units that torch's
// thread pool shares out; each unit computes a partial softmax over its keys for every query
// of its row and head, and the partials are merged per query (split-K, as flash-decoding does).
//
// Layout (nasd_core/model/kv_cache.py): a layer's pool is [kv_heads, slots, head_dim]; a block is
// `block_size` consecutive slots; key t of row r lives in slot
// block_table[r][t / block_size] * block_size + t % block_size.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
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

inline void add_scaled(float weight, const float* __restrict x, float* __restrict y, int64_t size) {
#pragma omp simd
  for (int64_t i = 0; i < size; ++i) y[i] += weight * x[i];
}

constexpr int64_t kTile = 32;  // keys per tile: the unit of prefetching

// Per-thread scratch, reused across units.
struct Scratch {
  std::vector<float> queries;  // [num_queries * groups, head_dim], pre-scaled
  std::vector<float> scores;   // [num_queries * groups, keys_per_unit]
};

// Calls `body(first key, keys in the tile, pointer to the tile's first slot)` for the unit's
// keys in tiles of consecutive slots (a tile never crosses a block). The next tile is
// prefetched before the body runs, so its memory reads overlap this tile's arithmetic (the
// cache is read once per step, from memory, not from a CPU cache); `also_prefetch`, when not
// null, is a second pool of the same layout whose next tile is prefetched too (the values,
// while the keys are scored, so the values pass finds them in cache).
template <typename Body>
inline void for_each_tile(const Unit& unit, const int32_t* block_row, int64_t block_size,
                          const float* head_pool, int64_t head_dim, const float* also_prefetch,
                          Body body) {
  const auto tile_at = [&](int64_t key, int64_t* run) {
    const int64_t in_block = key % block_size;
    *run = std::min({kTile, block_size - in_block, unit.end_key - key});
    return head_pool + (int64_t(block_row[key / block_size]) * block_size + in_block) * head_dim;
  };
  int64_t run = 0;
  const float* tile = tile_at(unit.first_key, &run);
  for (int64_t key = unit.first_key; key < unit.end_key;) {
    const int64_t next_key = key + run;
    int64_t next_run = 0;
    const float* next_tile = next_key < unit.end_key ? tile_at(next_key, &next_run) : nullptr;
    const char* bytes = reinterpret_cast<const char*>(next_tile);
    const char* also = also_prefetch == nullptr || next_tile == nullptr
                           ? nullptr
                           : reinterpret_cast<const char*>(also_prefetch + (next_tile - head_pool));
    for (int64_t offset = 0; offset < next_run * head_dim * int64_t(sizeof(float)); offset += 64) {
      __builtin_prefetch(bytes + offset);
      if (also != nullptr) __builtin_prefetch(also + offset);
    }
    body(key, run, tile);
    key = next_key;
    run = next_run;
    tile = next_tile;
  }
}

// One unit: for each query of its row that uses this key/value head, the softmax partial over
// the unit's keys it may see: (max score, sum of exponentials, exponential-weighted values).
// HeadDim > 0 fixes the head size at compile time (the loops then unroll into registers).
template <int64_t HeadDim>
void attend_unit(const Unit& unit, const Shape& shape, const float* query, const float* keys,
                 const float* values, const int32_t* block_row, int64_t query_start,
                 int64_t num_queries, int64_t length, float scale, int64_t keys_per_unit,
                 float* partials, Scratch& scratch) {
  const int64_t head_dim = HeadDim > 0 ? HeadDim : shape.head_dim;
  const int64_t groups = shape.groups;
  const int64_t num_vectors = num_queries * groups;  // query vectors: (position, group)
  const int64_t stride = head_dim + 2;
  const float* head_keys = keys + unit.kv_head * shape.num_slots * head_dim;
  const float* head_values = values + unit.kv_head * shape.num_slots * head_dim;
  const int64_t num_keys = unit.end_key - unit.first_key;

  scratch.queries.resize(num_vectors * head_dim);
  scratch.scores.resize(num_vectors * keys_per_unit);
  float* q = scratch.queries.data();
  for (int64_t position = 0; position < num_queries; ++position) {
    for (int64_t group = 0; group < groups; ++group) {
      const float* source =
          query + ((query_start + position) * shape.num_heads + unit.kv_head * groups + group) * head_dim;
      float* target = q + (position * groups + group) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) target[d] = source[d] * scale;
    }
  }

  // Scores: a dot product per key and query vector, the key loaded once for all vectors.
  float* scores = scratch.scores.data();
  for_each_tile(unit, block_row, shape.block_size, head_keys, head_dim, head_values,
                [&](int64_t first, int64_t run, const float* tile) {
                  float* tile_target = scores + first - unit.first_key;
                  for (int64_t i = 0; i < run; ++i) {
                    const float* key = tile + i * head_dim;
                    for (int64_t vector = 0; vector < num_vectors; ++vector) {
                      const float* qv = q + vector * head_dim;
                      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
                      for (int64_t d = 0; d < head_dim; ++d) sum += qv[d] * key[d];
                      tile_target[vector * keys_per_unit + i] = sum;
                    }
                  }
                });

  // Softmax partials; causal within the step: the row's j-th new query sees its keys up to
  // position length - num_queries + j.
  for (int64_t vector = 0; vector < num_vectors; ++vector) {
    const int64_t position = vector / groups;
    const int64_t visible = std::min(num_keys, length - num_queries + position + 1 - unit.first_key);
    float* out = partials + (unit.first_partial + vector) * stride;
    std::fill(out + 2, out + stride, 0.f);
    float* row_scores = scores + vector * keys_per_unit;
    if (visible <= 0) {
      out[0] = kNegativeInfinity;
      out[1] = 0.f;
      std::fill(row_scores, row_scores + num_keys, 0.f);
      continue;
    }
    float max_score = kNegativeInfinity;
    for (int64_t i = 0; i < visible; ++i) max_score = std::max(max_score, row_scores[i]);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < visible; ++i) {
      row_scores[i] = fast_exp(row_scores[i] - max_score);
      total += row_scores[i];
    }
    std::fill(row_scores + visible, row_scores + num_keys, 0.f);
    out[0] = max_score;
    out[1] = total;
  }

  // Weighted values: per tile and query vector, the accumulator stays in registers while the
  // tile's values (in cache after the first vector) stream past.
  for_each_tile(unit, block_row, shape.block_size, head_values, head_dim, nullptr,
                [&](int64_t first, int64_t run, const float* tile) {
                  for (int64_t vector = 0; vector < num_vectors; ++vector) {
                    const float* weights = scores + vector * keys_per_unit + first - unit.first_key;
                    float* acc = partials + (unit.first_partial + vector) * stride + 2;
                    float local[HeadDim > 0 ? HeadDim : 1];
                    float* sum = HeadDim > 0 ? local : acc;
                    if (HeadDim > 0) std::copy(acc, acc + head_dim, local);
                    for (int64_t i = 0; i < run; ++i) {
                      const float weight = weights[i];
                      const float* value = tile + i * head_dim;
#pragma omp simd
                      for (int64_t d = 0; d < head_dim; ++d) sum[d] += weight * value[d];
                    }
                    if (HeadDim > 0) std::copy(local, local + head_dim, acc);
                  }
                });
}

}  // namespace

// query [positions, heads, head_dim]: the step's packed queries. keys, values: one layer's pool
// [kv_heads, slots, head_dim]. block_table [rows, max_blocks] int32. rows [rows, 3] int64:
// (first packed position, number of new positions, cached length including them).
// Returns [positions, heads, head_dim]; positions that belong to no row are zero.
namespace nasd {

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                           const at::Tensor& block_table, const at::Tensor& rows, double scale,
                           int64_t block_size, int64_t keys_per_unit) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat &&
                  values.scalar_type() == at::kFloat,
              "nasd::paged_attention: float32 tensors only");
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
  const float* k = keys.data_ptr<float>();
  const float* v = values.data_ptr<float>();
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
  std::atomic<int64_t> next_unit{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Scratch scratch;
    for (int64_t taken = next_unit++; taken < int64_t(units.size()); taken = next_unit++) {
      const Unit& unit = units[order[taken]];
      const int64_t* info = row_info + unit.row * 3;
      const int32_t* block_row = table + unit.row * shape.max_blocks;
      const auto attend = shape.head_dim == 64    ? attend_unit<64>
                          : shape.head_dim == 128 ? attend_unit<128>
                                                  : attend_unit<0>;
      attend(unit, shape, q, k, v, block_row, info[0], info[1], info[2], float(scale), keys_per_unit,
             partials.data(), scratch);
    }
  });

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

}  // namespace nasd

TORCH_LIBRARY(nasd, m) {
  m.def(
      "paged_attention(Tensor query, Tensor keys, Tensor values, Tensor block_table, Tensor rows, "
      "float scale, int block_size, int keys_per_unit) -> Tensor");
  m.impl("paged_attention", c10::DispatchKey::CPU, TORCH_FN(nasd::paged_attention));
}
