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
// its ancestors' prefix, then itself. Scores and the softmax in f32. A q8_0 cache (int8 k and v with
// their f16 scales, tandem::check_q8) is read as stored, each block scaled as it is used.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "dots.h"
#include "tandem.h"

#include <algorithm>
#include <cmath>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

// The cache is cold at decode (the step has just streamed every weight through it): fetching the
// rows PREFETCH_ROWS keys ahead took a cold 160-key, 3-kv-head call from 169 to 141 us (warm: 22).
constexpr int64_t PREFETCH_ROWS = 16;

// LOCALITY as __builtin_prefetch's: 3 into L1, 2 into L2 only. attend_at's rows and the AVX-512 decode
// kernel's f32 runs go to L2, as if L1's few outstanding misses held the prefetches back (Zen 4,
// alternating builds, cold caches):
// - attend_at's rows, scattered in 4 KB runs (QSA's selected blocks) that the hardware's stream
//   prefetchers cannot follow: ~2,050 rows of 2 kv heads of 256, median 0.58 ms against 0.72 into L1;
// - decode_attention's f32 runs: one query of 8 heads at 16,385 positions of 2 kv heads of 256,
//   median 3.6 ms against 4.3 (the same at 1,025 positions, warm); its q8_0 runs, whose dequantizing
//   sets the pace, showed no difference and stay in L1.
template <int LOCALITY = 3, typename T>
inline void prefetch_row(const T* p, int64_t D) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(c + b, 0, LOCALITY);
}

using tandem::Layout;

template <typename T>
void attend(const T* q, const T* k, const T* v, T* out, const int64_t* slots, const int64_t* lengths,
            const int64_t* last, int64_t R, int64_t H, int64_t KVH, int64_t D, const Layout& at,
            const at::Tensor& layer, float scale) {
  const int64_t group = H / KVH, max_len = *std::max_element(lengths, lengths + R);
  // One work item per (row, kv head): its `group` query heads, scores [group, L], outputs [group, D].
  const int64_t grain = std::max<int64_t>(1, 65536 / (max_len * D * group));
  at::parallel_for(0, R * KVH, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * D), acc(group * D), scores(group * max_len);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / KVH, g = item % KVH, L = lengths[r], s = slots[r];
      const T* kh = k + at.head_offset(layer, s, g);  // k and v share the layer's strides
      const T* vh = v + at.head_offset(layer, s, g);
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

// Keys a work item reads: positions [SPAN * c, SPAN * (c + 1)) of a row's, span c. A row longer than
// a span is split (as flash-decoding splits it), its spans' partial results merged by their
// largest scores: at 5,200 keys a decode row's 9 heads gave two threads 9 items, one idle a ninth
// of the time, where 11 spans a head give 99. A row's spans depend on its own length only.
constexpr int64_t SPAN = 512;

#ifdef __AVX512F__

using tandem::dots::partial_dot;
using tandem::dots::sums16;
using tandem::dots::with_chunks;

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

// s[0 .. L-1] -> e^(s - top), in place, where top is their largest; returns {top, the sum}.
inline std::pair<float, float> exps(float* s, int64_t L) {
  __m512 top = _mm512_set1_ps(-INFINITY);
  int64_t l = 0;
  for (; l + 16 <= L; l += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + l));
  const __mmask16 tail = static_cast<__mmask16>((1u << (L - l)) - 1);
  const float largest = _mm512_reduce_max_ps(_mm512_mask_loadu_ps(top, tail, s + l));
  top = _mm512_set1_ps(largest);
  __m512 total = _mm512_setzero_ps();
  for (l = 0; l + 16 <= L; l += 16) {
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + l), top));
    _mm512_storeu_ps(s + l, e);
    total = _mm512_add_ps(total, e);
  }
  const __m512 e = _mm512_maskz_mov_ps(tail, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + l), top)));
  _mm512_mask_storeu_ps(s + l, tail, e);
  return {largest, _mm512_reduce_add_ps(_mm512_add_ps(total, e))};
}

