// The pointwise parts of a llama-type decoder layer, one call each (nasd_core/layers/lean_decoder.py):
// RMSNorm with the residual add before it, rotary embedding with the split of the fused q/k/v
// projection, SiLU(gate) * up.
//
// Why: transformers runs each as a handful of small tensor ops (RMSNorm five, rotary a dozen),
// and on a CPU a small op's dispatch costs more than its arithmetic: they took about half of a
// one-token step of the embedded model on the GGUF blocks.
//
// Exactness: every row (token) is computed by one thread with the same code whatever the
// number of rows, so a row's results are the same bits alone and among others.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

#include "kernels.h"
#include "simd.h"

namespace {

// Rows per task: a one-token step stays on the calling thread.
constexpr int64_t kGrainRows = 16;

float sum_of_squares(const float* x, int64_t n) {
  int64_t i = 0;
  float total;
#ifdef NASD_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  total = nasd_simd::lanes_sum(acc);
#else
  total = 0.0f;
#endif
  for (; i < n; ++i) total += x[i] * x[i];
  return total;
}

void check_float_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu(), what, " must be a float32 CPU tensor");
}

}  // namespace

namespace nasd {

// (input + residual, RMSNorm(input + residual) * weight) over the last dimension; without a
// residual, (input, RMSNorm(input) * weight).
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& input, const c10::optional<at::Tensor>& residual,
                                            const at::Tensor& weight, double eps) {
  check_float_rows(input, "rms_norm: input");
  check_float_rows(weight, "rms_norm: weight");
  const int64_t width = input.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == width, "rms_norm: weight must have ", width, " values");
  const at::Tensor x = input.reshape({-1, width}).contiguous();
  const at::Tensor w = weight.contiguous();
  at::Tensor summed = x;
  at::Tensor r;
  if (residual.has_value()) {
    check_float_rows(*residual, "rms_norm: residual");
    TORCH_CHECK(residual->sizes() == input.sizes(), "rms_norm: residual and input differ in shape");
    r = residual->reshape({-1, width}).contiguous();
    summed = at::empty_like(x);
  }
  at::Tensor normed = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* rp = residual.has_value() ? r.data_ptr<float>() : nullptr;
  const float* wp = w.data_ptr<float>();
  float* sp = summed.data_ptr<float>();
  float* np = normed.data_ptr<float>();
  const float epsilon = static_cast<float>(eps);
  at::parallel_for(0, x.size(0), kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      float* s = sp + row * width;
      if (rp != nullptr) {
        for (int64_t i = 0; i < width; ++i) s[i] = xp[row * width + i] + rp[row * width + i];
      }
      const float scale = 1.0f / std::sqrt(sum_of_squares(s, width) / static_cast<float>(width) + epsilon);
      float* out = np + row * width;
      for (int64_t i = 0; i < width; ++i) out[i] = wp[i] * (s[i] * scale);
    }
  });
  return {summed.view(input.sizes()), normed.view(input.sizes())};
}

// The fused projection's output [tokens, (heads + 2 kv_heads) * head_dim] as query [tokens,
// heads, head_dim], key and value [tokens, kv_heads, head_dim], with rotary embedding applied to
// query and key (``cos`` and ``sin`` [tokens, head_dim], transformers' layout: the two halves of
// a head rotate as pairs (i, i + head_dim / 2)).
std::tuple<at::Tensor, at::Tensor, at::Tensor> rotary_split(const at::Tensor& qkv, const at::Tensor& cos,
                                                            const at::Tensor& sin, int64_t heads,
                                                            int64_t kv_heads) {
  check_float_rows(qkv, "rotary_split: qkv");
  check_float_rows(cos, "rotary_split: cos");
  check_float_rows(sin, "rotary_split: sin");
  TORCH_CHECK(qkv.dim() == 2, "rotary_split: qkv must be [tokens, width]");
  const int64_t tokens = qkv.size(0), head_dim = cos.size(-1), half = head_dim / 2;
  TORCH_CHECK(head_dim % 2 == 0 && qkv.size(1) == (heads + 2 * kv_heads) * head_dim,
              "rotary_split: qkv width does not match the heads");
  const at::Tensor c = cos.reshape({-1, head_dim}).contiguous(), s = sin.reshape({-1, head_dim}).contiguous();
  TORCH_CHECK(c.size(0) == tokens && s.size(0) == tokens, "rotary_split: cos and sin need one row per token");
  const at::Tensor x = qkv.contiguous();
  at::Tensor query = at::empty({tokens, heads, head_dim}, x.options());
  at::Tensor key = at::empty({tokens, kv_heads, head_dim}, x.options());
  at::Tensor value = at::empty({tokens, kv_heads, head_dim}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  float* qp = query.data_ptr<float>();
  float* kp = key.data_ptr<float>();
  float* vp = value.data_ptr<float>();
  const int64_t width = x.size(1);
  at::parallel_for(0, tokens, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* row = xp + t * width;
      const float* ct = cp + t * head_dim;
      const float* st = sp + t * head_dim;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        const float* in = row + h * head_dim;
        float* out = h < heads ? qp + (t * heads + h) * head_dim : kp + (t * kv_heads + h - heads) * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          out[i] = in[i] * ct[i] - in[i + half] * st[i];
          out[i + half] = in[i + half] * ct[i + half] + in[i] * st[i + half];
        }
      }
      std::memcpy(vp + t * kv_heads * head_dim, row + (heads + kv_heads) * head_dim,
                  sizeof(float) * kv_heads * head_dim);
    }
  });
  return {query, key, value};
}

