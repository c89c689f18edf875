// tandem::decode_attention: the single query token of each decode row, all heads, against its
// slot's cached keys and values, every row of the step in one call.
//
// At decode a row has one query, so attention is a few small dot products per head; torch's
// scaled_dot_product_attention spends most of its time setting up for a tiled prefill, once per
// row. Grouped heads read their kv head directly (head h uses kv head h / group), no repeated K/V.
//
// q [R, H, D]; k, v: the layer's cache [S, KVH, C, D], or a unified pool [1, KVH, P, D] read
// through a page table (tandem::Layout); row r reads slot slots[r], positions 0 .. lengths[r]-2
// and then its own, last[r] (lengths[r]-1 unless given). A tree's verify row
// stands at a scratch position past its siblings' yet attends as the chain node it would be:
// its ancestors' prefix, then itself. Scores and the softmax in f32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "tandem.h"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

// The cache is cold at decode (the step has just streamed every weight through it): fetching the
// rows PREFETCH_ROWS keys ahead took a cold 160-key, 3-kv-head call from 169 to 141 us (warm: 22).
constexpr int64_t PREFETCH_ROWS = 16;

template <typename T>
inline void prefetch_row(const T* p, int64_t D) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(c + b);
}

using tandem::Layout;

template <typename T>
void attend(const T* q, const T* k, const T* v, T* out, const int64_t* slots, const int64_t* lengths,
            const int64_t* last, int64_t R, int64_t H, int64_t KVH, int64_t D, const Layout& at,
            int64_t kv_head_stride, float scale) {
  const int64_t group = H / KVH, max_len = *std::max_element(lengths, lengths + R);
  // One work item per (row, kv head): its `group` query heads, scores [group, L], outputs [group, D].
  const int64_t grain = std::max<int64_t>(1, 65536 / (max_len * D * group));
  at::parallel_for(0, R * KVH, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * D), acc(group * D), scores(group * max_len);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / KVH, g = item % KVH, L = lengths[r], s = slots[r];
      const T* kh = k + at.slot_offset(s) + g * kv_head_stride;
      const T* vh = v + at.slot_offset(s) + g * kv_head_stride;
      const T* qg = q + (r * H + g * group) * D;
      const int64_t own = last[r];
      const auto row = [&](int64_t l) { return at.row(s, l == L - 1 ? own : l) * D; };
      for (int64_t i = 0; i < group * D; ++i) qf[i] = static_cast<float>(qg[i]) * scale;
      for (int64_t l = 0; l < L; ++l) {  // each key is read once for the whole group
        const T* kl = kh + row(l);
        if (l + PREFETCH_ROWS < L) prefetch_row(kh + row(l + PREFETCH_ROWS), D);
        for (int64_t j = 0; j < group; ++j) {
          const float* qj = qf.data() + j * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t i = 0; i < D; ++i) dot += qj[i] * static_cast<float>(kl[i]);
          scores[j * L + l] = dot;
        }
      }
      for (int64_t j = 0; j < group; ++j) {
        float* sj = scores.data() + j * L;
        const float top = *std::max_element(sj, sj + L);
        float total = 0.f;
        for (int64_t l = 0; l < L; ++l) total += sj[l] = std::exp(sj[l] - top);
        for (int64_t l = 0; l < L; ++l) sj[l] /= total;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t l = 0; l < L; ++l) {  // and each value once
        const T* vl = vh + row(l);
        if (l + PREFETCH_ROWS < L) prefetch_row(vh + row(l + PREFETCH_ROWS), D);
        for (int64_t j = 0; j < group; ++j) {
          float* aj = acc.data() + j * D;
          const float p = scores[j * L + l];
#pragma omp simd
          for (int64_t i = 0; i < D; ++i) aj[i] += p * static_cast<float>(vl[i]);
        }
      }
      T* o = out + (r * H + g * group) * D;
      for (int64_t i = 0; i < group * D; ++i) o[i] = static_cast<T>(acc[i]);
    }
  });
}

