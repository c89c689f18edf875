// tandem::linear_rows: y = x W^T * scale + bias for a few rows of x (decode slots, verify
// tokens), with W in f32, bf16, int8 (one f32 scale per output channel) or a GGUF block format
// (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: uint8 rows of 32-weight blocks, engine/ops/blocks.py; the K-quants'
// super-blocks of 256 weights are kquants.cpp's).
//
// At a few rows a linear layer is a matrix-vector product: every weight is used once per row,
// so its speed is how fast W streams from memory. Weights are widened to f32 in registers as
// they are read (int8 and bf16 convert exactly) and accumulated in f32, four output channels at
// a time against up to four rows of x, so each weight byte is read from memory once per step.
// Activations stay in floating point: only the weights are quantized. A block weight is widened
// with the same f32 operations that dequantize it (engine/blocks.py; a q4_1 or q5_1 block's minimum m
// multiplies the block's sum of x instead of being added to each weight), so the product equals
// the f32 path's on the dequantized matrix up to the order and grouping of the sum.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "row_tiles.h"
#include "tandem.h"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

using namespace tandem::rows;

// GGUF's blocks, byte for byte (f16 values as raw bits: the blocks are packed, so unaligned).
struct BlockQ4_0 { uint8_t d[2]; uint8_t qs[QK / 2]; };
struct BlockQ4_1 { uint8_t d[2]; uint8_t m[2]; uint8_t qs[QK / 2]; };
struct BlockQ5_0 { uint8_t d[2]; uint8_t qh[4]; uint8_t qs[QK / 2]; };
struct BlockQ5_1 { uint8_t d[2]; uint8_t m[2]; uint8_t qh[4]; uint8_t qs[QK / 2]; };
struct BlockQ8_0 { uint8_t d[2]; int8_t qs[QK]; };
static_assert(sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20 && sizeof(BlockQ5_0) == 22 && sizeof(BlockQ5_1) == 24 &&
              sizeof(BlockQ8_0) == 34, "GGUF block sizes");
// The formats whose weights are d q + m, a minimum m per block (the others are d (q - offset)), and
// those with a fifth bit per weight in qh.
template <typename B> constexpr bool HAS_MIN = std::is_same_v<B, BlockQ4_1> || std::is_same_v<B, BlockQ5_1>;
template <typename B> constexpr bool FIVE_BITS = std::is_same_v<B, BlockQ5_0> || std::is_same_v<B, BlockQ5_1>;

// The 32 weights of a block as f32, exactly as engine/blocks.py dequantize computes them.
inline void widen(const BlockQ8_0& b, float* out) {
  const float d = half(b.d);
  for (int k = 0; k < QK; ++k) out[k] = d * static_cast<float>(b.qs[k]);
}
inline void widen(const BlockQ4_0& b, float* out) {
  const float d = half(b.d);
  for (int k = 0; k < QK / 2; ++k) {
    out[k] = d * static_cast<float>((b.qs[k] & 0x0F) - 8);
    out[k + QK / 2] = d * static_cast<float>((b.qs[k] >> 4) - 8);
  }
}
inline void widen(const BlockQ4_1& b, float* out) {
  const float d = half(b.d), m = half(b.m);
  for (int k = 0; k < QK / 2; ++k) {
    out[k] = d * static_cast<float>(b.qs[k] & 0x0F) + m;
    out[k + QK / 2] = d * static_cast<float>(b.qs[k] >> 4) + m;
  }
}

// q5_0, q5_1: weight k's fifth bit is bit k of the little-endian word qh.
template <typename B, std::enable_if_t<FIVE_BITS<B>, int> = 0>
inline uint32_t high_bits(const B& b) {
  uint32_t qh;
  std::memcpy(&qh, b.qh, 4);
  return qh;
}
// Weight k's 5-bit q.
template <typename B>
inline int q5(const B& b, int k) {
  const int nibble = k < QK / 2 ? b.qs[k] & 0x0F : b.qs[k - QK / 2] >> 4;
  return nibble | static_cast<int>(((high_bits(b) >> k) & 1) << 4);
}
inline void widen(const BlockQ5_0& b, float* out) {
  const float d = half(b.d);
  for (int k = 0; k < QK; ++k) out[k] = d * static_cast<float>(q5(b, k) - 16);
}
inline void widen(const BlockQ5_1& b, float* out) {
  const float d = half(b.d), m = half(b.m);
  for (int k = 0; k < QK; ++k) out[k] = d * static_cast<float>(q5(b, k)) + m;
}

#ifdef __AVX2__
// A q5_0 or q5_1 block's 32 5-bit q as bytes, in weight order (both the AVX-512 and AVX2 products
// widen these): the nibbles, and over them the 32 fifth bits spread to one byte each (byte k
// takes bit k of qh).
// A 4-bit block's 16 bytes as its 32 nibbles, one a byte, in weight order (low nibbles first).
inline __m256i nibble_bytes(const uint8_t* qs) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), lo4 = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), lo4), _mm_and_si128(q, lo4));
}
template <typename B>
inline __m256i bytes_q5(const B& b) {
  const __m256i nib = nibble_bytes(b.qs);
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(high_bits(b))),
                                             _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201));
  const __m256i fifth = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
  return _mm256_or_si256(nib, fifth);
}
// q5_0's q - 16 as int8.
inline __m256i centred_q5(const BlockQ5_0& b) { return _mm256_sub_epi8(bytes_q5(b), _mm256_set1_epi8(16)); }
#endif

template <typename B>
constexpr bool is_block = std::is_same_v<B, BlockQ4_0> || std::is_same_v<B, BlockQ4_1> || std::is_same_v<B, BlockQ5_0> ||
                          std::is_same_v<B, BlockQ5_1> || std::is_same_v<B, BlockQ8_0>;

// One weight of a plain format as f32 (a row's tail past its last whole vector, the portable loop).
inline float widen(float v) { return v; }
inline float widen(int8_t v) { return static_cast<float>(v); }
inline float widen(at::BFloat16 v) { return static_cast<float>(v); }

#ifdef __AVX512F__

// 16 consecutive weights as f32; `mask` selects the first K % 16 at the end of a row.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load16(const int8_t* p, __mmask16 mask) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, p)));
}
inline __m512 widen_bf16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const at::BFloat16* p) {
  return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const at::BFloat16* p, __mmask16 mask) { return widen_bf16(_mm256_maskz_loadu_epi16(mask, p)); }

// out[j, i] = scale[i] sum_k w[i, k] x[j, k] + bias[i] for i < R output channels, j < M rows of x;
// weight row i starts at w + i * ldw.
template <int R, int M, typename W, std::enable_if_t<!is_block<W>, int> = 0>
void block(const W* w, int64_t ldw, const float* x, int64_t K, const float*, const float* scale, const float* bias,
           float* out, int64_t ldo) {
  __m512 acc[R][M];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < M; ++j) acc[i][j] = _mm512_setzero_ps();
  const auto step = [&](int64_t k, auto load) {
    __m512 xv[M];
    for (int j = 0; j < M; ++j) xv[j] = load(x + j * K + k);
    for (int i = 0; i < R; ++i) {
      const __m512 wv = load(w + i * ldw + k);
      for (int j = 0; j < M; ++j) acc[i][j] = _mm512_fmadd_ps(wv, xv[j], acc[i][j]);
    }
  };
  // One 64-byte line of each weight row per iteration, and a prefetch PREFETCH blocks ahead:
  // without it a core keeps too few misses in flight to stream int8 or bf16 at memory speed.
  constexpr int64_t V = 64 / (16 * sizeof(W));
  int64_t k = 0;
  for (; k + 16 * V <= K; k += 16 * V) {
    for (int i = 0; i < R; ++i) _mm_prefetch(reinterpret_cast<const char*>(w + (i + PREFETCH * R) * ldw + k), _MM_HINT_T0);
    for (int v = 0; v < V; ++v) step(k + 16 * v, [](auto p) { return load16(p); });
  }
  for (; k < K; k += 16) {
    const __mmask16 mask = first_lanes(K - k);
    step(k, [mask](auto p) { return load16(p, mask); });
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < M; ++j) out[j * ldo + i] = epilogue(_mm512_reduce_add_ps(acc[i][j]), scale, bias, i);
}

