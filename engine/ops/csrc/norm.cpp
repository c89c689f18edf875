// tandem::rms_norm: weight * round(x / rms(x)) per row, in one pass instead of torch's chain of
// small ops (pow, mean, rsqrt, mul, casts), each a dispatch of its own at decode.
//
// The order of operations is the reference's (transformers'): normalised in f32, rounded to x's
// dtype, then multiplied by the weight in x's dtype.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "tandem.h"

#include <cmath>

namespace {

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t H, float eps) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / H), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * H;
      T* o = out + r * H;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < H; ++i) ss += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
      for (int64_t i = 0; i < H; ++i) {
        const T normed = static_cast<T>(static_cast<float>(xr[i]) * inv);
        o[i] = static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(normed));
      }
    }
  });
}

}  // namespace

namespace tandem {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t H = x.size(-1);
  TORCH_CHECK(weight.numel() == H && weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight of ", H, " values in x's dtype expected");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor out = at::empty_like(xc);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows(xc.data_ptr<scalar_t>(), wc.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), xc.numel() / H, H,
                  static_cast<float>(eps));
  });
  return out;
}

}  // namespace tandem

TORCH_LIBRARY_FRAGMENT(tandem, m) { m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor"); }

TORCH_LIBRARY_IMPL(tandem, CPU, m) { m.impl("rms_norm", tandem::rms_norm); }
