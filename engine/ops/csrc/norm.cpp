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

// Runs of G values, each normed alone, the runs of a row of W values (W a multiple of G) scaled by
// their parts of the weight w in turn; a plain norm has W = G.
template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t runs, int64_t G, int64_t W, float eps) {
  at::parallel_for(0, runs, std::max<int64_t>(1, 16384 / G), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * G;
      const T* wr = w + r % (W / G) * G;
      T* o = out + r * G;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < G; ++i) ss += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(G) + eps);
      for (int64_t i = 0; i < G; ++i) {
        const T normed = static_cast<T>(static_cast<float>(xr[i]) * inv);
        o[i] = static_cast<T>(static_cast<float>(wr[i]) * static_cast<float>(normed));
      }
    }
  });
}

}  // namespace

namespace tandem {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, int64_t group) {
  const int64_t W = x.size(-1), G = group > 0 ? group : W;
  TORCH_CHECK(weight.numel() == W && weight.scalar_type() == x.scalar_type() && W % G == 0,
              "rms_norm: weight of ", W, " values in x's dtype and groups dividing them expected, got ",
              weight.numel(), " values and groups of ", G);
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor out = at::empty_like(xc);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows(xc.data_ptr<scalar_t>(), wc.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), xc.numel() / G, G, W,
                  static_cast<float>(eps));
  });
  return out;
}

}  // namespace tandem

TORCH_LIBRARY_FRAGMENT(tandem, m) { m.def("rms_norm(Tensor x, Tensor weight, float eps, int group=0) -> Tensor"); }

TORCH_LIBRARY_IMPL(tandem, CPU, m) { m.impl("rms_norm", tandem::rms_norm); }