// How a work item reads one kv head's keys or values as f32 rows of D, `row` counting rows from the
// head's first (a slot's position, or a pool row). F32Rows hands out the cache's own rows; Q8Rows
// (int8 values and one f16 scale per block of B values, B = 32 or the whole row; engine/model/
// kv_cache.py Q8Storage) dequantizes them into the caller's buffer, once for every query that reads
// them.
template <int NC>
struct F32Rows {
  static constexpr int64_t D = 16 * NC;
  static constexpr bool copies = false;
  const float* p;

  // Rows row .. row+n-1 (n <= 16, one run in either layout).
  const float* run(int64_t row, int64_t, float*) const { return p + row * D; }
  void prefetch_run(int64_t row) const { prefetch_row<2>(p + row * D, 16 * D); }
};

template <int NC>
struct Q8Rows {
  static constexpr int64_t D = 16 * NC;
  static constexpr bool copies = true;
  const int8_t* p;
  const uint16_t* scales;  // [rows, per_row] f16
  int64_t per_row;          // D / B

  const float* run(int64_t row, int64_t n, float* into) const {
    for (int64_t i = 0; i < n; ++i) {
      const int8_t* x = p + (row + i) * D;
      const uint16_t* s = scales + (row + i) * per_row;
      for (int c = 0; c < NC; ++c) {
        const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 16 * c))));
        _mm512_storeu_ps(into + i * D + 16 * c, _mm512_mul_ps(v, _mm512_set1_ps(_cvtsh_ss(s[c * per_row / NC]))));
      }
    }
    return into;
  }
  void prefetch_run(int64_t row) const {
    prefetch_row(p + row * D, 16 * D);
    prefetch_row(scales + row * per_row, 16 * per_row);
  }
};

// Consecutive rows of one slot (a verify block) share a work item, up to this many: each key and
// value comes from memory once for all of them, from the L1 cache for the second and later.
constexpr int64_t BLOCK_ROWS = 8;

// From this head_dim on, an f32 work item takes all the query heads of one kv head, as a q8_0 one
// does: a span's keys and values (512 x 256 x 4 bytes each at head_dim 256) outgrow the L2 cache,
// and each query head of a group read them from memory again. One head an item took a 2,052-key
// row of Qwen4-Exp's (8 heads on 2 kv heads of 256) 400 us, where torch's kernel took 226.
constexpr int64_t WIDE_HEAD = 128;

// A work item's rows: rows first .. first+n-1 of the call, all of one slot.
struct Block {
  int64_t first, n;
};

