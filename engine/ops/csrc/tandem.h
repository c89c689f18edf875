// The kernels of engine/csrc as C++ functions, so that one kernel can call another without a trip
// through Python (layers.cpp runs whole decoder layers this way). Each is also registered as a torch
// op, torch.ops.tandem.<name>, in its own file.
#pragma once

#include <ATen/ATen.h>

namespace tandem {

// x [M, K] @ weight [N, K]^T * scale [N] + bias [N] -> [M, N] in x's dtype; weight f32, bf16, int8, or
// uint8 [N, K / 32 * B]: rows of GGUF blocks of B bytes (18 Q4_0, 20 Q4_1, 34 Q8_0).
at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& scale,
                       const c10::optional<at::Tensor>& bias);

// uint8 blocks [N, K / 32 * B] as linear_rows reads them -> f32 [N, K].
at::Tensor dequantize_blocks(const at::Tensor& weight, int64_t K);

// weight * round(x / rms(x)) over the last axis.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// Rotates x [N, H, D] in place (unit stride along D); cos, sin [N, D].
void rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin);

// q [R, H, D], one query per row, against positions 0 .. lengths[r]-2 and last[r] (default
// lengths[r]-1) of slot slots[r] of a cache layer k, v [S, KVH, C, D] -> [R, H, D].
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
                            const at::Tensor& lengths, double scale, const c10::optional<at::Tensor>& last);

}  // namespace tandem
