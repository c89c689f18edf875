// Dot products of f32 rows 16 lanes wide, as tandem's attention kernels (attention.cpp) and QSA's
// block scores (qsa.cpp) compute them: each product's order of additions fixed, whichever products
// are computed beside it, so that a score is the same number in a decode row and in a verify row.
#pragma once

#ifdef __AVX512F__
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

namespace tandem::dots {

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

// q . key as 16 partial sums, their total the score: q and key are rows of 16 * NC.
template <int NC>
inline __m512 partial_dot(const float* q, const float* key) {
  __m512 d = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(key));
  for (int c = 1; c < NC; ++c) d = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * c), _mm512_loadu_ps(key + 16 * c), d);
  return d;
}

// The row lengths (head dims) the kernels built on these are compiled for, as 16 * NC: f(NC) for
// D's NC; false for others, which take a kernel's portable path.
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

}  // namespace tandem::dots

#endif