// attend() for f32 queries and head_dim = 16 * NC, on f32 or q8_0 caches: head(slot, kv head) gives
// that head's keys and values as F32Rows or Q8Rows. A work item is one block of rows, one span of
// keys and one query head, or for q8_0 (its keys are dequantized once for all of them) and for
// wide heads (WIDE_HEAD) all the query heads of one kv head: it scores its queries' keys in that
// span 16 at a time (one run of rows in either layout) and leaves each (row, head)'s partial
// result (the largest score, the sum of exponentials, the values weighted by them) for the merge.
// Before, each row streamed every key from memory on its own, and a verify block of 4 rows at
// 5,200 keys cost 2.1x a decode row. A row's result depends only on its own query, length and
// last position, as in attend(), so a verify row equals the decode row it stands for, whatever
// rows share its block.
template <int NC, typename Head>
void attend_runs(const float* q, Head&& head, float* out, const int64_t* slots, const int64_t* lengths,
                 const int64_t* last, int64_t R, int64_t H, int64_t KVH, const Layout& at, float scale) {
  using Rows = std::decay_t<decltype(head(0, 0).first)>;
  constexpr int64_t D = 16 * NC, PART = D + 2;  // a partial result: D weighted values, largest, sum
  const int64_t group = H / KVH, max_len = *std::max_element(lengths, lengths + R);
  // The query heads an item takes.
  const int64_t heads = Rows::copies || D >= WIDE_HEAD ? group : 1, head_items = H / heads;
  const int64_t spans = (max_len + SPAN - 1) / SPAN;
  std::vector<Block> blocks;
  for (int64_t r = 0; r < R; ++r) {
    if (blocks.empty() || slots[r] != slots[blocks.back().first] || blocks.back().n == BLOCK_ROWS)
      blocks.push_back({r, 0});
    ++blocks.back().n;
  }
  std::vector<float> parts(R * H * spans * PART);  // [R, H, spans, PART]
  const auto part = [&](int64_t r, int64_t h, int64_t c) { return parts.data() + ((r * H + h) * spans + c) * PART; };
  const int64_t items = static_cast<int64_t>(blocks.size()) * head_items * spans;
  const int64_t grain = std::max<int64_t>(1, 65536 / (std::min(max_len, SPAN) * D * heads));
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    // Query i of an item: row i / heads of its block, head h0 + i % heads.
    std::vector<float> qs(BLOCK_ROWS * heads * D), scores(BLOCK_ROWS * heads * SPAN);
    alignas(64) float keys[16 * D], values[16 * D], own[D];  // Q8Rows' dequantized rows
    for (int64_t item = begin; item < end; ++item) {
      const Block& b = blocks[item / (head_items * spans)];
      const int64_t c = item / head_items % spans, h0 = item % head_items * heads, s = slots[b.first];
      const int64_t from = c * SPAN, n = b.n * heads;
      const auto [kh, vh] = head(s, h0 / group);
      // Row j of the block reads keys from .. ends[j]-1 here; its last key, lengths-1, at last[].
      int64_t ends[BLOCK_ROWS], reach = from;
      for (int64_t j = 0; j < b.n; ++j) {
        ends[j] = std::min(lengths[b.first + j], from + SPAN);
        reach = std::max(reach, ends[j]);
      }
      for (int64_t i = 0; i < n; ++i)
        for (int64_t d = 0; d < D; ++d) qs[i * D + d] = q[((b.first + i / heads) * H + h0 + i % heads) * D + d] * scale;
      // Row j's own key or value when it is not in the run (a tree node's, at its scratch position).
      const auto moved = [&](int64_t j, int64_t l, const Rows& rows, const float* run) {
        const int64_t r = b.first + j;
        if (l != lengths[r] - 1 || last[r] == l) return run + l % 16 * D;  // runs start at multiples of 16
        return rows.run(at.row(s, last[r]), 1, own);
      };
      for (int64_t l = from; l < reach; l += 16) {
        const float* run = kh.run(at.row(s, l), std::min<int64_t>(16, reach - l), keys);
        if (l + 16 < reach) kh.prefetch_run(at.row(s, l + 16));
        for (int64_t i = 0; i < n; ++i) {
          const int64_t j = i / heads;
          float* si = scores.data() + i * SPAN + (l - from);
          const float* qi = qs.data() + i * D;
          if (l + 16 <= ends[j]) {
            __m512 dots[16];
            for (int k = 0; k < 16; ++k) dots[k] = partial_dot<NC>(qi, moved(j, l + k, kh, run));
            _mm512_storeu_ps(si, sums16(dots));
          } else {
            for (int64_t k = l; k < ends[j]; ++k) si[k - l] = _mm512_reduce_add_ps(partial_dot<NC>(qi, moved(j, k, kh, run)));
          }
        }
      }
      for (int64_t i = 0; i < n; ++i) {
        const int64_t j = i / heads;
        float* pi = part(b.first + j, h0 + i % heads, c);
        std::fill(pi, pi + D, 0.f);
        if (ends[j] <= from) {  // the row ends before this span
          pi[D] = -INFINITY, pi[D + 1] = 0.f;
          continue;
        }
        std::tie(pi[D], pi[D + 1]) = exps(scores.data() + i * SPAN, ends[j] - from);
      }
      for (int64_t l = from; l < reach; l += 16) {  // values a run of 16 at a time, as the keys
        const float* run = vh.run(at.row(s, l), std::min<int64_t>(16, reach - l), values);
        if (l + 16 < reach) vh.prefetch_run(at.row(s, l + 16));
        for (int64_t i = 0; i < n; ++i) {
          const int64_t j = i / heads;
          float* pi = part(b.first + j, h0 + i % heads, c);
          // Keys two at a time into two sums: one chain of fused multiply-adds waited on the last.
          __m512 even[NC], odd[NC];
          for (int cc = 0; cc < NC; ++cc) even[cc] = _mm512_loadu_ps(pi + 16 * cc), odd[cc] = _mm512_setzero_ps();
          const int64_t stop = std::min(l + 16, ends[j]);
          const float* weights = scores.data() + i * SPAN - from;
          const auto add = [&](__m512(&acc)[NC], int64_t k) {
            const float* v = moved(j, k, vh, run);
            const __m512 w = _mm512_set1_ps(weights[k]);
            for (int cc = 0; cc < NC; ++cc) acc[cc] = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 16 * cc), acc[cc]);
          };
          int64_t k = l;
          for (; k + 2 <= stop; k += 2) add(even, k), add(odd, k + 1);
          if (k < stop) add(even, k);
          for (int cc = 0; cc < NC; ++cc) _mm512_storeu_ps(pi + 16 * cc, _mm512_add_ps(even[cc], odd[cc]));
        }
      }
    }
  });
  // Each (row, head) merges its spans, each weighted by e^(its largest score - the row's largest).
  at::parallel_for(0, R * H, std::max<int64_t>(1, 4096 / (spans * D)), [&](int64_t begin, int64_t end) {
    for (int64_t rh = begin; rh < end; ++rh) {
      const float* p0 = part(rh / H, rh % H, 0);
      float top = -INFINITY, total = 0.f;
      for (int64_t c = 0; c < spans; ++c) top = std::max(top, p0[c * PART + D]);
      __m512 acc[NC];
      for (int cc = 0; cc < NC; ++cc) acc[cc] = _mm512_setzero_ps();
      for (int64_t c = 0; c < spans; ++c) {
        const float* pc = p0 + c * PART;
        if (pc[D + 1] == 0.f) continue;  // a span past the row's end
        const float w = std::exp(pc[D] - top);
        total += w * pc[D + 1];
        for (int cc = 0; cc < NC; ++cc) acc[cc] = _mm512_fmadd_ps(_mm512_set1_ps(w), _mm512_loadu_ps(pc + 16 * cc), acc[cc]);
      }
      const __m512 inverse = _mm512_set1_ps(1.f / total);
      for (int cc = 0; cc < NC; ++cc) _mm512_storeu_ps(out + rh * D + 16 * cc, _mm512_mul_ps(acc[cc], inverse));
    }
  });
}

