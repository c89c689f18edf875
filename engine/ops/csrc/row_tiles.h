// What the products of a few rows of x share, whatever the weight's format (linear.cpp: f32, bf16,
// int8 and GGUF's 32-weight blocks; kquants.cpp: the K-quants' super-blocks of 256): the split of
// output channels and rows into tiles, and x quantized to 8 bits per block of 32 (docs/
// architecture.md, "Weight formats": "8-bit activations").
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace tandem::rows {

constexpr int64_t PREFETCH = 2;  // tiles of weight rows ahead

// Asks for every cache line of the n bytes from p: a weight out of cache (the lm_head) streams at
// memory speed only with each of its lines asked for early.
inline void prefetch_lines(const void* p, int n) {
  const char* bytes = static_cast<const char*>(p);
  for (int line = 0; line < n; line += 64) __builtin_prefetch(bytes + line);
}
constexpr int64_t QK = 32;  // weights per GGUF block (and per block of quantized x)

// An f16 stored as raw bits (blocks are packed, so unaligned) -> f32.
inline float half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(bits);  // one instruction; c10::Half's portable conversion costs a dozen per block
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// scale and bias are null when the layer has none.
inline float epilogue(float v, const float* scale, const float* bias, int i) {
  if (scale) v *= scale[i];
  if (bias) v += bias[i];
  return v;
}

// f(std::integral_constant<int, m>{}) for a tile's m <= MR rows: the row count as a template argument.
template <int MR, typename F>
inline void with_rows(int64_t m, F&& f) {
  switch (m) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
  }
  if constexpr (MR > 4) {
    switch (m) {
      case 5: return f(std::integral_constant<int, 5>{});
      case 6: return f(std::integral_constant<int, 6>{});
      case 7: return f(std::integral_constant<int, 7>{});
      default: return f(std::integral_constant<int, 8>{});
    }
  }
}

inline const float* offset_by(const float* p, int64_t n) { return p ? p + n : nullptr; }

// tile(r, n0, m0, m) over tiles of NR output channels (r = std::integral_constant<int, NR>, or <int, 1>
// for each of the last N % NR channels) and MR rows of x (m of them): each weight is widened once
// per tile, and each thread streams a contiguous run of channels; small matrices stay on one thread.
template <int NR, int64_t MR, typename Tile>
inline void tiles(int64_t M, int64_t N, int64_t K, Tile&& tile) {
  const int64_t blocks = (N + NR - 1) / NR;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / (K * NR));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * NR;
      for (int64_t m0 = 0; m0 < M; m0 += MR) {
        const int64_t m = std::min(MR, M - m0);
        if (n0 + NR <= N) {
          tile(std::integral_constant<int, NR>{}, n0, m0, m);
        } else {
          for (int64_t n = n0; n < N; ++n) tile(std::integral_constant<int, 1>{}, n, m0, m);
        }
      }
    }
  });
}

// f(nr, mr) with AVX-512's tile for M rows (std::integral_constants): a lone row (decode) 8
// channels, so that more independent sums are in flight; up to 4 rows 4 channels x 4 rows of
// accumulators; more rows (a verify block of several slots, a prompt chunk) 2 channels x 8 rows, so
// that 8 rows read the weights once, not twice, in the same 16 accumulator registers. Each output is
// the same sum in the same order whichever tile holds it.
template <typename F>
inline void with_tile(int64_t M, F&& f) {
  if (M == 1) return f(std::integral_constant<int, 8>{}, std::integral_constant<int64_t, 1>{});
  if (M <= 4) return f(std::integral_constant<int, 4>{}, std::integral_constant<int64_t, 4>{});
  f(std::integral_constant<int, 2>{}, std::integral_constant<int64_t, 8>{});
}

#ifdef __AVX512F__
// The first n of 16 lanes (all 16 for n >= 16): a row's last, partial vector.
inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1); }
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define TANDEM_Q8_ACTIVATIONS 1

constexpr int LANES = 4;  // int32 lanes a block's sum spreads over

