// tandem::rope_: rotary position embedding applied in place to q and k heads, one pass instead of
// torch's cat, neg, two multiplies and an add per layer.
//
// x [N, H, D] (any row and head strides, unit stride along D); cos, sin [N, R], both halves of R
// holding the same angles, R = D or, for partial RoPE, fewer: then only each head's first R dims
// turn. The halves of those dims rotate: (a, b) -> (a cos - b sin, b cos + a sin).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "tandem.h"

namespace {

template <typename T>
void rope_rows(T* x, const T* cos, const T* sin, int64_t N, int64_t H, int64_t R, int64_t row_stride,
               int64_t head_stride) {
  const int64_t half = R / 2;
  for (int64_t n = 0; n < N; ++n) {
    const T* c = cos + n * R;
    const T* s = sin + n * R;
    for (int64_t h = 0; h < H; ++h) {
      T* p = x + n * row_stride + h * head_stride;
      for (int64_t i = 0; i < half; ++i) {
        const float a = static_cast<float>(p[i]), b = static_cast<float>(p[i + half]);
        p[i] = static_cast<T>(a * static_cast<float>(c[i]) - b * static_cast<float>(s[i]));
        p[i + half] = static_cast<T>(b * static_cast<float>(c[i + half]) + a * static_cast<float>(s[i + half]));
      }
    }
  }
}

}  // namespace

namespace tandem {

void rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rope_: x [N, H, D] with unit stride along D expected");
  const int64_t N = x.size(0), H = x.size(1), D = x.size(2), R = cos.size(-1);
  TORCH_CHECK(R % 2 == 0 && R <= D, "rope_: rotary dims must be even and at most head_dim ", D, ", got ", R);
  const at::Tensor c = cos.to(x.scalar_type()).reshape({N, R}).contiguous();
  const at::Tensor s = sin.to(x.scalar_type()).reshape({N, R}).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rope_", [&] {
    rope_rows(x.data_ptr<scalar_t>(), c.data_ptr<scalar_t>(), s.data_ptr<scalar_t>(), N, H, R, x.stride(0),
              x.stride(1));
  });
}

}  // namespace tandem

TORCH_LIBRARY_FRAGMENT(tandem, m) { m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()"); }

TORCH_LIBRARY_IMPL(tandem, CPU, m) { m.impl("rope_", tandem::rope_); }
