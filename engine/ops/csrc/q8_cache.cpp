// The q8_0 cache's rows in C++ (engine/model/kv_cache.py Q8Storage holds them for Python): the
// whole-layer kernel writes each new key and value as Q8Storage would, bit for bit, and the
// attention reads them back the same way, so a layer run by the kernel and one run module by module
// leave the same cache.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "tandem.h"

namespace tandem {

int64_t q8_block(int64_t D) { return D % 32 == 0 ? 32 : D; }

void check_q8(const at::Tensor& values, const at::Tensor& scales, const char* op) {
  const int64_t D = values.size(-1);
  TORCH_CHECK(values.scalar_type() == at::kChar && scales.scalar_type() == at::kHalf && values.is_contiguous() &&
                  scales.is_contiguous() && scales.dim() == values.dim() &&
                  values.sizes().slice(0, values.dim() - 1) == scales.sizes().slice(0, scales.dim() - 1) &&
                  scales.size(-1) == D / q8_block(D),
              op, ": a q8_0 layer is contiguous int8 values [..., ", D, "] and f16 scales [..., ", D / q8_block(D),
              "], got ", values.sizes(), " ", values.scalar_type(), " and ", scales.sizes(), " ", scales.scalar_type());
}

at::Tensor dequantize_q8(const at::Tensor& values, const at::Tensor& scales) {
  const int64_t D = values.size(-1), per_row = D / q8_block(D);
  return (values.to(at::kFloat).unflatten(-1, {per_row, D / per_row}) * scales.to(at::kFloat).unsqueeze(-1))
      .flatten(-2);
}

void quantize_q8_row(const float* x, int8_t* values, at::Half* scales, int64_t D) {
  const int64_t B = q8_block(D);
  for (int64_t b = 0; b < D; b += B) {
    float largest = 0.f;
    for (int64_t i = b; i < b + B; ++i) largest = std::max(largest, std::fabs(x[i]));
    const at::Half scale(largest / 127.f);
    const float s = static_cast<float>(scale), inverse = s > 0.f ? 1.f / s : 0.f;
    scales[b / B] = scale;
    for (int64_t i = b; i < b + B; ++i)  // nearbyint: half to even, as torch.round
      values[i] = static_cast<int8_t>(std::clamp(std::nearbyint(x[i] * inverse), -127.f, 127.f));
  }
}

// x [..., D] f32 -> (values int8 [..., D], scales f16 [..., D / block]): the kernel's writes, for tests.
std::tuple<at::Tensor, at::Tensor> quantize_q8(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1, "quantize_q8: f32 rows [..., D] expected, got ",
              x.sizes(), " ", x.scalar_type());
  const at::Tensor rows = x.contiguous();
  const int64_t D = x.size(-1), n = D ? x.numel() / D : 0, per_row = D / q8_block(D);
  at::Tensor values = at::empty(x.sizes(), x.options().dtype(at::kChar));
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = per_row;
  at::Tensor scales = at::empty(shape, x.options().dtype(at::kHalf));
  for (int64_t r = 0; r < n; ++r)
    quantize_q8_row(rows.data_ptr<float>() + r * D, values.data_ptr<int8_t>() + r * D,
                    scales.data_ptr<at::Half>() + r * per_row, D);
  return {values, scales};
}

}  // namespace tandem

TORCH_LIBRARY_FRAGMENT(tandem, m) { m.def("quantize_q8(Tensor x) -> (Tensor, Tensor)"); }

TORCH_LIBRARY_IMPL(tandem, CPU, m) { m.impl("quantize_q8", tandem::quantize_q8); }