// A block's 32 weights d * q (q4_0: d * (q - 8)) as two f32 vectors, rounded as widen() above rounds
// them. A 4-bit block's 16 possible values are one vector, a table that vpermps indexes by nibble (it
// reads an index's low 4 bits, so the low nibbles need no mask): two permutes instead of widening 32
// nibbles. A q4_1 block's minimum m is added apart: to a weight here, to a product in block() below.
inline __m512i nibble_index(const uint8_t* qs) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
}
inline void scaled(const BlockQ8_0& b, float d, __m512& w0, __m512& w1) {
  const __m512 dv = _mm512_set1_ps(d);
  const __m128i* q = reinterpret_cast<const __m128i*>(b.qs);
  w0 = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))));
  w1 = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))));
}
inline void scaled(const BlockQ4_0& b, float d, __m512& w0, __m512& w1) {
  const __m512 centred = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  const __m512 table = _mm512_mul_ps(_mm512_set1_ps(d), centred);
  const __m512i index = nibble_index(b.qs);
  w0 = _mm512_permutexvar_ps(index, table);
  w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(index, 4), table);
}
inline void scaled(const BlockQ4_1& b, float d, __m512& w0, __m512& w1) {
  const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 table = _mm512_mul_ps(_mm512_set1_ps(d), levels);
  const __m512i index = nibble_index(b.qs);
  w0 = _mm512_permutexvar_ps(index, table);
  w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(index, 4), table);
}
inline void scaled(const BlockQ5_0& b, float d, __m512& w0, __m512& w1) {
  const __m256i q = centred_q5(b);
  const __m512 dv = _mm512_set1_ps(d);
  w0 = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))));
  w1 = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))));
}
inline void scaled(const BlockQ5_1& b, float d, __m512& w0, __m512& w1) {
  const __m256i q = bytes_q5(b);
  const __m512 dv = _mm512_set1_ps(d);
  w0 = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(q))));
  w1 = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(q, 1))));
}
// The whole dequantized weight d * q + m (two roundings, as engine/blocks.py computes it).
template <typename B>
inline void widen(const B& b, float d, float m, __m512& w0, __m512& w1) {
  scaled(b, d, w0, w1);
  if constexpr (HAS_MIN<B>) {
    w0 = _mm512_add_ps(w0, _mm512_set1_ps(m));
    w1 = _mm512_add_ps(w1, _mm512_set1_ps(m));
  }
}

constexpr int SCALES = 16;  // blocks whose f16 scales convert at once
constexpr int CHUNK = 4 * SCALES;  // blocks whose scales convert ahead of their products

// d (and m, for q4_1 and q5_1) of the n <= 16 blocks from w as f32: one gather of each block's first 4 bytes
// and one conversion, where one block at a time would cost a scalar load, move and convert each.
template <typename B>
inline void scales(const B* w, int n, float* d, float* m) {
  const __m512i offsets = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32(sizeof(B)));
  const __mmask16 mask = first_lanes(n);
  const __m512i first = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, offsets, w, 1);
  _mm512_storeu_ps(d, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(first)));
  if (HAS_MIN<B>) _mm512_storeu_ps(m, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(first, 16))));
}

// The same product over rows of blocks: ldw blocks per weight row, K = 32 * ldw.
template <int R, int M, typename B, std::enable_if_t<is_block<B>, int> = 0>
void block(const B* w, int64_t ldw, const float* x, int64_t K, const float* sums, const float* scale,
           const float* bias, float* out, int64_t ldo) {
  __m512 acc[R][M];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < M; ++j) acc[i][j] = _mm512_setzero_ps();
  constexpr int LINE_BLOCKS = 64 / sizeof(B) >= 2 ? 2 : 1;  // one prefetch per cache line, about
  // The scales of a whole chunk of blocks convert before its products start: converted a group at a
  // time, each group's products waited for its gather.
  alignas(64) float d[R][CHUNK], m[R][CHUNK];
  for (int64_t c0 = 0; c0 < ldw; c0 += CHUNK) {
    const int chunk = static_cast<int>(std::min<int64_t>(CHUNK, ldw - c0));
    for (int g = 0; g < chunk; g += SCALES)
      for (int i = 0; i < R; ++i) scales(w + i * ldw + c0 + g, std::min(SCALES, chunk - g), d[i] + g, m[i] + g);
    // Channel by channel, so that the weights stream in address order (as qblock below).
    for (int i = 0; i < R; ++i)
      for (int k = 0; k < chunk; ++k) {
        const int64_t b = c0 + k;
        if (k % LINE_BLOCKS == 0)
          _mm_prefetch(reinterpret_cast<const char*>(w + (i + PREFETCH * R) * ldw + b), _MM_HINT_T0);
        __m512 w0, w1;
        scaled(w[i * ldw + b], d[i][k], w0, w1);
        for (int j = 0; j < M; ++j)
          acc[i][j] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + j * K + b * QK + 16),
                                      _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + j * K + b * QK), acc[i][j]));
      }
    // q4_1, q5_1: sum_k (d q_k + m) x_k = sum_k d q_k x_k + m sum_k x_k, the minima of 16 blocks
    // against the sums of x over those blocks in one multiply-add, where adding m to each weight took
    // one operation per block. It regroups the sum, as a change of summation order would.
    if constexpr (HAS_MIN<B>) {
      for (int g = 0; g < chunk; g += SCALES) {
        const __mmask16 mask = first_lanes(chunk - g);
        for (int j = 0; j < M; ++j) {
          const __m512 xs = _mm512_maskz_loadu_ps(mask, sums + j * ldw + c0 + g);
          for (int i = 0; i < R; ++i) acc[i][j] = _mm512_fmadd_ps(_mm512_load_ps(m[i] + g), xs, acc[i][j]);
        }
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < M; ++j) out[j * ldo + i] = epilogue(_mm512_reduce_add_ps(acc[i][j]), scale, bias, i);
}

template <typename B>
inline float min_of(const B& b) {
  if constexpr (HAS_MIN<B>) return half(b.m);
  return 0.f;
}

// ---- 8-bit activations (docs/architecture.md, "Weight formats": "8-bit activations") ----
//
// With --activations q8 a block weight multiplies activations quantized per block of 32 as
// llama.cpp's q8_0 (d_x = max|x| / 127 rounded to f16, q_x = round(x / (max|x| / 127)), half to
// even), so that a block's product is an integer dot product, sum u q_x, exact in int32, times
// the block's d_w d_x: VNNI's vpdpbusd takes 64 of its u8 x s8 products per instruction, where the
// f32 path widens, converts and multiplies each weight. Every weight format is u unsigned with
// w = d (u - offset) (q4_1, q5_1: d u + m); the offset's share, -offset sum q_x, is an integer that
// starts each lane's dot product (x's quantization computes it per lane), and a minimum m multiplies
// its lane's d_x sum q_x. A row's sums run in the same order whatever rows share the call, so a
// verify row equals the decode row it stands for, bit for bit, as on the f32 path.

