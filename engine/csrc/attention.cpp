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

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

template <typename T>
void attend(const T* q, const T* k, const T* v, T* out, int64_t H, int64_t KVH, int64_t L, int64_t D,
            int64_t q_stride, int64_t kv_head_stride, int64_t kv_pos_stride, float scale) {
  const int64_t group = H / KVH;
  at::parallel_for(0, KVH, std::max<int64_t>(1, 65536 / (L * D * group)), [&](int64_t begin, int64_t end) {
    // Per kv head: its `group` query heads, their scores [group, L] and outputs [group, D].
    std::vector<float> qf(group * D), acc(group * D), scores(group * L);
    for (int64_t g = begin; g < end; ++g) {
      const T* kh = k + g * kv_head_stride;
      const T* vh = v + g * kv_head_stride;
      for (int64_t j = 0; j < group; ++j)
        for (int64_t i = 0; i < D; ++i) qf[j * D + i] = static_cast<float>(q[(g * group + j) * q_stride + i]) * scale;
      for (int64_t l = 0; l < L; ++l) {  // each key is read once for the whole group
        const T* kl = kh + l * kv_pos_stride;
        for (int64_t j = 0; j < group; ++j) {
          const float* qj = qf.data() + j * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t i = 0; i < D; ++i) dot += qj[i] * static_cast<float>(kl[i]);
          scores[j * L + l] = dot;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < group; ++j) {
        float* sj = scores.data() + j * L;
        const float top = *std::max_element(sj, sj + L);
        float total = 0.f;
        for (int64_t l = 0; l < L; ++l) total += sj[l] = std::exp(sj[l] - top);
        for (int64_t l = 0; l < L; ++l) sj[l] /= total;
      }
      for (int64_t l = 0; l < L; ++l) {  // and each value once
        const T* vl = vh + l * kv_pos_stride;
        for (int64_t j = 0; j < group; ++j) {
          float* aj = acc.data() + j * D;
          const float p = scores[j * L + l];
#pragma omp simd
          for (int64_t i = 0; i < D; ++i) aj[i] += p * static_cast<float>(vl[i]);
        }
      }
      for (int64_t j = 0; j < group; ++j)
        for (int64_t i = 0; i < D; ++i) out[(g * group + j) * D + i] = static_cast<T>(acc[j * D + i]);
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
