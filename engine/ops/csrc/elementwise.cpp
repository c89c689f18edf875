// The elementwise steps tandem's kernels take between their products (tandem.h says which), as
// loops over raw f32 rows that round as torch's CPU kernels do: a sum or a product rounded once;
// silu and the sigmoid as torch's AVX-512 loop computes them, SLEEF's e^x over pairs of 16-lane
// vectors and std::exp over a row's last n % 32. A product and the sum it feeds stay two loops,
// each storing its result: GCC contracts a * b + c written in one expression into a fused
// multiply-add (-ffp-contract=fast), which rounds once where torch rounds twice. Without AVX-512
// the steps are torch's own ops.
#include <ATen/ATen.h>

#include <cmath>

#ifdef __AVX512F__
#include <immintrin.h>
#include <sleef.h>
#endif

#include "tandem.h"

namespace {

#ifdef __AVX512F__
// f over the n floats from in, into out, in torch's order of vector and scalar steps.
template <typename Vector, typename Scalar>
void like_torch(const float* in, float* out, int64_t n, Vector vf, Scalar sf) {
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    _mm512_storeu_ps(out + i, vf(_mm512_loadu_ps(in + i)));
    _mm512_storeu_ps(out + i + 16, vf(_mm512_loadu_ps(in + i + 16)));
  }
  for (; i < n; ++i) out[i] = sf(in[i]);
}

inline __m512 exp_of_minus(__m512 x) { return Sleef_expf16_u10(_mm512_sub_ps(_mm512_setzero_ps(), x)); }
inline __m512 silu_v(__m512 x) { return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), exp_of_minus(x))); }
inline float silu_s(float x) { return x / (1.f + std::exp(-x)); }
inline __m512 sigmoid_v(__m512 x) {
  return _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_add_ps(exp_of_minus(x), _mm512_set1_ps(1.f)));
}
inline float sigmoid_s(float x) { return 1.f / (1.f + std::exp(-x)); }

bool plain_f32(const at::Tensor& x) { return x.scalar_type() == at::kFloat && x.is_contiguous(); }

// f of a contiguous f32 x, its numel values one run (as torch takes a contiguous tensor).
template <typename Vector, typename Scalar>
at::Tensor unary(const at::Tensor& x, Vector vf, Scalar sf) {
  at::Tensor out = at::empty_like(x);
  like_torch(x.data_ptr<float>(), out.data_ptr<float>(), x.numel(), vf, sf);
  return out;
}
#endif

}  // namespace

namespace tandem {

void add_to(at::Tensor& x, const at::Tensor& y) {
  if (x.scalar_type() != at::kFloat || y.scalar_type() != at::kFloat || !x.is_contiguous() || !y.is_contiguous() ||
      x.sizes() != y.sizes()) {
    x.add_(y);
    return;
  }
  float* xp = x.data_ptr<float>();
  const float* yp = y.data_ptr<float>();
  for (int64_t i = 0, n = x.numel(); i < n; ++i) xp[i] += yp[i];
}

at::Tensor silu(const at::Tensor& x) {
#ifdef __AVX512F__
  if (plain_f32(x)) return unary(x, silu_v, silu_s);
#endif
  return at::silu(x);
}

at::Tensor sigmoid(const at::Tensor& x) {
#ifdef __AVX512F__
  if (plain_f32(x)) return unary(x, sigmoid_v, sigmoid_s);
#endif
  return at::sigmoid(x);
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  const int64_t N = gate_up.size(0), I = gate_up.size(1) / 2;
#ifdef __AVX512F__
  if (plain_f32(gate_up)) {
    at::Tensor out = at::empty({N, I}, gate_up.options());
    const float* g = gate_up.data_ptr<float>();
    float* o = out.data_ptr<float>();
    for (int64_t n = 0; n < N; ++n) {
      const float* up = g + n * 2 * I + I;
      float* on = o + n * I;
      like_torch(g + n * 2 * I, on, I, silu_v, silu_s);
      for (int64_t i = 0; i < I; ++i) on[i] *= up[i];
    }
    return out;
  }
#endif
  return at::silu(gate_up.narrow(1, 0, I)) * gate_up.narrow(1, I, I);
}

void scaled_rows_add(at::Tensor& out, const int64_t* rows, at::Tensor& y, const float* weights) {
  const int64_t n = y.size(0), D = y.size(1);
  if (out.scalar_type() != at::kFloat || y.scalar_type() != at::kFloat || !out.is_contiguous() || !y.is_contiguous()) {
    const at::Tensor w = at::from_blob(const_cast<float*>(weights), {n, 1}, at::kFloat).to(y.scalar_type());
    out.index_add_(0, at::from_blob(const_cast<int64_t*>(rows), {n}, at::kLong), y * w);
    return;
  }
  float* yp = y.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t k = 0; k < n; ++k) {
    float* yk = yp + k * D;
    for (int64_t j = 0; j < D; ++j) yk[j] *= weights[k];
  }
  for (int64_t k = 0; k < n; ++k) {
    const float* yk = yp + k * D;
    float* ok = op + rows[k] * D;
    for (int64_t j = 0; j < D; ++j) ok[j] += yk[j];
  }
}

}  // namespace tandem
