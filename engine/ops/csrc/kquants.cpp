// linear_rows for GGUF's K-quants, Q4_K, Q5_K and Q6_K, read as the file stores them: super-blocks
// of 256 weights, a weight [N, K] held as uint8 [N, K / 256, B] with B the super-block's bytes
// (144, 176, 210), so that its shape names its format (a Q4_K row is as long as a Q4_0 row).
//
//   Q4_K, Q5_K  8 sub-blocks of 32: w = d sc_j q - dmin m_j, d and dmin f16 per super-block, sc_j and
//               m_j 6-bit per sub-block, q 4-bit (Q5_K: a fifth bit per weight in qh)
//   Q6_K        16 sub-blocks of 16: w = d sc_j (q - 32), q 6-bit, sc_j int8
//
// As linear.cpp's 32-weight blocks: with f32 activations each weight widens to the number llama.cpp's
// dequantization (and gguf's) gives, so the product is the f32 path's up to summation order; with
// 8-bit activations each sub-block of 32 is an integer dot product against x's q8_0 block of the
// same weights, times its scales, and the minima (Q6_K: the offset 32) multiply x's block sums.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "row_tiles.h"
#include "tandem.h"

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

using namespace tandem::rows;

constexpr int64_t QK_K = 256;  // weights per super-block

struct BlockQ4_K { uint8_t d[2]; uint8_t dmin[2]; uint8_t scales[12]; uint8_t qs[QK_K / 2]; };
struct BlockQ5_K { uint8_t d[2]; uint8_t dmin[2]; uint8_t scales[12]; uint8_t qh[QK_K / 8]; uint8_t qs[QK_K / 2]; };
struct BlockQ6_K { uint8_t ql[QK_K / 2]; uint8_t qh[QK_K / 4]; int8_t scales[QK_K / 16]; uint8_t d[2]; };
static_assert(sizeof(BlockQ4_K) == 144 && sizeof(BlockQ5_K) == 176 && sizeof(BlockQ6_K) == 210, "GGUF super-block sizes");

template <typename S> constexpr bool HAS_MINS = !std::is_same_v<S, BlockQ6_K>;

// The 6-bit scales and minima of a Q4_K or Q5_K super-block, byte j of each sub-block j's: the first
// four whole in bytes 0-3 (scales) and 4-7 (minima), the last four from bytes 8-11's nibbles and the
// top two bits of bytes 0-7.
struct SubScales { uint64_t sc, m; };
inline SubScales sub_scales(const uint8_t* s) {
  uint32_t a, b, c;
  std::memcpy(&a, s, 4);
  std::memcpy(&b, s + 4, 4);
  std::memcpy(&c, s + 8, 4);
  const uint32_t sc_hi = (c & 0x0F0F0F0F) | ((a >> 2) & 0x30303030);
  const uint32_t m_hi = ((c >> 4) & 0x0F0F0F0F) | ((b >> 2) & 0x30303030);
  return {(a & 0x3F3F3F3F) | uint64_t{sc_hi} << 32, (b & 0x3F3F3F3F) | uint64_t{m_hi} << 32};
}
inline float byte_of(uint64_t v, int j) { return static_cast<float>((v >> (8 * j)) & 0xFF); }

// A super-block's 256 weights as f32, as llama.cpp's dequantize_row_q*_K computes them. Each loop
// runs over 32 (Q6_K: 16) weights with one shift and one scale, which the compiler vectorizes.
template <typename S, std::enable_if_t<HAS_MINS<S>, int> = 0>
void dequantize(const S& b, float* y) {
  const float d = half(b.d), dmin = half(b.dmin);
  const SubScales s = sub_scales(b.scales);
  for (int j = 0; j < 8; ++j) {
    // Sub-blocks 2i and 2i + 1 are the low and high nibbles of bytes 32i .. 32i + 31; Q5_K's fifth
    // bit of weight l of sub-block j is bit j of qh[l].
    const float d1 = d * byte_of(s.sc, j), m1 = dmin * byte_of(s.m, j);
    const uint8_t* qs = b.qs + 32 * (j / 2);
    const int shift = 4 * (j % 2);
    float* out = y + 32 * j;
    for (int l = 0; l < 32; ++l) {
      int q = (qs[l] >> shift) & 0x0F;
      if constexpr (std::is_same_v<S, BlockQ5_K>) q |= ((b.qh[l] >> j) & 1) << 4;
      out[l] = d1 * static_cast<float>(q) - m1;
    }
  }
}
// Q6_K: each half of 128 weights takes 64 bytes of ql and 32 of qh; its weights 32t + l (t < 4,
// l < 32) are ql[32 (t % 2) + l]'s low (t < 2) or high nibble over bits 2t, 2t + 1 of qh[l], less
// 32; weights 16k .. 16k + 15 have scale k.
void dequantize(const BlockQ6_K& b, float* y) {
  const float d = half(b.d);
  for (int n = 0; n < 2; ++n)
    for (int t = 0; t < 4; ++t)
      for (int h = 0; h < 2; ++h) {
        const uint8_t* ql = b.ql + 64 * n + 32 * (t % 2) + 16 * h;
        const uint8_t* qh = b.qh + 32 * n + 16 * h;
        const int low = 4 * (t / 2), top = 2 * t;
        const float scale = d * static_cast<float>(b.scales[8 * n + 2 * t + h]);
        float* out = y + 128 * n + 32 * t + 16 * h;
        for (int l = 0; l < 16; ++l)
          out[l] = scale * static_cast<float>((((ql[l] >> low) & 0x0F) | (((qh[l] >> top) & 3) << 4)) - 32);
      }
}