// [tokens, 2 * width] (gate, then up) -> [tokens, width]: silu(gate) * up.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_float_rows(gate_up, "silu_mul: gate_up");
  const int64_t width = gate_up.size(-1) / 2;
  TORCH_CHECK(gate_up.size(-1) == 2 * width, "silu_mul: the last dimension must be even");
  const at::Tensor x = gate_up.reshape({-1, 2 * width}).contiguous();
  at::Tensor out = at::empty({x.size(0), width}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* gate = xp + row * 2 * width;
      const float* up = gate + width;
      float* o = op + row * width;
      int64_t i = 0;
#ifdef NASD_AVX2
      const __m256 one = _mm256_set1_ps(1.0f);
      for (; i + 8 <= width; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 e = nasd_simd::exp(_mm256_sub_ps(_mm256_setzero_ps(), g));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
      }
#endif
      for (; i < width; ++i) o[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
    }
  });
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end() - 1);
  shape.push_back(width);
  return out.view(shape);
}

// Every decoder layer of a step whose rows all go to the paged attention kernel (decode and
// verification steps), the same calls in the same order as lean_decoder.lean_layer makes from
// Python, without Python between them. Per layer: norms [input, post-attention], blocks and
// kinds [qkv, o, gate_up, down]; pools [kv_heads, slots, head_dim], float32 or float16. Returns
// (the last layer's output, the residual stream before it).
std::tuple<at::Tensor, at::Tensor> decoder_layers(
    const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin, at::TensorList norms,
    at::TensorList blocks, at::IntArrayRef kinds, double eps, int64_t heads, int64_t kv_heads,
    at::TensorList key_pools, at::TensorList value_pools, const at::Tensor& write_slots,
    const at::Tensor& block_table, const at::Tensor& rows, double scale, int64_t block_size,
    int64_t keys_per_unit, bool q8_activations) {
  const int64_t layers = static_cast<int64_t>(key_pools.size());
  TORCH_CHECK(value_pools.size() == key_pools.size() && norms.size() == 2 * key_pools.size() &&
                  blocks.size() == 4 * key_pools.size() && kinds.size() == 4 * key_pools.size(),
              "decoder_layers: per layer, 2 norms, 4 blocks and kinds, a key and a value pool");
  const int64_t tokens = hidden.size(0);
  // q8_activations: every matmul quantizes its input rows to int8 (quant_linear_q8).
  const auto linear = q8_activations ? quant_linear_q8 : quant_linear;
  at::Tensor out = hidden;
  c10::optional<at::Tensor> residual;
  for (int64_t layer = 0; layer < layers; ++layer) {
    auto [summed, normed] = rms_norm(out, residual, norms[2 * layer], eps);
    auto [query, key, value] =
        rotary_split(linear(normed, blocks[4 * layer], kinds[4 * layer]), cos, sin, heads, kv_heads);
    // A float16 pool stores the keys and values rounded to nearest, as PagedKVCache.write does.
    key_pools[layer].index_copy_(1, write_slots, key.transpose(0, 1).to(key_pools[layer].scalar_type()));
    value_pools[layer].index_copy_(1, write_slots, value.transpose(0, 1).to(value_pools[layer].scalar_type()));
    const at::Tensor attended = paged_attention(query, key_pools[layer], value_pools[layer], block_table, rows,
                                                scale, block_size, keys_per_unit);
    out = linear(attended.reshape({tokens, -1}), blocks[4 * layer + 1], kinds[4 * layer + 1]);
    std::tie(summed, normed) = rms_norm(out, summed, norms[2 * layer + 1], eps);
    const at::Tensor gate_up = linear(normed, blocks[4 * layer + 2], kinds[4 * layer + 2]);
    out = linear(silu_mul(gate_up), blocks[4 * layer + 3], kinds[4 * layer + 3]);
    residual = summed;
  }
  TORCH_CHECK(residual.has_value(), "decoder_layers: no layers");
  return {out, *residual};
}

}  // namespace nasd

TORCH_LIBRARY_FRAGMENT(nasd, m) {
  m.def("rms_norm(Tensor input, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary_split(Tensor qkv, Tensor cos, Tensor sin, int heads, int kv_heads) -> (Tensor, Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def(
      "decoder_layers(Tensor hidden, Tensor cos, Tensor sin, Tensor[] norms, Tensor[] blocks, int[] kinds, "
      "float eps, int heads, int kv_heads, Tensor(a!)[] key_pools, Tensor(b!)[] value_pools, "
      "Tensor write_slots, Tensor block_table, Tensor rows, float scale, int block_size, int keys_per_unit, "
      "bool q8_activations=False) "
      "-> (Tensor, Tensor)");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(nasd::rms_norm));
  m.impl("rotary_split", c10::DispatchKey::CPU, TORCH_FN(nasd::rotary_split));
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(nasd::silu_mul));
  m.impl("decoder_layers", c10::DispatchKey::CPU, TORCH_FN(nasd::decoder_layers));
}