#ifdef __AVX512F__

// Lane i of the result: the sum of v[i]'s 16 lanes. Sixteen dot products finish in 45 operations,
// where reducing each on its own took about 8 apiece and left 16 scalars to gather.
inline __m512 sums16(const __m512 (&v)[16]) {
  __m512 t[8], u[4], w[2];
  for (int k = 0; k < 8; ++k)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    t[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k)  // per 128-bit lane: the lane's sums of v[4k .. 4k+3]
    u[k] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * k], t[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * k], t[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int k = 0; k < 2; ++k)
    w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// e^x for x <= 0 (a score minus the row's largest), 16 at a time: x = n ln 2 + r with |r| <= ln 2 / 2,
// e^r by its degree-6 Taylor polynomial (relative error below 2e-7, about an f32 ulp), scaled by 2^n.
// std::exp one score at a time took a third of a long row's attention.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));  // below, e^x is 0 in f32 anyway
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);  // ln 2 in two parts: r stays exact
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// s[0 .. L-1] -> softmax(s), in place.
inline void softmax(float* s, int64_t L) {
  __m512 top = _mm512_set1_ps(-INFINITY);
  int64_t l = 0;
  for (; l + 16 <= L; l += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + l));
  const __mmask16 tail = static_cast<__mmask16>((1u << (L - l)) - 1);
  top = _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_mask_loadu_ps(top, tail, s + l)));
  __m512 total = _mm512_setzero_ps();
  for (l = 0; l + 16 <= L; l += 16) {
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + l), top));
    _mm512_storeu_ps(s + l, e);
    total = _mm512_add_ps(total, e);
  }
  const __m512 e = _mm512_maskz_mov_ps(tail, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + l), top)));
  _mm512_mask_storeu_ps(s + l, tail, e);
  const __m512 inverse = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_add_ps(total, e)));
  for (l = 0; l + 16 <= L; l += 16) _mm512_storeu_ps(s + l, _mm512_mul_ps(_mm512_loadu_ps(s + l), inverse));
  _mm512_mask_storeu_ps(s + l, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, s + l), inverse));
}

// q . key as 16 partial sums, their total the score: q is NC vectors of 16, key a row of 16 * NC.
template <int NC>
inline __m512 partial_dot(const __m512 (&q)[NC], const float* key) {
  __m512 d = _mm512_mul_ps(q[0], _mm512_loadu_ps(key));
  for (int c = 1; c < NC; ++c) d = _mm512_fmadd_ps(q[c], _mm512_loadu_ps(key + 16 * c), d);
  return d;
}

// One query head (q: NC vectors of 16, already scaled) against slot s's keys 0 .. L-2 and the key
// at `own` (the row's own position, L-1 but for a tree node) -> scores[0 .. L-1]. Keys go 16 at a
// time, each 16 one run of rows in either layout.
template <int NC>
inline void head_scores(const __m512 (&q)[NC], const float* k, const Layout& at, int64_t s, int64_t L, int64_t own,
                        float* scores) {
  constexpr int64_t D = 16 * NC;
  static_assert(PREFETCH_ROWS == 16, "the next run of 16 keys is prefetched");
  int64_t l = 0;
  for (; l + 16 <= L; l += 16) {
    const float* run = k + at.row(s, l) * D;
    const float* next = l + 16 < L ? k + at.row(s, l + 16) * D : nullptr;
    __m512 dots[16];
    for (int j = 0; j < 16; ++j) {
      if (next) prefetch_row(next + j * D, D);
      dots[j] = partial_dot(q, l + j == L - 1 ? k + at.row(s, own) * D : run + j * D);
    }
    _mm512_storeu_ps(scores + l, sums16(dots));
  }
  for (; l < L; ++l) scores[l] = _mm512_reduce_add_ps(partial_dot(q, k + at.row(s, l == L - 1 ? own : l) * D));
}