// out[j, i] = sum_k w[i, k] x[j, k] + bias[i] for R channels, M rows, f32 activations, with each
// super-block widened once per tile. Every row's sum runs in 16 lanes in the same order whatever
// rows share the call, and the lanes add up in order at the end.
#if defined(__AVX512F__) && defined(__AVX512BW__)

// A super-block's half g (weights 128g .. 128g + 127) as two planes of 64 unsigned bytes, each 16
// bytes (a lane) 16 consecutive weights: Q4_K and Q5_K, L sub-blocks 4g and 4g + 2 whole, H 4g + 1
// and 4g + 3 (each their nibbles, Q5_K's fifth bits over them); Q6_K, L its first 64 weights, H its
// last, each q + 32. PIECE[v]: which plane (0 L, 1 H) and lane hold the half's weights 16v .. 16v + 15.
struct Piece { int plane, lane; };
template <typename S>
constexpr Piece PIECE[8] = {{0, 0}, {0, 1}, {1, 0}, {1, 1}, {0, 2}, {0, 3}, {1, 2}, {1, 3}};
template <>
constexpr Piece PIECE<BlockQ6_K>[8] = {{0, 0}, {0, 1}, {0, 2}, {0, 3}, {1, 0}, {1, 1}, {1, 2}, {1, 3}};

// Bits `shift` (per 64-bit lane) .. of each byte of v, masked by `bits`, moved up to bit 4.
inline __m512i high(__m512i v, __m512i shift, int bits) {
  return _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi64(v, shift), _mm512_set1_epi8(static_cast<char>(bits))), 4);
}
inline void nibbles(const uint8_t* qs, int g, __m512i& L, __m512i& H) {
  const __m512i q = _mm512_loadu_si512(qs + 64 * g), lo4 = _mm512_set1_epi8(0x0F);
  L = _mm512_and_si512(q, lo4);
  H = _mm512_and_si512(_mm512_srli_epi16(q, 4), lo4);
}
inline void planes(const BlockQ4_K& b, int g, __m512i& L, __m512i& H) { nibbles(b.qs, g, L, H); }
inline void planes(const BlockQ5_K& b, int g, __m512i& L, __m512i& H) {
  nibbles(b.qs, g, L, H);
  // Sub-block j's fifth bits are bit j of qh's 32 bytes: L's first 32 bytes take bit 4g, its last 4g + 2.
  const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qh)));
  const int64_t j = 4 * g;
  L = _mm512_or_si512(L, high(qh, _mm512_set_epi64(j + 2, j + 2, j + 2, j + 2, j, j, j, j), 1));
  H = _mm512_or_si512(H, high(qh, _mm512_set_epi64(j + 3, j + 3, j + 3, j + 3, j + 1, j + 1, j + 1, j + 1), 1));
}
inline void planes(const BlockQ6_K& b, int g, __m512i& L, __m512i& H) {
  const __m512i ql = _mm512_loadu_si512(b.ql + 64 * g), lo4 = _mm512_set1_epi8(0x0F);
  const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qh + 32 * g)));
  L = _mm512_or_si512(_mm512_and_si512(ql, lo4), high(qh, _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0), 3));
  H = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), lo4), high(qh, _mm512_set_epi64(6, 6, 6, 6, 4, 4, 4, 4), 3));
}

