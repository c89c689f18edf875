// A cache layer's K or V storage as the decoder-stack kernels (layers.cpp, qwen4_exp_layers.cpp)
// write and read it, through tandem::Layout.
#pragma once

#include <ATen/ATen.h>

#include <cstring>

#include "tandem.h"

namespace tandem {

// A layer's K or V cache [S, KVH, C, D] (a pool's [1, KVH, P, D]): floats, or q8_0 values with their
// scales (tandem::check_q8).
struct Store {
  at::Tensor data;
  c10::optional<at::Tensor> scales;

  // pick(data) as f32, pick applied alike to a q8_0 layer's values and scales.
  template <typename F>
  at::Tensor floats(F&& pick) const {
    return scales.has_value() ? tandem::dequantize_q8(pick(data), pick(*scales)) : pick(data).to(at::kFloat);
  }
};

// Where slot s's position l of kv head g lies in t (a cache layer's data or scales), in elements.
inline int64_t offset(const at::Tensor& t, const Layout& at, int64_t s, int64_t g, int64_t l) {
  return at.head_offset(t, s, g) + at.row(s, l) * t.stride(2);
}

// Row n's key or value heads (x: [N, KVH, D], a view of the qkv rows) into the cache at slot
// slots[n], position positions[n]; into a q8_0 layer quantized as Q8Storage writes them.
inline void write_cache(const at::Tensor& x, const Store& cache, const int64_t* slots, const int64_t* positions,
                        const Layout& at) {
  const int64_t N = x.size(0), KVH = x.size(1), D = x.size(2);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t g = 0; g < KVH; ++g) {
      const int64_t from = n * x.stride(0) + g * x.stride(1), to = offset(cache.data, at, slots[n], g, positions[n]);
      if (cache.scales.has_value()) {
        const at::Tensor& scales = *cache.scales;
        tandem::quantize_q8_row(x.data_ptr<float>() + from, cache.data.data_ptr<int8_t>() + to,
                                scales.data_ptr<at::Half>() + offset(scales, at, slots[n], g, positions[n]), D);
      } else {
        const int64_t e = x.element_size();
        std::memcpy(static_cast<char*>(cache.data.data_ptr()) + to * e,
                    static_cast<const char*>(x.data_ptr()) + from * e, D * e);
      }
    }
}

}  // namespace tandem