#ifdef TANDEM_Q8_ACTIVATIONS

template <typename B> constexpr int OFFSET = 0;
template <> constexpr int OFFSET<BlockQ4_0> = 8;
template <> constexpr int OFFSET<BlockQ5_0> = 16;
template <> constexpr int OFFSET<BlockQ8_0> = 128;
template <typename B> constexpr int QS = offsetof(B, qs);  // where a block's nibbles (or bytes) start

// The weights of a group of 4 blocks as two vectors of u8, in halves: `lo` holds weights 0..15 of
// blocks 0..3 (16 bytes each), `hi` their weights 16..31, and the quantized activations are laid
// out to match, so that the int32 lanes 4t..4t+3 of both products sum block t and the two add up
// before one conversion. The group's f16 scales (and q4_1's, q5_1's minima) come from the same
// loads, each block's over its 4 lanes.

// Byte pairs 2l, 2l + 1 of a vpermt2b index reading, for each of 16 lanes, the f16 at byte `field`
// of block l / 4 of a group (source: where a group byte lies in the two registers read).
template <typename Source>
__m512i f16_index(int size, int field, Source source) {
  alignas(64) uint8_t bytes[64] = {};
  for (int l = 0; l < 16; ++l)
    for (int j = 0; j < 2; ++j) bytes[2 * l + j] = source(l / 4 * size + field + j);
  return _mm512_load_si512(bytes);
}

// vpermt2b's indexes for 4 whole blocks read as two registers, bytes [0, 64) and [4 sizeof(B) - 64,
// 4 sizeof(B)) of the group (the second ends at the group's end, so no load reaches past the
// weight). `nibbles`: byte 16t + j of the result is byte j of block t's nibbles. `fifths` (q5_0, q5_1):
// with AVX-512 BITALG, block t's 4 bytes of qh begin the qwords 2t and 2t + 1 that lo's and hi's 16
// bytes of the block lie in, for vpshufbitqmb to pick each byte's bit into a mask; without it,
// bytes 2t, 2t + 1 are the low half of block t's qh, bytes 8 + 2t, 9 + 2t its high half, so that
// the result's two low words are the fifth bits of lo's and hi's 64 weights, bit k for byte k.
template <typename B>
struct GroupIndex {
  __m512i nibbles, fifths = _mm512_setzero_si512(), scales, minima;
  static constexpr int SIZE = static_cast<int>(sizeof(B)), SECOND = 4 * SIZE - 64;
  static uint8_t source(int at) { return static_cast<uint8_t>(at < 64 ? at : 64 + at - SECOND); }
  GroupIndex() : scales(f16_index(SIZE, 0, source)),
                 minima(HAS_MIN<B> ? f16_index(SIZE, 2, source) : _mm512_setzero_si512()) {
    alignas(64) uint8_t bytes[64] = {};
    for (int t = 0; t < 4; ++t)
      for (int j = 0; j < 16; ++j) bytes[16 * t + j] = source(t * SIZE + QS<B> + j);
    nibbles = _mm512_load_si512(bytes);
    if constexpr (FIVE_BITS<B>) {
      for (int t = 0; t < 4; ++t)
        for (int j = 0; j < 2; ++j) {
          const int qh = t * SIZE + offsetof(B, qh);
#ifdef __AVX512BITALG__
          for (int q = 2 * t; q < 2 * t + 2; ++q) {
            bytes[8 * q + j] = source(qh + j);
            bytes[8 * q + 2 + j] = source(qh + 2 + j);
          }
#else
          bytes[2 * t + j] = source(qh + j);
          bytes[8 + 2 * t + j] = source(qh + 2 + j);
#endif
        }
      fifths = _mm512_load_si512(bytes);
    }
  }
};

// The 64 bytes from p, those past the first n read as zero (and not read: a masked load).
inline __m512i first_bytes(const uint8_t* p, int64_t n) {
  if (n >= 64) return _mm512_loadu_si512(p);
  return _mm512_maskz_loadu_epi8(n > 0 ? (uint64_t{1} << n) - 1 : 0, p);
}

// 16 lanes of f16 values gathered by vpermt2b, widened.
inline __m512 widen_f16(__m512i a, __m512i index, __m512i b) {
  return _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutex2var_epi8(a, index, b)));
}

// A 4-bit or 5-bit group as lo and hi, its scales d and minima m over their lanes: blocks < 4 only
// at a row's end, whose missing blocks read as zero bytes (their x is zero too).
template <typename B>
inline void unpack(const B* p, int blocks, __m512i& lo, __m512i& hi, __m512& d, __m512& m, const GroupIndex<B>& index) {
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(p);
  const int64_t n = blocks * static_cast<int64_t>(sizeof(B));
  const __m512i a = first_bytes(bytes, n), b = first_bytes(bytes + GroupIndex<B>::SECOND, n - GroupIndex<B>::SECOND);
  const __m512i raw = _mm512_permutex2var_epi8(a, index.nibbles, b);
  d = widen_f16(a, index.scales, b);
  if constexpr (HAS_MIN<B>) m = widen_f16(a, index.minima, b);
  uint64_t below = 0, above = 0;  // q5_0's and q5_1's fifth bits of lo's and hi's bytes
  if constexpr (FIVE_BITS<B>) {
#ifdef __AVX512BITALG__  // 7% faster a q5_0 row on Zen 4 than through general registers
    // Byte k of lo's lane t takes bit k of block t's qh, of hi's bit 16 + k.
    const __m512i fifths = _mm512_permutex2var_epi8(a, index.fifths, b);
    const __m512i k = _mm512_set1_epi64(0x0706050403020100);
    const __m512i bit = _mm512_mask_add_epi8(k, 0xFF00FF00FF00FF00, k, _mm512_set1_epi8(8));
    below = _mm512_bitshuffle_epi64_mask(fifths, bit);
    above = _mm512_bitshuffle_epi64_mask(fifths, _mm512_add_epi8(bit, _mm512_set1_epi8(16)));
#else
    const __m128i fifths = _mm512_castsi512_si128(_mm512_permutex2var_epi8(a, index.fifths, b));
    below = static_cast<uint64_t>(_mm_cvtsi128_si64(fifths));
    above = static_cast<uint64_t>(_mm_extract_epi64(fifths, 1));
#endif
  }
  const __m512i lo4 = _mm512_set1_epi8(0x0F);
  lo = _mm512_and_si512(raw, lo4);
  hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), lo4);
  if constexpr (FIVE_BITS<B>) {
    const __m512i sixteen = _mm512_set1_epi8(16);
    lo = _mm512_mask_add_epi8(lo, below, lo, sixteen);
    hi = _mm512_mask_add_epi8(hi, above, hi, sixteen);
  }
}