#endif

}  // namespace

namespace tandem {

Layout Layout::of(const at::Tensor& k, const c10::optional<at::Tensor>& pages) {
  Layout at;
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
                            const c10::optional<at::Tensor>& pages, const c10::optional<at::Tensor>& k_scale,
                            const c10::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.sizes() == k.sizes() && q.size(2) == k.size(3),
              "decode_attention: q [R, H, D], k and v [S, KVH, C, D] expected, got ", q.sizes(), ", ", k.sizes(),
              ", ", v.sizes());
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "decode_attention: k and v must be whole, contiguous caches");
  const bool q8 = k_scale.has_value();
  TORCH_CHECK(v_scale.has_value() == q8, "decode_attention: a q8_0 cache gives both K's and V's scales");
  if (q8) {
    check_q8(k, *k_scale, "decode_attention");
    check_q8(v, *v_scale, "decode_attention");
    TORCH_CHECK(q.scalar_type() == at::kFloat, "decode_attention: q8_0 caches take f32 queries, got ", q.scalar_type());
  } else {
    TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                "decode_attention: q, k and v in one dtype");
  }
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1), C = k.size(2);
  const int64_t S = check_pages(k, pages, "decode_attention");
  TORCH_CHECK(H % KVH == 0, "decode_attention: kv heads (", KVH, ") must divide heads (", H, ")");
  TORCH_CHECK(slots.numel() == R && lengths.numel() == R, "decode_attention: one slot and one length per row");
  const at::Tensor s = slots.to(at::kLong).contiguous(), n = lengths.to(at::kLong).contiguous();
  const at::Tensor own = last.has_value() ? last->to(at::kLong).contiguous() : at::Tensor();
  TORCH_CHECK(!own.defined() || own.numel() == R, "decode_attention: one last position per row");
  const int64_t* sp = s.data_ptr<int64_t>();
  const int64_t* np = n.data_ptr<int64_t>();
  // Without `last`, each row's lengths - 1: a tensor op's dispatch cost more than the attention of
  // a short decode row.
  std::vector<int64_t> ends;
  if (!own.defined()) {
    ends.assign(np, np + R);
    for (int64_t& e : ends) --e;
  }
  const int64_t* op = own.defined() ? own.data_ptr<int64_t>() : ends.data();
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
  if (q.scalar_type() == at::kFloat && with_chunks(D, [&](auto nc) {
        constexpr int NC = decltype(nc)::value;
        const auto run = [&](auto head) {
          attend_runs<NC>(qc.data_ptr<float>(), head, out.data_ptr<float>(), sp, np, op, R, H, KVH, at,
                          static_cast<float>(scale));
        };
        if (!q8) {
          const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
          run([&](int64_t s, int64_t g) {
            const int64_t o = at.head_offset(k, s, g);
            return std::pair{F32Rows<NC>{kp + o}, F32Rows<NC>{vp + o}};
          });
          return;
        }
        const int8_t *kp = k.data_ptr<int8_t>(), *vp = v.data_ptr<int8_t>();
        const auto* ks = reinterpret_cast<const uint16_t*>(k_scale->data_ptr<at::Half>());
        const auto* vs = reinterpret_cast<const uint16_t*>(v_scale->data_ptr<at::Half>());
        const int64_t per_row = k_scale->size(3);
        run([&](int64_t s, int64_t g) {
          const int64_t o = at.head_offset(k, s, g), so = at.head_offset(*k_scale, s, g);
          return std::pair{Q8Rows<NC>{kp + o, ks + so, per_row}, Q8Rows<NC>{vp + o, vs + so, per_row}};
        });
      }))
    return out;