// What a weight format's product takes from x besides q_x and d_x: `halves`, d_x sum q_x over
// each half of a block (weights 0..15, 16..31), for a format whose halves have scales of their own
// (Q6_K); `offset`, for a format of weights d (u - offset), each lane's -offset sum q_x, the integer
// that the offset's share adds to the lane's dot product; `minima`, for a format of weights d u + m,
// each lane's d_x sum q_x, which its block's m multiplies.
struct RowSums {
  bool halves = false;
  int offset = 0;
  bool minima = false;
};

// M rows of x quantized: per row, G groups of 128 int8 in halves, each block's d_x repeated over
// its LANES lanes, and each block's d_x sum q_x; padded with zeros to whole groups; and what
// RowSums asks for: per half block [M, 2 padded], per lane [M, G, 16].
struct QuantizedRows {
  const int8_t* q;
  const float* dx;
  const float* sx;
  const float* sxh;
  const int32_t* offsets;
  const float* lane_sums;
  int64_t groups;  // per row
  const int8_t* q_row(int64_t j) const { return q + j * groups * 128; }
};

inline QuantizedRows quantize_rows(const float* x, int64_t M, int64_t nb, RowSums want = {}) {
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> dx, sx, sxh, lane_sums;
  thread_local std::vector<int32_t> offsets;
  const int64_t groups = (nb + 3) / 4, padded = groups * 4;
  q.assign(M * groups * 128, 0);
  dx.assign(M * padded * LANES, 0.f);
  sx.assign(M * padded, 0.f);
  if (want.halves) sxh.assign(M * padded * 2, 0.f);
  if (want.offset) offsets.resize(M * groups * 16);
  if (want.minima) lane_sums.resize(M * groups * 16);
  // The buffers are this thread's: the workers below write through pointers, not their own copies.
  int8_t* qp = q.data();
  float *dp = dx.data(), *sp = sx.data(), *hp = want.halves ? sxh.data() : nullptr;
  int32_t* op = want.offset ? offsets.data() : nullptr;
  float* lp = want.minima ? lane_sums.data() : nullptr;
  at::parallel_for(0, M, std::max<int64_t>(1, 4096 / (nb * QK)), [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      int8_t* qr = qp + j * groups * 128;
      for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x + (j * nb + b) * QK;
        const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
        const __m512 idv = _mm512_set1_ps(id);
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, idv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, idv));
        int8_t* first = qr + (b / 4) * 128 + (b % 4) * 16;
        int8_t* second = first + 64;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(first), _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(second), _mm512_cvtsepi32_epi8(q1));
        const float dh = _cvtsh_ss(_cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT));
        std::fill_n(dp + (j * padded + b) * LANES, LANES, dh);
        sp[j * padded + b] = dh * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
        if (hp) {
          hp[(j * padded + b) * 2] = dh * static_cast<float>(_mm512_reduce_add_epi32(q0));
          hp[(j * padded + b) * 2 + 1] = dh * static_cast<float>(_mm512_reduce_add_epi32(q1));
        }
      }
      // Each lane's sum of q_x, as the weights' lanes take them (vpdpbusd against ones).
      for (int64_t g = 0; g < groups && (op || lp); ++g) {
        const __m512i ones = _mm512_set1_epi8(1);
        const __m512i lanes = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_loadu_si512(qr + g * 128)),
                                                  ones, _mm512_loadu_si512(qr + g * 128 + 64));
        if (op) _mm512_storeu_si512(op + (j * groups + g) * 16, _mm512_mullo_epi32(lanes, _mm512_set1_epi32(-want.offset)));
        if (lp) _mm512_storeu_ps(lp + (j * groups + g) * 16, _mm512_mul_ps(_mm512_cvtepi32_ps(lanes),
                                                                           _mm512_loadu_ps(dp + (j * padded + 4 * g) * LANES)));
      }
    }
  });
  return {qp, dp, sp, hp, op, lp, groups};
}
#endif

}  // namespace tandem::rows