// q8_0's group spans 136 bytes, more than two registers: lo's bytes come from [0, 128), hi's from
// [8, 136), each byte q + 128; the scales from [0, 128).
template <>
struct GroupIndex<BlockQ8_0> {
  __m512i first, second, scales;
  GroupIndex() : scales(f16_index(sizeof(BlockQ8_0), 0, [](int at) { return static_cast<uint8_t>(at); })) {
    alignas(64) uint8_t lo[64], hi[64];
    for (int t = 0; t < 4; ++t)
      for (int j = 0; j < 16; ++j) {
        lo[16 * t + j] = static_cast<uint8_t>(t * sizeof(BlockQ8_0) + QS<BlockQ8_0> + j);
        const int at = t * static_cast<int>(sizeof(BlockQ8_0)) + QS<BlockQ8_0> + 16 + j;
        hi[16 * t + j] = static_cast<uint8_t>(at < 72 ? at - 8 : 64 + at - 72);
      }
    first = _mm512_load_si512(lo);
    second = _mm512_load_si512(hi);
  }
};

template <>
inline void unpack(const BlockQ8_0* p, int blocks, __m512i& lo, __m512i& hi, __m512& d, __m512&,
                   const GroupIndex<BlockQ8_0>& index) {
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(p);
  const int64_t n = blocks * static_cast<int64_t>(sizeof(BlockQ8_0));
  const __m512i a = first_bytes(bytes, n), b = first_bytes(bytes + 64, n - 64);
  lo = _mm512_permutex2var_epi8(a, index.first, b);
  hi = _mm512_permutex2var_epi8(first_bytes(bytes + 8, n - 8), index.second, first_bytes(bytes + 72, n - 72));
  d = widen_f16(a, index.scales, b);
  const __m512i bias = _mm512_set1_epi8(-128);
  lo = _mm512_xor_si512(lo, bias);
  hi = _mm512_xor_si512(hi, bias);
}

// What B's product takes from x besides q_x and d_x (RowSums).
template <typename B>
constexpr RowSums ROW_SUMS{false, OFFSET<B>, HAS_MIN<B>};

// Each accumulator's lanes summed, plus bias[i]: out[j * ldo + i] for channel i, row j.
template <int R, int M>
inline void store_sums(const __m512 (&acc)[R][M], const float* bias, float* out, int64_t ldo) {
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < M; ++j) out[j * ldo + i] = epilogue(_mm512_reduce_add_ps(acc[i][j]), nullptr, bias, i);
}

// out[j, i] = sum over blocks of row i of w against quantized row j, for R channels and M rows.
template <int R, int M, typename B>
void qblock(const B* w, int64_t ldw, const QuantizedRows& x, int64_t j0, const float* bias, float* out, int64_t ldo) {
  __m512 acc[R][M] = {};
  static const GroupIndex<B> index;
  const int8_t* q_rows[M];
  const float *dx_rows[M], *sum_rows[M];
  const int32_t* offset_rows[M];
  for (int j = 0; j < M; ++j) {
    q_rows[j] = x.q_row(j0 + j);
    dx_rows[j] = x.dx + (j0 + j) * x.groups * 4 * LANES;
    offset_rows[j] = OFFSET<B> ? x.offsets + (j0 + j) * x.groups * 16 : nullptr;
    sum_rows[j] = HAS_MIN<B> ? x.lane_sums + (j0 + j) * x.groups * 16 : nullptr;
  }
  // One group of 4 blocks of channel i (the row's last may have fewer) against every row. Each
  // channel's row is read whole before the next's, so that the weights stream in address order,
  // which the hardware prefetchers follow; the loop over rows unrolls, so that the accumulators
  // stay in registers, and the channels' independent sums overlap in the core.
  const auto group = [&](int i, int64_t b, int blocks) __attribute__((always_inline)) {
    prefetch_lines(w + (i + PREFETCH * R) * ldw + b, 4 * static_cast<int>(sizeof(B)));  // the group, PREFETCH tiles ahead
    __m512i lo, hi;
    __m512 d, m;
    unpack(w + i * ldw + b, blocks, lo, hi, d, m, index);
#pragma GCC unroll 8
    for (int j = 0; j < M; ++j) {
      const int8_t* q = q_rows[j] + b * QK;
      // The offset's share, -offset sum q_x per lane, starts the lane's integer sum.
      const __m512i start = OFFSET<B> ? _mm512_loadu_si512(offset_rows[j] + b / 4 * 16) : _mm512_setzero_si512();
      const __m512i s = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(start, lo, _mm512_loadu_si512(q)), hi, _mm512_loadu_si512(q + 64));
      const __m512 dx = _mm512_loadu_ps(dx_rows[j] + b * LANES);
      acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, dx), acc[i][j]);
      if constexpr (HAS_MIN<B>) acc[i][j] = _mm512_fmadd_ps(m, _mm512_loadu_ps(sum_rows[j] + b / 4 * 16), acc[i][j]);
    }
  };
  const int64_t whole = ldw / 4 * 4;
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    for (int64_t b = 0; b < whole; b += 4) group(i, b, 4);
    if (whole < ldw) group(i, whole, static_cast<int>(ldw - whole));
  }
  store_sums(acc, bias, out, ldo);
}

// A group of one channel unpacked as qblock's group(...) unpacks it: its weights' two halves, the
// scales (and minima) over their lanes.
struct StagedGroup {
  __m512i lo, hi;
  __m512 d, m;
};

// Channels a prompt chunk's product stages at a time (q8_prompt).
constexpr int STAGED = 6;

// The first r channels of w unpacked once, group by group: staged[g * STAGED + i] is channel i's group g.
template <typename B>
void stage(const B* w, int64_t ldw, int r, StagedGroup* staged) {
  static const GroupIndex<B> index;
  for (int i = 0; i < r; ++i)
    for (int64_t b = 0; b < ldw; b += 4) {
      StagedGroup& g = staged[b / 4 * STAGED + i];
      unpack(w + i * ldw + b, static_cast<int>(std::min<int64_t>(4, ldw - b)), g.lo, g.hi, g.d, g.m, index);
    }
}

// qblock's outputs for many rows (a prompt chunk) from staged groups: R channels x M rows of
// accumulators, each row's quantized x read once for R channels and each staged group (from L1)
// by M rows. Every output is qblock's sum in qblock's order. staged: the tile's first channel (a
// lone tail channel's qtile<1> reads one of a tile's STAGED).
template <int R, int M, typename B>
void qtile(const StagedGroup* staged, int64_t groups, const QuantizedRows& x, int64_t j0, const float* bias, float* out,
           int64_t ldo) {
  __m512 acc[R][M] = {};
  for (int64_t g = 0; g < groups; ++g) {
    const StagedGroup* w = staged + g * STAGED;
#pragma GCC unroll 8
    for (int j = 0; j < M; ++j) {
      const int64_t row = j0 + j;
      const int8_t* q = x.q_row(row) + g * 128;
      const __m512i q0 = _mm512_loadu_si512(q), q1 = _mm512_loadu_si512(q + 64);
      const __m512i start =
          OFFSET<B> ? _mm512_loadu_si512(x.offsets + (row * x.groups + g) * 16) : _mm512_setzero_si512();
      const __m512 dx = _mm512_loadu_ps(x.dx + (row * x.groups + g) * 4 * LANES);
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        const __m512i s = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(start, w[i].lo, q0), w[i].hi, q1);
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(w[i].d, dx), acc[i][j]);
        if constexpr (HAS_MIN<B>)
          acc[i][j] = _mm512_fmadd_ps(w[i].m, _mm512_loadu_ps(x.lane_sums + (row * x.groups + g) * 16), acc[i][j]);
      }
    }
  }
  store_sums(acc, bias, out, ldo);
}

