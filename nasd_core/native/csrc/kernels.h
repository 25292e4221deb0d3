// The CPU kernels that call one another (decoder_ops.cpp's layer loop calls the others directly,
// not through the dispatcher). Each is also registered as a torch.ops.nasd operator.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace nasd {

// paged_attention.cpp
at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                           const at::Tensor& block_table, const at::Tensor& rows, double scale,
                           int64_t block_size, int64_t keys_per_unit);
// Sets the lanes of its loops (8, or 16 where built with AVX-512; <= 0 leaves them); returns them.
int64_t paged_attention_lanes(int64_t wanted);

// quant_linear.cpp
at::Tensor quant_linear(const at::Tensor& input, const at::Tensor& weight, int64_t kind);
// quant_linear_q8.cpp
// quant_linear's product with each row's activations quantized to int8 per block of 32 (integer dot products).
at::Tensor quant_linear_q8(const at::Tensor& input, const at::Tensor& weight, int64_t kind);

// decoder_ops.cpp
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& input, const c10::optional<at::Tensor>& residual,
                                            const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor, at::Tensor> rotary_split(const at::Tensor& qkv, const at::Tensor& cos,
                                                            const at::Tensor& sin, int64_t heads,
                                                            int64_t kv_heads);
at::Tensor silu_mul(const at::Tensor& gate_up);

}  // namespace nasd