#endif
  if (q8)  // a head dim or CPU without the fast path: the same attention on f32 copies
    return decode_attention(q, dequantize_q8(k, *k_scale), dequantize_q8(v, *v_scale), slots, lengths, scale, last,
                            pages, c10::nullopt, c10::nullopt);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "decode_attention", [&] {
    attend(qc.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), sp, np,
           op, R, H, KVH, D, at, k, static_cast<float>(scale));
  });
  return out;
}

// One query q [H, D] f32 against the keys and values at rows[0 .. m-1] of a slot's storage k, v
// [KVH, rows, D] f32 (last axis contiguous) -> [H, D]: a QSA query past its budget, attending its
// selected blocks and its tail where they lie, in place of a gathered copy (two copies of about
// 2,050 rows of 2 kv heads of 256 took 1.2 ms a layer at 8k, cold; the attention itself 0.6). A
// work item is one kv head's group of query heads over one span of rows, which it reads once;
// spans merge by their largest scores, as decode_attention's do.
at::Tensor attend_at(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& rows,
                     double scale) {
  TORCH_CHECK(q.dim() == 2 && k.dim() == 3 && v.sizes() == k.sizes() && q.size(1) == k.size(2) &&
                  q.size(0) % k.size(0) == 0 && q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat && k.stride(2) == 1 && v.stride(2) == 1 && v.strides() == k.strides(),
              "attend_at: q [H, D] and k, v [KVH, rows, D] in f32 (KVH dividing H, D contiguous) expected, got ",
              q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  const at::Tensor index = rows.to(at::kLong).contiguous(), qc = q.contiguous();
  const int64_t H = q.size(0), D = q.size(1), KVH = k.size(0), group = H / KVH, m = index.numel();
  const int64_t* ip = index.data_ptr<int64_t>();
  TORCH_CHECK(m > 0, "attend_at: no rows to attend");
  for (int64_t l = 0; l < m; ++l)
    TORCH_CHECK(ip[l] >= 0 && ip[l] < k.size(1), "attend_at: row ", ip[l], " outside ", k.size(1), " rows");
  const int64_t spans = (m + SPAN - 1) / SPAN, PART = D + 2;
  std::vector<float> parts(KVH * spans * group * PART);  // [KVH, spans, group, PART]
  const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>(), *qp = qc.data_ptr<float>();
  const int64_t head_stride = k.stride(0), row_stride = k.stride(1);
  at::parallel_for(0, KVH * spans, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * SPAN);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / spans, c = item % spans, from = c * SPAN, n = std::min(SPAN, m - from);
      const float* kh = kp + g * head_stride;
      const float* vh = vp + g * head_stride;
      const float* qg = qp + g * group * D;
      for (int64_t l = 0; l < n; ++l) {
        if (l + PREFETCH_ROWS < n) prefetch_row<2>(kh + ip[from + l + PREFETCH_ROWS] * row_stride, D);
        const float* key = kh + ip[from + l] * row_stride;
        for (int64_t j = 0; j < group; ++j) {
          const float* qj = qg + j * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t i = 0; i < D; ++i) dot += qj[i] * key[i];
          scores[j * SPAN + l] = dot * static_cast<float>(scale);
        }
      }
      for (int64_t j = 0; j < group; ++j) {
        float* sj = scores.data() + j * SPAN;
        float* pj = parts.data() + ((g * spans + c) * group + j) * PART;
        const float top = *std::max_element(sj, sj + n);
        float total = 0.f;
        for (int64_t l = 0; l < n; ++l) total += sj[l] = std::exp(sj[l] - top);
        std::fill(pj, pj + D, 0.f);
        pj[D] = top, pj[D + 1] = total;
      }
      for (int64_t l = 0; l < n; ++l) {
        if (l + PREFETCH_ROWS < n) prefetch_row<2>(vh + ip[from + l + PREFETCH_ROWS] * row_stride, D);
        const float* value = vh + ip[from + l] * row_stride;
        for (int64_t j = 0; j < group; ++j) {
          float* pj = parts.data() + ((g * spans + c) * group + j) * PART;
          const float w = scores[j * SPAN + l];
#pragma omp simd
          for (int64_t i = 0; i < D; ++i) pj[i] += w * value[i];
        }
      }
    }
  });
  at::Tensor out = at::empty({H, D}, qc.options());
  float* o = out.data_ptr<float>();
  for (int64_t h = 0; h < H; ++h) {  // the spans of query head h merged by their largest scores
    const int64_t g = h / group, j = h % group;
    const auto part = [&](int64_t c) { return parts.data() + ((g * spans + c) * group + j) * PART; };
    float top = -INFINITY;
    for (int64_t c = 0; c < spans; ++c) top = std::max(top, part(c)[D]);
    float total = 0.f;
    std::fill(o + h * D, o + h * D + D, 0.f);
    for (int64_t c = 0; c < spans; ++c) {
      const float w = std::exp(part(c)[D] - top);
      total += w * part(c)[D + 1];
      for (int64_t i = 0; i < D; ++i) o[h * D + i] += w * part(c)[i];
    }
    for (int64_t i = 0; i < D; ++i) o[h * D + i] /= total;
  }
  return out;
}

}  // namespace tandem

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor lengths, float scale, Tensor? last=None, "
        "Tensor? pages=None, Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor");
  m.def("attend_at(Tensor q, Tensor k, Tensor v, Tensor rows, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("decode_attention", tandem::decode_attention);
  m.impl("attend_at", tandem::attend_at);
}
