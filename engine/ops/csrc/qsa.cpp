// tandem::block_scores: QSA's block scores (engine/model/qsa.py `scores`; docs/architecture.md,
// "The hybrid cache and QSA"): score[t, b] = sum over query heads h of relu(q[t, h] . blocks[kv(h),
// b]) / sqrt(D), in f32.
//
// torch's einsum took 0.4 ms for one decode row's 8 indexer heads against 4,096 blocks of 128 at 16k
// (a batched product that packs the blocks first); here each block's row is read once for all the
// heads, 16 products reduced together (dots.h). Each product's additions are in one fixed order
// whatever else a call computes, so a query's scores are the same numbers in a decode row, a
// verify block and a prompt chunk: the selection that speculation's exactness rests on.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "dots.h"

#if defined(__AVX2__) && !defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t BLOCKS = 32;  // blocks a work item scores: 32 x 128 f32 keys, 16 KB, stay in L1

}  // namespace

namespace tandem {

at::Tensor block_scores(const at::Tensor& q, const at::Tensor& blocks) {
  TORCH_CHECK(q.dim() == 3 && blocks.dim() == 3 && q.size(2) == blocks.size(2) && blocks.size(0) > 0 &&
                  q.size(1) % blocks.size(0) == 0,
              "block_scores: q [T, H, D] and blocks [KVH, n, D] with KVH dividing H expected, got ", q.sizes(),
              " and ", blocks.sizes());
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KVH = blocks.size(0), n = blocks.size(1);
  const int64_t group = H / KVH;
  const at::Tensor qc = q.to(at::kFloat).contiguous(), kb = blocks.to(at::kFloat);
  at::Tensor out = at::empty({T, n}, qc.options());
#ifdef __AVX512F__
  if (T > 0 && n > 0 && kb.stride(2) == 1 && tandem::dots::with_chunks(D, [&](auto nc) {
        constexpr int NC = decltype(nc)::value;
        const float *qp = qc.data_ptr<float>(), *bp = kb.data_ptr<float>();
        const int64_t head_stride = kb.stride(0), row_stride = kb.stride(1);
        const float root = std::sqrt(static_cast<float>(D));
        float* op = out.data_ptr<float>();
        // Where query head h's kv head starts in blocks: no division in the loop below.
        std::vector<int64_t> kv_of(H);
        for (int64_t h = 0; h < H; ++h) kv_of[h] = h / group * head_stride;
        at::parallel_for(0, (n + BLOCKS - 1) / BLOCKS, 1, [&](int64_t begin, int64_t end) {
          // The products of one query with a work item's blocks, pair p = block * H + head, 16 at a time.
          std::vector<float> dots((BLOCKS * H + 15) / 16 * 16);
          for (int64_t item = begin; item < end; ++item) {
            const int64_t b0 = item * BLOCKS, nb = std::min(BLOCKS, n - b0), pairs = nb * H;
            for (int64_t t = 0; t < T; ++t) {
              const float* qt = qp + t * H * D;
              for (int64_t p0 = 0, b = b0, h = 0; p0 < pairs; p0 += 16) {
                __m512 v[16];
                for (int k = 0; k < 16; ++k) {
                  v[k] = p0 + k < pairs ? tandem::dots::partial_dot<NC>(qt + h * D, bp + kv_of[h] + b * row_stride)
                                        : _mm512_setzero_ps();
                  if (++h == H) h = 0, ++b;
                }
                _mm512_storeu_ps(dots.data() + p0, tandem::dots::sums16(v));
              }
              for (int64_t b = 0; b < nb; ++b) {
                float sum = 0.f;
                for (int64_t h = 0; h < H; ++h) sum += std::max(dots[b * H + h], 0.f);
                op[t * n + b0 + b] = sum / root;
              }
            }
          }
        });
      }))
    return out;
#elif defined(__AVX2__) && defined(__FMA__)
  // AVX2: each product in 8 lanes, D / 8 fused multiply-adds reduced in one fixed order. torch's
  // product one query at a time took about 1 ms of a QSA layer's 16k decode row on Zen 3.
  if (T > 0 && n > 0 && kb.stride(2) == 1 && D % 8 == 0) {
    const float *qp = qc.data_ptr<float>(), *bp = kb.data_ptr<float>();
    const int64_t head_stride = kb.stride(0), row_stride = kb.stride(1);
    const float root = std::sqrt(static_cast<float>(D));
    float* op = out.data_ptr<float>();
    at::parallel_for(0, (n + BLOCKS - 1) / BLOCKS, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin * BLOCKS; b < std::min(n, end * BLOCKS); ++b)
        for (int64_t t = 0; t < T; ++t) {
          float sum = 0.f;
          for (int64_t h = 0; h < H; ++h) {
            const float* qh = qp + (t * H + h) * D;
            const float* key = bp + h / group * head_stride + b * row_stride;
            __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(qh), _mm256_loadu_ps(key));
            for (int64_t d = 8; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d), _mm256_loadu_ps(key + d), acc);
            __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
            s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            sum += std::max(_mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s))), 0.f);
          }
          op[t * n + b] = sum / root;
        }
    });
    return out;
  }
#endif
  // Without AVX-512 or AVX2, or at a head dim they lack: torch's product, one query at a time. A
  // batched product's additions follow its shape, so a query beside others (a verify block) could
  // score other bits than alone (its decode row) and select another block at a near-tie.
  const at::Tensor qg = qc.view({T, KVH, group, D});
  for (int64_t t = 0; t < T; ++t) out[t] = at::einsum("kgd,kbd->kgb", {qg[t], kb}).relu().sum({0, 1});
  return out.div_(std::sqrt(static_cast<double>(D)));
}

}  // namespace tandem

TORCH_LIBRARY_FRAGMENT(tandem, m) { m.def("block_scores(Tensor q, Tensor blocks) -> Tensor"); }

TORCH_LIBRARY_IMPL(tandem, CPU, m) { m.impl("block_scores", tandem::block_scores); }
