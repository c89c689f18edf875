// tandem::linear_rows: y = x W^T * scale + bias for a few rows of x (decode slots, verify
// tokens), with W in f32, bf16 or int8 (one f32 scale per output channel).
//
// At a few rows a linear layer is a matrix-vector product: every weight is used once per row,
// so its speed is how fast W streams from memory. Weights are widened to f32 in registers as
// they are read (int8 and bf16 convert exactly) and accumulated in f32, four output channels at
// a time against up to four rows of x, so each weight byte is read from memory once per step.
// Activations stay in floating point: only the weights are quantized.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "tandem.h"

#include <cstdint>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t NR = 4;  // output channels per block
constexpr int64_t MR = 4;  // rows of x per block
constexpr int64_t PREFETCH = 2;  // blocks ahead

// scale and bias are null when the layer has none.
inline float epilogue(float v, const float* scale, const float* bias, int i) {
  if (scale) v *= scale[i];
  if (bias) v += bias[i];
  return v;
}

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

// out[j, i] = scale[i] sum_k w[i, k] x[j, k] + bias[i] for i < R output channels, j < M rows of x.
template <int R, int M, typename W>
void block(const W* w, const float* x, int64_t K, const float* scale, const float* bias, float* out, int64_t ldo) {
  __m512 acc[R][M];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < M; ++j) acc[i][j] = _mm512_setzero_ps();
  const auto step = [&](int64_t k, auto load) {
    __m512 xv[M];
    for (int j = 0; j < M; ++j) xv[j] = load(x + j * K + k);
    for (int i = 0; i < R; ++i) {
      const __m512 wv = load(w + i * K + k);
      for (int j = 0; j < M; ++j) acc[i][j] = _mm512_fmadd_ps(wv, xv[j], acc[i][j]);
    }
  };
  // One 64-byte line of each weight row per iteration, and a prefetch PREFETCH blocks ahead:
  // without it a core keeps too few misses in flight to stream int8 or bf16 at memory speed.
  constexpr int64_t V = 64 / (16 * sizeof(W));
  int64_t k = 0;
  for (; k + 16 * V <= K; k += 16 * V) {
    for (int i = 0; i < R; ++i) _mm_prefetch(reinterpret_cast<const char*>(w + (i + PREFETCH * R) * K + k), _MM_HINT_T0);
    for (int v = 0; v < V; ++v) step(k + 16 * v, [](auto p) { return load16(p); });
  }
  for (; k < K; k += 16) {
    const __mmask16 mask = K - k >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (K - k)) - 1);
    step(k, [mask](auto p) { return load16(p, mask); });
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < M; ++j) out[j * ldo + i] = epilogue(_mm512_reduce_add_ps(acc[i][j]), scale, bias, i);
}

#else

inline float widen(float v) { return v; }
inline float widen(int8_t v) { return static_cast<float>(v); }
inline float widen(at::BFloat16 v) { return static_cast<float>(v); }

// Portable fallback, same contract: correct everywhere, fast where the compiler vectorizes it.
template <int R, int M, typename W>
void block(const W* w, const float* x, int64_t K, const float* scale, const float* bias, float* out, int64_t ldo) {
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < M; ++j) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += widen(w[i * K + k]) * x[j * K + k];
      out[j * ldo + i] = epilogue(s, scale, bias, i);
    }
}

#endif

template <int R, typename W>
void rows_block(const W* w, const float* x, int64_t K, int64_t m, const float* scale, const float* bias,
                float* out, int64_t ldo) {
  switch (m) {
    case 1: return block<R, 1>(w, x, K, scale, bias, out, ldo);
    case 2: return block<R, 2>(w, x, K, scale, bias, out, ldo);
    case 3: return block<R, 3>(w, x, K, scale, bias, out, ldo);
    default: return block<R, 4>(w, x, K, scale, bias, out, ldo);
  }
}

inline const float* at(const float* p, int64_t n) { return p ? p + n : nullptr; }

template <typename W>
void run(const W* w, const float* x, int64_t M, int64_t N, int64_t K, const float* scale, const float* bias,
         float* out) {
  const int64_t blocks = (N + NR - 1) / NR;
  // Each thread streams a contiguous run of output channels; small matrices stay on one thread.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / (K * NR));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * NR;
      for (int64_t m0 = 0; m0 < M; m0 += MR) {
        const int64_t m = std::min(MR, M - m0);
        const float* xm = x + m0 * K;
        float* om = out + m0 * N + n0;
        if (n0 + NR <= N) {
          rows_block<NR>(w + n0 * K, xm, K, m, at(scale, n0), at(bias, n0), om, N);
        } else {
          for (int64_t n = n0; n < N; ++n) rows_block<1>(w + n * K, xm, K, m, at(scale, n), at(bias, n), om + (n - n0), N);
        }
      }
    }
  });
}

}  // namespace

namespace tandem {

at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& scale,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "linear_rows: x [M, K] and weight [N, K] expected, got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(weight.is_contiguous(), "linear_rows: weight must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const at::Tensor sf = scale.has_value() ? scale->to(at::kFloat).contiguous() : at::Tensor();
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
    case at::kFloat: run(weight.data_ptr<float>(), xp, M, N, K, sp, bp, op); break;
    case at::kBFloat16: run(weight.data_ptr<at::BFloat16>(), xp, M, N, K, sp, bp, op); break;
    case at::kChar: run(weight.data_ptr<int8_t>(), xp, M, N, K, sp, bp, op); break;
    default: TORCH_CHECK(false, "linear_rows: weight dtype ", weight.scalar_type(), " is not f32, bf16 or int8");
  }
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

}  // namespace tandem

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("linear_rows(Tensor x, Tensor weight, Tensor? scale, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) { m.impl("linear_rows", tandem::linear_rows); }