// A prompt chunk's product: each thread stages its tiles of STAGED channels one at a time and runs
// every row of x against the staged tile, 3 rows at a time.
template <typename B>
void q8_prompt(const B* w, int64_t ldw, const QuantizedRows& q, int64_t M, int64_t N, const float* bias, float* out,
               int64_t ldo) {
  constexpr int R = STAGED;
  const int64_t groups = (ldw + 3) / 4, channel_tiles = (N + R - 1) / R;
  at::parallel_for(0, channel_tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<StagedGroup> staged(groups * R);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * R;
      const int r = static_cast<int>(std::min<int64_t>(R, N - n0));
      stage(w + n0 * ldw, ldw, r, staged.data());
      for (int64_t m0 = 0; m0 < M; m0 += 3) {
        with_rows<3>(std::min<int64_t>(3, M - m0), [&](auto rows) {
          constexpr int m = decltype(rows)::value;
          if (r == R)
            return qtile<R, m, B>(staged.data(), groups, q, m0, offset_by(bias, n0), out + m0 * ldo + n0, ldo);
          for (int i = 0; i < r; ++i)
            qtile<1, m, B>(staged.data() + i, groups, q, m0, offset_by(bias, n0 + i), out + m0 * ldo + n0 + i, ldo);
        });
      }
    }
  });
}

#endif

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

// AVX2 (16 vector registers of 8 lanes): the same products, 8 lanes at a time. The tiles are
// narrower (run() below) so that accumulators, x and a weight vector fit the registers.

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 load8(const at::BFloat16* p) {
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}

template <int R, int M, typename W, std::enable_if_t<!is_block<W>, int> = 0>
void block(const W* w, int64_t ldw, const float* x, int64_t K, const float*, const float* scale, const float* bias,
           float* out, int64_t ldo) {
  __m256 acc[R][M];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < M; ++j) acc[i][j] = _mm256_setzero_ps();
  const auto step = [&](int64_t k) {
    __m256 xv[M];
    for (int j = 0; j < M; ++j) xv[j] = _mm256_loadu_ps(x + j * K + k);
    for (int i = 0; i < R; ++i) {
      const __m256 wv = load8(w + i * ldw + k);
      for (int j = 0; j < M; ++j) acc[i][j] = _mm256_fmadd_ps(wv, xv[j], acc[i][j]);
    }
  };
  constexpr int64_t V = 64 / (8 * sizeof(W));  // vectors per 64-byte line of a weight row
  int64_t k = 0;
  for (; k + 8 * V <= K; k += 8 * V) {
    for (int i = 0; i < R; ++i) _mm_prefetch(reinterpret_cast<const char*>(w + (i + PREFETCH * R) * ldw + k), _MM_HINT_T0);
    for (int v = 0; v < V; ++v) step(k + 8 * v);
  }
  for (; k + 8 <= K; k += 8) step(k);
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < M; ++j) {
      float s = hsum(acc[i][j]);
      for (int64_t t = k; t < K; ++t) s += widen(w[i * ldw + t]) * x[j * K + t];
      out[j * ldo + i] = epilogue(s, scale, bias, i);
    }
}

// A block's 32 weights as four vectors of 8, rounded as widen() above rounds them (d * q, then + m).
inline __m256 ints(__m128i bytes8, bool is_signed) {
  return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(bytes8) : _mm256_cvtepu8_epi32(bytes8));
}
inline void widen8(const BlockQ8_0& b, __m256 w[4]) {
  const __m256 d = _mm256_set1_ps(half(b.d));
  for (int t = 0; t < 4; ++t)
    w[t] = _mm256_mul_ps(d, ints(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b.qs + 8 * t)), true));
}
// Weights 0..15 are the low nibbles of the 16 bytes, 16..31 the high ones.
template <typename B>
inline void nibbles(const B& b, int offset, __m256 w[4], __m256 d) {
  const __m128i lo4 = _mm_set1_epi8(0x0F), centre = _mm_set1_epi8(static_cast<char>(offset));
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs));
  const __m128i lo = _mm_sub_epi8(_mm_and_si128(q, lo4), centre);
  const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), lo4), centre);
  w[0] = _mm256_mul_ps(d, ints(lo, true));
  w[1] = _mm256_mul_ps(d, ints(_mm_srli_si128(lo, 8), true));
  w[2] = _mm256_mul_ps(d, ints(hi, true));
  w[3] = _mm256_mul_ps(d, ints(_mm_srli_si128(hi, 8), true));
}
inline void widen8(const BlockQ4_0& b, __m256 w[4]) { nibbles(b, 8, w, _mm256_set1_ps(half(b.d))); }
inline void widen8(const BlockQ5_0& b, __m256 w[4]) {
  const __m256i q = centred_q5(b);
  const __m128i a = _mm256_castsi256_si128(q), c = _mm256_extracti128_si256(q, 1);
  const __m256 d = _mm256_set1_ps(half(b.d));
  w[0] = _mm256_mul_ps(d, ints(a, true));
  w[1] = _mm256_mul_ps(d, ints(_mm_srli_si128(a, 8), true));
  w[2] = _mm256_mul_ps(d, ints(c, true));
  w[3] = _mm256_mul_ps(d, ints(_mm_srli_si128(c, 8), true));
}
inline void widen8(const BlockQ5_1& b, __m256 w[4]) {
  const __m256i q = bytes_q5(b);
  const __m128i a = _mm256_castsi256_si128(q), c = _mm256_extracti128_si256(q, 1);
  const __m256 d = _mm256_set1_ps(half(b.d)), m = _mm256_set1_ps(half(b.m));
  w[0] = _mm256_add_ps(_mm256_mul_ps(d, ints(a, false)), m);
  w[1] = _mm256_add_ps(_mm256_mul_ps(d, ints(_mm_srli_si128(a, 8), false)), m);
  w[2] = _mm256_add_ps(_mm256_mul_ps(d, ints(c, false)), m);
  w[3] = _mm256_add_ps(_mm256_mul_ps(d, ints(_mm_srli_si128(c, 8), false)), m);
}
inline void widen8(const BlockQ4_1& b, __m256 w[4]) {
  nibbles(b, 0, w, _mm256_set1_ps(half(b.d)));
  const __m256 m = _mm256_set1_ps(half(b.m));
  for (int t = 0; t < 4; ++t) w[t] = _mm256_add_ps(w[t], m);
}

