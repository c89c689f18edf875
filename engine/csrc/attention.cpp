// tandem::decode_attention: one query token of every head against a slot's cached keys and values.
//
// At decode a row has a single query, so attention is a few small dot products per head; torch's
// scaled_dot_product_attention spends most of its time setting up for a tiled prefill. Grouped
// heads read their kv head directly (head h uses kv head h / group), with no repeated K/V.
//
// q [H, D]; k, v [KVH, L, D] (unit stride along D: views of the cache); scores and the softmax in f32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

namespace {

template <typename T>
void attend(const T* q, const T* k, const T* v, T* out, int64_t H, int64_t KVH, int64_t L, int64_t D,
            int64_t q_stride, int64_t kv_head_stride, int64_t kv_pos_stride, float scale) {
  const int64_t group = H / KVH;
  at::parallel_for(0, H, std::max<int64_t>(1, 65536 / (L * D)), [&](int64_t begin, int64_t end) {
    std::vector<float> qf(D), acc(D), scores(L);
    for (int64_t h = begin; h < end; ++h) {
      const T* kh = k + (h / group) * kv_head_stride;
      const T* vh = v + (h / group) * kv_head_stride;
      for (int64_t i = 0; i < D; ++i) qf[i] = static_cast<float>(q[h * q_stride + i]) * scale;
      float top = -INFINITY;
      for (int64_t l = 0; l < L; ++l) {
        const T* kl = kh + l * kv_pos_stride;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < D; ++i) dot += qf[i] * static_cast<float>(kl[i]);
        scores[l] = dot;
        top = std::max(top, dot);
      }
      float total = 0.f;
      for (int64_t l = 0; l < L; ++l) total += scores[l] = std::exp(scores[l] - top);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t l = 0; l < L; ++l) {
        const T* vl = vh + l * kv_pos_stride;
        const float p = scores[l];
#pragma omp simd
        for (int64_t i = 0; i < D; ++i) acc[i] += p * static_cast<float>(vl[i]);
      }
      for (int64_t i = 0; i < D; ++i) out[h * D + i] = static_cast<T>(acc[i] / total);
    }
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  TORCH_CHECK(q.dim() == 2 && k.dim() == 3 && v.sizes() == k.sizes() && q.size(1) == k.size(2),
              "decode_attention: q [H, D], k and v [KVH, L, D] expected, got ", q.sizes(), ", ", k.sizes(), ", ",
              v.sizes());
  TORCH_CHECK(k.strides() == v.strides() && q.stride(1) == 1 && k.stride(2) == 1,
              "decode_attention: unit stride along D, and k and v laid out alike");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "decode_attention: q, k and v in one dtype");
  const int64_t H = q.size(0), D = q.size(1), KVH = k.size(0), L = k.size(1);
  TORCH_CHECK(H % KVH == 0 && L > 0, "decode_attention: kv heads must divide heads; at least one key");
  at::Tensor out = at::empty({H, D}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "decode_attention", [&] {
    attend(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), H, KVH,
           L, D, q.stride(0), k.stride(0), k.stride(1), static_cast<float>(scale));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) { m.impl("decode_attention", decode_attention); }