// attend() for f32 caches and head_dim = 16 * NC, a query head at a time: its query and its output
// stay in registers, and its keys and values come from cache (a kv head's L rows were just read by
// the group's previous head). A work item is one (row, query head), not a (row, kv head): a decode
// row of 3 kv heads gave two threads 3 items, one thread idle a third of the time. A row's result
// depends only on its own query and length, as in attend(), so a verify row equals the decode row
// it stands for.
template <int NC>
void attend_f32(const float* q, const float* k, const float* v, float* out, const int64_t* slots,
                const int64_t* lengths, const int64_t* last, int64_t R, int64_t H, int64_t KVH, const Layout& at,
                int64_t kv_head_stride, float scale) {
  constexpr int64_t D = 16 * NC;
  const int64_t group = H / KVH, max_len = *std::max_element(lengths, lengths + R);
  const int64_t grain = std::max<int64_t>(1, 65536 / (max_len * D));
  at::parallel_for(0, R * H, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(max_len);
    for (int64_t h = begin; h < end; ++h) {  // h: row r's query head h % H, of kv head (h % H) / group
      const int64_t r = h / H, g = h % H / group, L = lengths[r], own = last[r], s = slots[r];
      const float* kh = k + at.slot_offset(s) + g * kv_head_stride;
      const float* vh = v + at.slot_offset(s) + g * kv_head_stride;
      __m512 qv[NC], acc[NC];
      for (int c = 0; c < NC; ++c) {
        qv[c] = _mm512_mul_ps(_mm512_loadu_ps(q + h * D + 16 * c), _mm512_set1_ps(scale));
        acc[c] = _mm512_setzero_ps();
      }
      float* sh = scores.data();
      head_scores<NC>(qv, kh, at, s, L, own, sh);
      softmax(sh, L);
      for (int64_t l = 0; l < L; l += 16) {  // values a run of 16 at a time, as the keys
        const float* run = vh + at.row(s, l) * D;
        const float* next = l + 16 < L ? vh + at.row(s, l + 16) * D : nullptr;
        for (int64_t j = 0; j < 16 && l + j < L; ++j) {
          const float* vl = l + j == L - 1 ? vh + at.row(s, own) * D : run + j * D;
          if (next) prefetch_row(next + j * D, D);
          const __m512 pl = _mm512_set1_ps(sh[l + j]);
          for (int c = 0; c < NC; ++c) acc[c] = _mm512_fmadd_ps(pl, _mm512_loadu_ps(vl + 16 * c), acc[c]);
        }
      }
      for (int c = 0; c < NC; ++c) _mm512_storeu_ps(out + h * D + 16 * c, acc[c]);
    }
  });
}

// The head dims the f32 path is compiled for; others take attend().
template <typename F>
bool with_chunks(int64_t D, F&& f) {
  switch (D) {
    case 16: f(std::integral_constant<int, 1>{}); return true;
    case 32: f(std::integral_constant<int, 2>{}); return true;
    case 64: f(std::integral_constant<int, 4>{}); return true;
    case 80: f(std::integral_constant<int, 5>{}); return true;
    case 96: f(std::integral_constant<int, 6>{}); return true;
    case 128: f(std::integral_constant<int, 8>{}); return true;
    case 160: f(std::integral_constant<int, 10>{}); return true;
    case 256: f(std::integral_constant<int, 16>{}); return true;
  }
  return false;
}

#endif

}  // namespace