template <int R, int M, typename B, std::enable_if_t<is_block<B>, int> = 0>
void block(const B* w, int64_t ldw, const float* x, int64_t K, const float*, const float* scale, const float* bias,
           float* out, int64_t ldo) {
  __m256 acc[R][M];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < M; ++j) acc[i][j] = _mm256_setzero_ps();
  constexpr int LINE_BLOCKS = 64 / sizeof(B) >= 2 ? 2 : 1;
  for (int64_t b = 0; b < ldw; ++b) {
    for (int i = 0; i < R; ++i) {
      if (b % LINE_BLOCKS == 0)
        _mm_prefetch(reinterpret_cast<const char*>(w + (i + PREFETCH * R) * ldw + b), _MM_HINT_T0);
      __m256 wv[4];
      widen8(w[i * ldw + b], wv);
      for (int j = 0; j < M; ++j) {
        const float* xb = x + j * K + b * QK;
        acc[i][j] = _mm256_fmadd_ps(wv[0], _mm256_loadu_ps(xb), acc[i][j]);
        acc[i][j] = _mm256_fmadd_ps(wv[1], _mm256_loadu_ps(xb + 8), acc[i][j]);
        acc[i][j] = _mm256_fmadd_ps(wv[2], _mm256_loadu_ps(xb + 16), acc[i][j]);
        acc[i][j] = _mm256_fmadd_ps(wv[3], _mm256_loadu_ps(xb + 24), acc[i][j]);
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < M; ++j) out[j * ldo + i] = epilogue(hsum(acc[i][j]), scale, bias, i);
}

// ---- 8-bit activations on AVX2 (docs/architecture.md, "Weight formats": "8-bit activations") ----
//
// x quantized per block of 32 as the AVX-512 path quantizes it (the same q_x and f16-rounded d_x),
// and each block's product an exact integer dot product: vpmaddubsw multiplies 32 u8 by 32 s8 into
// 16 pairwise sums, vpmaddwd adds those into 8 int32 lanes. Its first operand is unsigned, so a
// format of signed weights (q4_0, q5_0, q8_0: q - offset) gives it |w| and moves w's sign onto
// q_x (llama.cpp's way: a pair is then at most 2 x 128 x 127, no int16 saturation), and a format
// of d u + m gives it u (at most 31) and adds m d_x sum q_x apart. The f32 path widens, converts
// and multiplies each weight instead: on Zen 3 a decode row of a cold q8_0 matrix streamed at
// 12-15 GB/s that way, its compute the bound. Each output is the same sum in the same order
// whatever rows and channels share its tile, so a verify row equals the decode row it stands for.
#define TANDEM_Q8_AVX2 1

// M rows of x as 8-bit blocks: q [M, nb * 32] int8, dx [M, nb] the f16-rounded d_x, sx [M, nb]
// d_x sum q_x (for the formats with a minimum).
struct Q8Blocks {
  const int8_t* q;
  const float* dx;
  const float* sx;
};

inline Q8Blocks quantize_blocks(const float* x, int64_t M, int64_t nb) {
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> dx, sx;
  q.resize(M * nb * QK);
  dx.resize(M * nb);
  sx.resize(M * nb);
  int8_t* qp = q.data();  // the buffers are this thread's: the workers write through pointers
  float *dp = dx.data(), *sp = sx.data();
  at::parallel_for(0, M, std::max<int64_t>(1, 4096 / (nb * QK)), [&](int64_t begin, int64_t end) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
    for (int64_t r = begin * nb; r < end * nb; ++r) {
      const float* xb = x + r * QK;
      __m256 v[4];
      __m256 top = _mm256_setzero_ps();
      for (int t = 0; t < 4; ++t) top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[t] = _mm256_loadu_ps(xb + 8 * t)));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
      const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
      __m256i n[4];
      for (int t = 0; t < 4; ++t) n[t] = _mm256_cvtps_epi32(_mm256_mul_ps(v[t], _mm256_set1_ps(id)));
      const __m256i total = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qp + r * QK), _mm256_permutevar8x32_epi32(bytes, order));
      __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
      t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, _MM_SHUFFLE(1, 0, 3, 2)));
      t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, _MM_SHUFFLE(2, 3, 0, 1)));
      dp[r] = _cvtsh_ss(_cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT));
      sp[r] = dp[r] * static_cast<float>(_mm_cvtsi128_si32(t4));
    }
  });
  return {qp, dp, sp};
}

// A block's 32 weights as bytes in weight order: q - offset, signed, or (q4_1, q5_1) q, unsigned.
inline __m256i weight_bytes(const BlockQ8_0& b) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs)); }
inline __m256i weight_bytes(const BlockQ4_0& b) { return _mm256_sub_epi8(nibble_bytes(b.qs), _mm256_set1_epi8(8)); }
inline __m256i weight_bytes(const BlockQ4_1& b) { return nibble_bytes(b.qs); }
inline __m256i weight_bytes(const BlockQ5_0& b) { return centred_q5(b); }
inline __m256i weight_bytes(const BlockQ5_1& b) { return bytes_q5(b); }

// out[j, i] = the product of w's channel i with quantized row j0 + j, for R channels and M rows.
// Each channel's row is read whole before the next's, so that the weights stream in address order
// (the blocks of 4 channels interleaved streamed a cold q8_0 decode row at 11 GB/s on Zen 3, this
// way 17).
template <int R, int M, typename B>
void q8_block(const B* w, int64_t ldw, const Q8Blocks& x, int64_t j0, const float* bias, float* out, int64_t ldo) {
  __m256 acc[R][M];
  float minima[R][M] = {};
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < M; ++j) acc[i][j] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  constexpr int LINE_BLOCKS = 64 / sizeof(B) >= 2 ? 2 : 1;
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    for (int64_t b = 0; b < ldw; ++b) {
      if (b % LINE_BLOCKS == 0)
        _mm_prefetch(reinterpret_cast<const char*>(w + (i + PREFETCH * R) * ldw + b), _MM_HINT_T0);
      const B& block = w[i * ldw + b];
      const __m256i wb = weight_bytes(block);
      const __m256i u = HAS_MIN<B> ? wb : _mm256_sign_epi8(wb, wb);
      const float d = half(block.d);
      for (int j = 0; j < M; ++j) {
        const int64_t at = (j0 + j) * ldw + b;
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + at * QK));
        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(u, HAS_MIN<B> ? q : _mm256_sign_epi8(q, wb)), ones);
        acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * x.dx[at]), acc[i][j]);
        // One rounding, whatever the tile: the compiler may not fuse a * b + c in one tile and not another.
        if constexpr (HAS_MIN<B>) minima[i][j] = std::fma(half(block.m), x.sx[at], minima[i][j]);
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < M; ++j) out[j * ldo + i] = epilogue(hsum(acc[i][j]) + minima[i][j], nullptr, bias, i);
}

template <typename B>
void q8_run(const B* w, int64_t ldw, const float* x, int64_t M, int64_t N, int64_t K, const float* bias, float* out,
            int64_t ldo) {
  const Q8Blocks q = quantize_blocks(x, M, ldw);
  const auto run = [&](auto nr, auto mr) {
    constexpr int64_t MR = decltype(mr)::value;
    tiles<decltype(nr)::value, MR>(M, N, K, [&](auto r, int64_t n0, int64_t m0, int64_t m) {
      with_rows<MR>(m, [&](auto rows) {
        q8_block<decltype(r)::value, decltype(rows)::value>(w + n0 * ldw, ldw, q, m0, offset_by(bias, n0),
                                                             out + m0 * ldo + n0, ldo);
      });
    });
  };
  // 16 registers, as the f32 path's tiles: 4 channels x 1-2 rows, 2 x 3-4, 1 x 8.
  if (M <= 2) return run(std::integral_constant<int, 4>{}, std::integral_constant<int64_t, 2>{});
  if (M <= 4) return run(std::integral_constant<int, 2>{}, std::integral_constant<int64_t, 4>{});
  run(std::integral_constant<int, 1>{}, std::integral_constant<int64_t, 8>{});
}

#else