// Per 16 weights of a super-block, the f32 scale and minimum that widen them: d sc_j and dmin m_j
// for both halves of sub-block j (Q4_K, Q5_K), d sc_k (Q6_K, whose offset 32 is taken off q).
template <typename S, std::enable_if_t<HAS_MINS<S>, int> = 0>
inline void widening(const S& b, float* scale, float* minimum) {
  const float d = half(b.d), dmin = half(b.dmin);
  const SubScales s = sub_scales(b.scales);
  for (int j = 0; j < 8; ++j) {
    scale[2 * j] = scale[2 * j + 1] = d * byte_of(s.sc, j);
    minimum[2 * j] = minimum[2 * j + 1] = dmin * byte_of(s.m, j);
  }
}
inline void widening(const BlockQ6_K& b, float* scale, float*) {
  _mm512_store_ps(scale, _mm512_mul_ps(_mm512_set1_ps(half(b.d)),
                                       _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.scales))))));
}

template <int R, int M, typename S>
void f32_super(const S* w, int64_t ldw, const float* x, int64_t K, const float* bias, float* out, int64_t ldo) {
  __m512 acc[R][M];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < M; ++j) acc[i][j] = _mm512_setzero_ps();
  alignas(64) float scale[16], minimum[16];
  for (int i = 0; i < R; ++i)  // channel by channel: the weights stream in address order
    for (int64_t s = 0; s < ldw; ++s) {
      const S& b = w[i * ldw + s];
      prefetch_lines(w + (i + PREFETCH * R) * ldw + s, sizeof(S));
      widening(b, scale, minimum);
      for (int g = 0; g < 2; ++g) {
        __m512i plane[2];
        planes(b, g, plane[0], plane[1]);
#pragma GCC unroll 8
        for (int v = 0; v < 8; ++v) {
          const Piece p = PIECE<S>[v];
          const int k = 8 * g + v;  // the piece of 16 weights in the super-block
          __m512i q = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(plane[p.plane], 0));
          switch (p.lane) {  // the lane is a constant once unrolled; extracti32x4 wants one
            case 1: q = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(plane[p.plane], 1)); break;
            case 2: q = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(plane[p.plane], 2)); break;
            case 3: q = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(plane[p.plane], 3)); break;
          }
          // The weights as dequantize() rounds them: d sc q - dmin m, or d sc (q - 32).
          __m512 wv;
          if constexpr (HAS_MINS<S>) {
            wv = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(scale[k]), _mm512_cvtepi32_ps(q)), _mm512_set1_ps(minimum[k]));
          } else {
            wv = _mm512_mul_ps(_mm512_set1_ps(scale[k]), _mm512_cvtepi32_ps(_mm512_sub_epi32(q, _mm512_set1_epi32(32))));
          }
#pragma GCC unroll 8
          for (int j = 0; j < M; ++j) acc[i][j] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + j * K + s * QK_K + 16 * k), acc[i][j]);
        }
      }
    }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < M; ++j) out[j * ldo + i] = epilogue(_mm512_reduce_add_ps(acc[i][j]), nullptr, bias, i);
}

#else

template <int R, int M, typename S>
void f32_super(const S* w, int64_t ldw, const float* x, int64_t K, const float* bias, float* out, int64_t ldo) {
  float acc[R][M][16] = {};
  alignas(64) float y[QK_K];
  for (int i = 0; i < R; ++i)
    for (int64_t s = 0; s < ldw; ++s) {
      prefetch_lines(w + (i + PREFETCH * R) * ldw + s, sizeof(S));
      dequantize(w[i * ldw + s], y);
      for (int j = 0; j < M; ++j) {
        const float* xs = x + j * K + s * QK_K;
        for (int k = 0; k < QK_K; k += 16)
          for (int l = 0; l < 16; ++l) acc[i][j][l] += y[k + l] * xs[k + l];
      }
    }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < M; ++j) {
      float t = 0.f;
      for (int l = 0; l < 16; ++l) t += acc[i][j][l];
      out[j * ldo + i] = epilogue(t, nullptr, bias, i);
    }
}

#endif

#ifdef TANDEM_Q8_ACTIVATIONS

// For 8-bit activations a half's planes become linear.cpp's layout of a group of 4 blocks of 32:
// `lo` the weights 0..15 of each block in turn, `hi` their weights 16..31.
template <typename S>
inline void unpack(const S& b, int g, __m512i& lo, __m512i& hi) {
  __m512i L, H;
  planes(b, g, L, H);
  if constexpr (HAS_MINS<S>) {  // L: blocks 0 and 2, H: 1 and 3
    lo = _mm512_permutex2var_epi64(L, _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0), H);
    hi = _mm512_permutex2var_epi64(L, _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2), H);
  } else {  // L: blocks 0 and 1, H: 2 and 3
    lo = _mm512_shuffle_i64x2(L, H, 0x88);
    hi = _mm512_shuffle_i64x2(L, H, 0xDD);
  }
}