namespace tandem {

Layout Layout::of(const at::Tensor& k, const c10::optional<at::Tensor>& pages) {
  Layout at;
  at.slot_stride = k.stride(0);
  if (pages.has_value()) {
    at.pages = pages->data_ptr<int64_t>();
    at.pages_per_slot = pages->size(1);
    const int64_t page = k.size(2) / pages->size(1);
    while ((int64_t{1} << at.shift) < page) ++at.shift;
  }
  return at;
}

int64_t check_pages(const at::Tensor& k, const c10::optional<at::Tensor>& pages, const char* op) {
  if (!pages.has_value()) return k.size(0);
  const at::Tensor& t = *pages;
  TORCH_CHECK(k.size(0) == 1, op, ": a paged cache is one pool [1, KVH, P, D], got ", k.sizes());
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kLong && t.is_contiguous() && t.size(1) > 0 &&
                  k.size(2) % t.size(1) == 0,
              op, ": a page table is contiguous int64 [slots, pages] with pages dividing the pool's ", k.size(2),
              " positions, got ", t.sizes(), " ", t.scalar_type());
  const int64_t page = k.size(2) / t.size(1);
  TORCH_CHECK(page >= 16 && (page & (page - 1)) == 0, op, ": a page of ", page,
              " positions: pages hold a power of two of at least 16");
  return t.size(0);
}

void check_rows(const c10::optional<at::Tensor>& pages, int64_t s, int64_t length, int64_t pool, const char* op) {
  if (!pages.has_value() || length <= 0) return;
  const int64_t per = pages->size(1), page = pool / per;
  const int64_t* row = pages->data_ptr<int64_t>() + s * per;
  for (int64_t i = 0; i <= (length - 1) / page; ++i)
    TORCH_CHECK(row[i] >= 0 && row[i] < per, op, ": slot ", s, "'s page ", i, " is ", row[i], ", outside a pool of ",
                per, " pages");
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
                            const at::Tensor& lengths, double scale, const c10::optional<at::Tensor>& last,
                            const c10::optional<at::Tensor>& pages) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.sizes() == k.sizes() && q.size(2) == k.size(3),
              "decode_attention: q [R, H, D], k and v [S, KVH, C, D] expected, got ", q.sizes(), ", ", k.sizes(),
              ", ", v.sizes());
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "decode_attention: k and v must be whole, contiguous caches");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "decode_attention: q, k and v in one dtype");
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1), C = k.size(2);
  const int64_t S = check_pages(k, pages, "decode_attention");
  TORCH_CHECK(H % KVH == 0, "decode_attention: kv heads (", KVH, ") must divide heads (", H, ")");
  TORCH_CHECK(slots.numel() == R && lengths.numel() == R, "decode_attention: one slot and one length per row");
  const at::Tensor s = slots.to(at::kLong).contiguous(), n = lengths.to(at::kLong).contiguous();
  const at::Tensor own = last.has_value() ? last->to(at::kLong).contiguous() : n - 1;
  TORCH_CHECK(own.numel() == R, "decode_attention: one last position per row");
  const int64_t* sp = s.data_ptr<int64_t>();
  const int64_t* np = n.data_ptr<int64_t>();
  const int64_t* op = own.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(sp[r] >= 0 && sp[r] < S && np[r] >= 1 && np[r] <= C && op[r] >= np[r] - 1 && op[r] < C,
                "decode_attention: row ", r, " reads slot ", sp[r], " length ", np[r], " last position ", op[r],
                " outside a cache of ", S, " slots x ", C, " (or its last position before its length)");
  for (int64_t r = 0; r < R; ++r) check_rows(pages, sp[r], op[r] + 1, C, "decode_attention");
  const Layout at = Layout::of(k, pages);
  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty_like(qc);
  if (R == 0) return out;
#ifdef __AVX512F__
  if (q.scalar_type() == at::kFloat &&
      with_chunks(D, [&](auto nc) {
        attend_f32<decltype(nc)::value>(qc.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
                                        out.data_ptr<float>(), sp, np, op, R, H, KVH, at, k.stride(1),
                                        static_cast<float>(scale));
      }))
    return out;
#endif
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "decode_attention", [&] {
    attend(qc.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), sp, np,
           op, R, H, KVH, D, at, k.stride(1), static_cast<float>(scale));
  });
  return out;
}

}  // namespace tandem

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor lengths, float scale, Tensor? last=None, "
        "Tensor? pages=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) { m.impl("decode_attention", tandem::decode_attention); }