// Portable fallback, same contract: correct everywhere, fast where the compiler vectorizes it.
template <int R, int M, typename W, std::enable_if_t<!is_block<W>, int> = 0>
void block(const W* w, int64_t ldw, const float* x, int64_t K, const float*, const float* scale, const float* bias,
           float* out, int64_t ldo) {
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < M; ++j) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += widen(w[i * ldw + k]) * x[j * K + k];
      out[j * ldo + i] = epilogue(s, scale, bias, i);
    }
}

template <int R, int M, typename B, std::enable_if_t<is_block<B>, int> = 0>
void block(const B* w, int64_t ldw, const float* x, int64_t K, const float*, const float* scale, const float* bias,
           float* out, int64_t ldo) {
  float s[R][M] = {};
  float wb[QK];
  for (int64_t b = 0; b < ldw; ++b)
    for (int i = 0; i < R; ++i) {
      widen(w[i * ldw + b], wb);
      for (int j = 0; j < M; ++j)
        for (int k = 0; k < QK; ++k) s[i][j] += wb[k] * x[j * K + b * QK + k];
    }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < M; ++j) out[j * ldo + i] = epilogue(s[i][j], scale, bias, i);
}

#endif

// The f32-activation product over NR x MR tiles; ldw: a weight row's length in W (K, or K / 32 blocks).
template <int NR, int64_t MR, typename W>
void f32_tiles(const W* w, int64_t ldw, const float* x, int64_t M, int64_t N, int64_t K, const float* sums,
               const float* scale, const float* bias, float* out, int64_t ldo) {
  tiles<NR, MR>(M, N, K, [&](auto r, int64_t n0, int64_t m0, int64_t m) {
    with_rows<MR>(m, [&](auto rows) {
      block<decltype(r)::value, decltype(rows)::value>(w + n0 * ldw, ldw, x + m0 * K, K, offset_by(sums, m0 * ldw),
                                                        offset_by(scale, n0), offset_by(bias, n0), out + m0 * ldo + n0, ldo);
    });
  });
}

template <typename W>
void run(const W* w, int64_t ldw, const float* x, int64_t M, int64_t N, int64_t K, const float* scale,
         const float* bias, float* out, int64_t ldo) {
  // q4_1's and q5_1's block() want each row's sum over each block of x [M, ldw]: computed once here, where
  // every tile of output channels would otherwise recompute it. The buffer outlives the call, so a
  // decode step allocates nothing.
  const float* sp = nullptr;
#ifdef __AVX512F__  // the portable block() adds m to each weight instead
  thread_local std::vector<float> sums;
  if constexpr (HAS_MIN<W>) {
    sums.resize(M * ldw);
    for (int64_t r = 0; r < M * ldw; ++r) {
      float t = 0.f;
      for (int k = 0; k < QK; ++k) t += x[r * QK + k];
      sums[r] = t;
    }
    sp = sums.data();
  }
#endif
#if !defined(__AVX512F__) && defined(__AVX2__)
  // 16 registers: 4 channels x 1-2 rows, or 2 channels x 3-4 rows, or 1 channel x 8 rows of accumulators.
  if (M <= 2) return f32_tiles<4, 2>(w, ldw, x, M, N, K, sp, scale, bias, out, ldo);
  if (M <= 4) return f32_tiles<2, 4>(w, ldw, x, M, N, K, sp, scale, bias, out, ldo);
  return f32_tiles<1, 8>(w, ldw, x, M, N, K, sp, scale, bias, out, ldo);
#endif
  with_tile(M, [&](auto nr, auto mr) {
    f32_tiles<decltype(nr)::value, decltype(mr)::value>(w, ldw, x, M, N, K, sp, scale, bias, out, ldo);
  });
}

#ifdef TANDEM_Q8_ACTIVATIONS
// The product with x quantized to 8 bits (qblock), in the f32 path's tiles; from 16 rows (a prompt
// chunk) q8_prompt's, whose groups are unpacked once per call rather than once per tile of rows: on
// Zen 4 1.5-1.8x qblock's 2 x 8 at 64-512 rows, 1.4x at 16. Below, the weights' stream is the bound,
// which qblock's channel-major order and prefetch keep up with.
template <typename B>
void q8_run(const B* w, int64_t ldw, const float* x, int64_t M, int64_t N, int64_t K, const float* bias, float* out,
            int64_t ldo) {
  const QuantizedRows q = quantize_rows(x, M, ldw, ROW_SUMS<B>);
  if (M >= 16) return q8_prompt(w, ldw, q, M, N, bias, out, ldo);
  with_tile(M, [&](auto nr, auto mr) {
    constexpr int64_t MR = decltype(mr)::value;
    tiles<decltype(nr)::value, MR>(M, N, K, [&](auto r, int64_t n0, int64_t m0, int64_t m) {
      with_rows<MR>(m, [&](auto rows) {
        qblock<decltype(r)::value, decltype(rows)::value>(w + n0 * ldw, ldw, q, m0, offset_by(bias, n0), out + m0 * ldo + n0, ldo);
      });
    });
  });
}
#endif

// The bytes per block of a uint8 weight [N, K / 32 * bytes] read against K input features: the
// row length tells the format apart (18 Q4_0, 20 Q4_1, 22 Q5_0, 24 Q5_1, 34 Q8_0), see engine/ops/kernels.py.
int64_t block_bytes(const at::Tensor& weight, int64_t K, const char* op) {
  const int64_t row = weight.size(1);
  bool known = false;
  for (const int64_t bytes : {sizeof(BlockQ4_0), sizeof(BlockQ4_1), sizeof(BlockQ5_0), sizeof(BlockQ5_1), sizeof(BlockQ8_0)})
    known = known || row == K / QK * bytes;
  TORCH_CHECK(K % QK == 0 && known, op, ": a uint8 weight holds rows of 32-weight blocks (18, 20, 22, 24 or 34 bytes "
              "each) for K a multiple of 32; got rows of ", row, " bytes for K = ", K);
  return row / (K / QK);
}

// f(w as the block type whose size is `bytes`, one of block_bytes' answers).
template <typename F>
void with_blocks(int64_t bytes, const uint8_t* w, F&& f) {
  switch (bytes) {
    case sizeof(BlockQ4_0): return f(reinterpret_cast<const BlockQ4_0*>(w));
    case sizeof(BlockQ4_1): return f(reinterpret_cast<const BlockQ4_1*>(w));
    case sizeof(BlockQ5_0): return f(reinterpret_cast<const BlockQ5_0*>(w));
    case sizeof(BlockQ5_1): return f(reinterpret_cast<const BlockQ5_1*>(w));
    default: return f(reinterpret_cast<const BlockQ8_0*>(w));
  }
}

template <typename B>
void dequantize_rows(const B* w, int64_t N, int64_t nb, float* out) {
  at::parallel_for(0, N, std::max<int64_t>(1, 4096 / nb), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin * nb; i < end * nb; ++i) {
#ifdef __AVX512F__
      __m512 w0, w1;
      widen(w[i], half(w[i].d), min_of(w[i]), w0, w1);
      _mm512_storeu_ps(out + i * QK, w0);
      _mm512_storeu_ps(out + i * QK + 16, w1);
#else
      widen(w[i], out + i * QK);
#endif
    }
  });
}

}  // namespace