// A super-block's scales over the lanes of its groups' products (lanes 4t .. 4t + 3 sum block t of
// the group): `lo[g]`, `hi[g]` the d_w of lo's and hi's lanes (the same but for Q6_K, whose halves of
// a block have scales of their own), and `offset` the coefficients of x's sums: -dmin m_j against
// its 8 block sums (Q4_K, Q5_K), -32 d sc_k against its 16 half-block sums (Q6_K).
struct Scales { __m512 lo[2], hi[2], offset; };

template <typename S, std::enable_if_t<HAS_MINS<S>, int> = 0>
inline Scales scales(const S& b) {
  const SubScales s = sub_scales(b.scales);
  const auto floats = [](uint64_t bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bytes))); };
  const __m512 d = _mm512_castps256_ps512(_mm256_mul_ps(_mm256_set1_ps(half(b.d)), floats(s.sc)));
  Scales out;
  out.lo[0] = out.hi[0] = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3), d);
  out.lo[1] = out.hi[1] = _mm512_permutexvar_ps(_mm512_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7), d);
  out.offset = _mm512_zextps256_ps512(_mm256_mul_ps(_mm256_set1_ps(-half(b.dmin)), floats(s.m)));
  return out;
}
inline Scales scales(const BlockQ6_K& b) {
  const __m512 d = _mm512_mul_ps(_mm512_set1_ps(half(b.d)),
                                 _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.scales)))));
  Scales out;
  for (int g = 0; g < 2; ++g) {
    const int k = 8 * g;
    const __m512i first = _mm512_setr_epi32(k, k, k, k, k + 2, k + 2, k + 2, k + 2, k + 4, k + 4, k + 4, k + 4, k + 6, k + 6, k + 6, k + 6);
    out.lo[g] = _mm512_permutexvar_ps(first, d);
    out.hi[g] = _mm512_permutexvar_ps(_mm512_add_epi32(first, _mm512_set1_epi32(1)), d);
  }
  out.offset = _mm512_mul_ps(d, _mm512_set1_ps(-32.f));
  return out;
}

// out[j, i] = sum over the super-blocks of row i of w against quantized row j, R channels, M rows.
template <int R, int M, typename S>
void q8_super(const S* w, int64_t ldw, const QuantizedRows& x, int64_t j0, const float* bias, float* out, int64_t ldo) {
  __m512 acc[R][M];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < M; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t padded = x.groups * 4;
  const int8_t* q_rows[M];
  const float *dx_rows[M], *sum_rows[M];
  for (int j = 0; j < M; ++j) {
    q_rows[j] = x.q_row(j0 + j);
    dx_rows[j] = x.dx + (j0 + j) * padded * LANES;
    sum_rows[j] = HAS_MINS<S> ? x.sx + (j0 + j) * padded : x.sxh + (j0 + j) * padded * 2;
  }
  // Channel by channel, each row's super-blocks in turn: the weights stream in address order.
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    for (int64_t s = 0; s < ldw; ++s) {
      const S& b = w[i * ldw + s];
      prefetch_lines(w + (i + PREFETCH * R) * ldw + s, sizeof(S));
      const Scales sc = scales(b);
#pragma GCC unroll 2
      for (int g = 0; g < 2; ++g) {
        __m512i lo, hi;
        unpack(b, g, lo, hi);
        const int64_t block = s * 8 + g * 4;  // the group's first block of 32 in the row
#pragma GCC unroll 8
        for (int j = 0; j < M; ++j) {
          const int8_t* q = q_rows[j] + block * QK;
          const __m512 dx = _mm512_loadu_ps(dx_rows[j] + block * LANES);
          const __m512i zero = _mm512_setzero_si512();
          if constexpr (HAS_MINS<S>) {
            const __m512i t = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, lo, _mm512_loadu_si512(q)), hi, _mm512_loadu_si512(q + 64));
            acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(sc.lo[g], dx), acc[i][j]);
          } else {
            const __m512 a = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, lo, _mm512_loadu_si512(q)));
            const __m512 c = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, hi, _mm512_loadu_si512(q + 64)));
            acc[i][j] = _mm512_fmadd_ps(_mm512_fmadd_ps(a, sc.lo[g], _mm512_mul_ps(c, sc.hi[g])), dx, acc[i][j]);
          }
        }
      }
#pragma GCC unroll 8
      for (int j = 0; j < M; ++j) {
        const __m512 sums = HAS_MINS<S> ? _mm512_maskz_loadu_ps(0x00FF, sum_rows[j] + s * 8)
                                        : _mm512_loadu_ps(sum_rows[j] + s * 16);
        acc[i][j] = _mm512_fmadd_ps(sc.offset, sums, acc[i][j]);
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < M; ++j) out[j * ldo + i] = epilogue(_mm512_reduce_add_ps(acc[i][j]), nullptr, bias, i);
}
#endif

template <typename S>
void super_rows(const S* w, const float* x, int64_t M, int64_t N, int64_t K, const float* bias, float* out, int64_t ldo,
                bool q8) {
  const int64_t ldw = K / QK_K;
  // Without AVX-512 VNNI (AVX2's 8-bit path takes the 32-weight blocks only) q8 reads x as f32.
#ifdef TANDEM_Q8_ACTIVATIONS
  if (q8) {
    const QuantizedRows q = quantize_rows(x, M, K / QK, RowSums{!HAS_MINS<S>, 0, false});
    return with_tile(M, [&](auto nr, auto mr) {
      constexpr int64_t MR = decltype(mr)::value;
      tiles<decltype(nr)::value, MR>(M, N, K, [&](auto r, int64_t n0, int64_t m0, int64_t m) {
        with_rows<MR>(m, [&](auto rows) {
          q8_super<decltype(r)::value, decltype(rows)::value>(w + n0 * ldw, ldw, q, m0, offset_by(bias, n0),
                                                               out + m0 * ldo + n0, ldo);
        });
      });
    });
  }
#endif
  with_tile(M, [&](auto nr, auto mr) {
    constexpr int64_t MR = decltype(mr)::value;
    tiles<decltype(nr)::value, MR>(M, N, K, [&](auto r, int64_t n0, int64_t m0, int64_t m) {
      with_rows<MR>(m, [&](auto rows) {
        f32_super<decltype(r)::value, decltype(rows)::value>(w + n0 * ldw, ldw, x + m0 * K, K, offset_by(bias, n0),
                                                             out + m0 * ldo + n0, ldo);
      });
    });
  });
}

// f(w as the super-block type whose size is `bytes`, one of check_super_blocks' answers).
template <typename F>
void with_super_blocks(int64_t bytes, const uint8_t* w, F&& f) {
  switch (bytes) {
    case sizeof(BlockQ4_K): return f(reinterpret_cast<const BlockQ4_K*>(w));
    case sizeof(BlockQ5_K): return f(reinterpret_cast<const BlockQ5_K*>(w));
    default: return f(reinterpret_cast<const BlockQ6_K*>(w));
  }
}

}  // namespace

namespace tandem {

int64_t check_super_blocks(const at::Tensor& weight, int64_t K, const char* op) {
  const int64_t bytes = weight.size(2);
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.is_contiguous() && weight.size(1) * QK_K == K &&
                  (bytes == sizeof(BlockQ4_K) || bytes == sizeof(BlockQ5_K) || bytes == sizeof(BlockQ6_K)),
              op, ": a K-quant weight is contiguous uint8 [N, K / 256, B], B 144 (Q4_K), 176 (Q5_K) or 210 (Q6_K); "
              "got ", weight.sizes(), " in ", weight.scalar_type(), " for K = ", K);
  return bytes;
}

void super_block_rows(const float* x, int64_t M, int64_t K, const at::Tensor& weight, const float* bias, float* out,
                      int64_t ldo, bool q8_activations) {
  const int64_t bytes = check_super_blocks(weight, K, "linear_rows");
  with_super_blocks(bytes, weight.data_ptr<uint8_t>(),
                    [&](auto w) { super_rows(w, x, M, weight.size(0), K, bias, out, ldo, q8_activations); });
}

at::Tensor dequantize_super_blocks(const at::Tensor& weight, int64_t K) {
  const int64_t bytes = check_super_blocks(weight, K, "dequantize_blocks");
  const int64_t N = weight.size(0), nb = weight.size(1);
  at::Tensor out = at::empty({N, nb * QK_K}, weight.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  with_super_blocks(bytes, weight.data_ptr<uint8_t>(), [&](auto w) {
    at::parallel_for(0, N * nb, std::max<int64_t>(1, 64), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) dequantize(w[i], op + i * QK_K);
    });
  });
  return out;
}

}  // namespace tandem