namespace tandem {

bool q8_super_blocks_supported() {
#ifdef TANDEM_Q8_ACTIVATIONS
  return true;
#else
  return false;
#endif
}

bool q8_activations_supported() {
#if defined(TANDEM_Q8_ACTIVATIONS) || defined(TANDEM_Q8_AVX2)
  return true;
#else
  return false;
#endif
}

// x's product with one block weight, uint8 [n, K / 32 * B] or [n, K / 256, B], into the first n
// columns of out (rows ldo apart).
void block_rows(const float* xp, int64_t M, int64_t K, const at::Tensor& weight, const float* bias, float* out,
                int64_t ldo, bool q8_activations) {
  if (weight.dim() == 3) return super_block_rows(xp, M, K, weight, bias, out, ldo, q8_activations);
  const int64_t nb = K / QK, n = weight.size(0);
  with_blocks(block_bytes(weight, K, "linear_rows"), weight.data_ptr<uint8_t>(), [&](auto w) {
#if defined(TANDEM_Q8_ACTIVATIONS) || defined(TANDEM_Q8_AVX2)
    if (q8_activations) return q8_run(w, nb, xp, M, n, K, bias, out, ldo);
#endif
    run(w, nb, xp, M, n, K, nullptr, bias, out, ldo);
  });
}

// A stacked weight's parts as the block weights they are: bytes, uint8 [total], holds each part's
// rows in turn; layout, int64 [P, 2], each part's rows and bytes per block (which name its format:
// 18, 20, 22, 24, 34 per 32 weights, 144, 176, 210 per 256).
std::vector<at::Tensor> stacked_parts(const at::Tensor& bytes, const at::Tensor& layout, int64_t K) {
  TORCH_CHECK(bytes.dim() == 1 && bytes.is_contiguous() && layout.scalar_type() == at::kLong && layout.dim() == 2 &&
                  layout.size(1) == 2,
              "linear_rows: a stacked weight is uint8 bytes [total] with its layout int64 [parts, 2] in the scale's "
              "place; got ", bytes.sizes(), " and ", layout.sizes(), " in ", layout.scalar_type());
  const at::Tensor l = layout.contiguous();
  const int64_t* lp = l.data_ptr<int64_t>();
  std::vector<at::Tensor> parts;
  int64_t offset = 0;
  for (int64_t p = 0; p < l.size(0); ++p) {
    const int64_t rows = lp[2 * p], block = lp[2 * p + 1];
    const bool super = block > 2 * static_cast<int64_t>(sizeof(BlockQ8_0));
    const int64_t row_bytes = super ? K / 256 * block : K / QK * block;
    TORCH_CHECK(offset + rows * row_bytes <= bytes.numel(), "linear_rows: a stacked weight's layout reaches past its ",
                bytes.numel(), " bytes at part ", p);
    const at::Tensor part = bytes.narrow(0, offset, rows * row_bytes);
    parts.push_back(super ? part.view({rows, K / 256, block}) : part.view({rows, row_bytes}));
    offset += rows * row_bytes;
  }
  TORCH_CHECK(offset == bytes.numel(), "linear_rows: a stacked weight's layout covers ", offset, " of its ",
              bytes.numel(), " bytes");
  return parts;
}

at::Tensor dequantize_blocks(const at::Tensor& weight, int64_t K, const c10::optional<at::Tensor>& layout) {
  if (layout.has_value()) {
    std::vector<at::Tensor> parts = stacked_parts(weight, *layout, K);
    for (at::Tensor& part : parts) part = dequantize_blocks(part, K, c10::nullopt);
    return at::cat(parts);
  }
  if (weight.dim() == 3) return dequantize_super_blocks(weight, K);
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte && weight.is_contiguous(),
              "dequantize_blocks: a contiguous uint8 weight [N, bytes] expected, got ", weight.sizes(), " in ",
              weight.scalar_type());
  const int64_t N = weight.size(0), nb = K / QK;
  const int64_t bytes = block_bytes(weight, K, "dequantize_blocks");
  at::Tensor out = at::empty({N, K}, weight.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  with_blocks(bytes, weight.data_ptr<uint8_t>(), [&](auto w) { dequantize_rows(w, N, nb, op); });
  return out;
}

at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& scale,
                       const c10::optional<at::Tensor>& bias, bool q8_activations) {
  const bool blocks = weight.scalar_type() == at::kByte;
  const bool stacked = blocks && weight.dim() == 1;
  TORCH_CHECK(x.dim() == 2 && (weight.dim() == 2 || (blocks && weight.dim() <= 3)) && (blocks || x.size(1) == weight.size(1)),
              "linear_rows: x [M, K] and weight [N, K] expected, got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(weight.is_contiguous(), "linear_rows: weight must be contiguous");
  TORCH_CHECK(!stacked || scale.has_value(), "linear_rows: a stacked weight needs its layout in the scale's place");
  TORCH_CHECK(!blocks || !q8_activations || q8_activations_supported(),
              "linear_rows: 8-bit activations need AVX-512 VNNI and VBMI, or AVX2 with FMA and F16C, which this build lacks");
  const int64_t M = x.size(0), K = x.size(1);
  const std::vector<at::Tensor> parts = stacked ? stacked_parts(weight, *scale, K) : std::vector<at::Tensor>{weight};
  int64_t N = 0;
  for (const at::Tensor& part : parts) N += part.size(0);
  const at::Tensor sf = scale.has_value() && !stacked ? scale->to(at::kFloat).contiguous() : at::Tensor();
  const at::Tensor bf = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  TORCH_CHECK((!sf.defined() || sf.numel() == N) && (!bf.defined() || bf.numel() == N),
              "linear_rows: scale and bias need ", N, " values");
  const float* sp = sf.defined() ? sf.data_ptr<float>() : nullptr;
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  at::Tensor out = at::empty({M, N}, xf.options());
  float* op = out.data_ptr<float>();
  switch (weight.scalar_type()) {
    case at::kFloat: run(weight.data_ptr<float>(), K, xp, M, N, K, sp, bp, op, N); break;
    case at::kBFloat16: run(weight.data_ptr<at::BFloat16>(), K, xp, M, N, K, sp, bp, op, N); break;
    case at::kChar: run(weight.data_ptr<int8_t>(), K, xp, M, N, K, sp, bp, op, N); break;
    case at::kByte: {
      int64_t n0 = 0;
      for (const at::Tensor& part : parts) {
        block_rows(xp, M, K, part, offset_by(bp, n0), op + n0, N, q8_activations);
        n0 += part.size(0);
      }
      break;
    }
    default:
      TORCH_CHECK(false, "linear_rows: weight dtype ", weight.scalar_type(), " is not f32, bf16, int8 or uint8 blocks");
  }
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

at::Tensor linear_at(const at::Tensor& x, const c10::List<c10::optional<at::Tensor>>& w, int64_t i, bool q8_activations,
                     const char* op) {
  const c10::optional<at::Tensor> weight = w.get(i);
  TORCH_CHECK(weight.has_value(), op, ": weight ", i, " is missing");
  return linear_rows(x, *weight, w.get(i + 1), w.get(i + 2), q8_activations);
}

}  // namespace tandem

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("linear_rows(Tensor x, Tensor weight, Tensor? scale, Tensor? bias, bool q8_activations=False) -> Tensor");
  m.def("q8_activations_supported() -> bool", &tandem::q8_activations_supported);
  m.def("q8_super_blocks_supported() -> bool", &tandem::q8_super_blocks_supported);
  m.def("dequantize_blocks(Tensor weight, int cols, Tensor? layout=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("linear_rows", tandem::linear_rows);
  m.impl("dequantize_blocks", tandem::dequantize_blocks);
}
