// tandem::gated_delta_rows: a Gated DeltaNet layer's token-by-token part for a few token rows
// (decode slots, verify blocks), from its input projection to the delta rule's output, in one call
// (engine/model/gated_delta.py says what each step computes, as transformers does).
//
// Token n is at position positions[n] of slot slots[n]; the tokens of one slot come in position
// order. Its state before it is the state after position - 1 (zeros at position 0), read from the
// layer's stores, entry (position - 1) % R; the state after it is written at entry position % R.
// So a verify block leaves the state after every position it ran (rolling back is choosing one),
// and with R = 1 the state is updated in place. The stores are f32:
//   conv [S, R, K-1, C]: the convolution's last K-1 inputs of each channel;
//   state [S, R, H, Dk, Dv]: each value head's state.
//
// Per token: the causal depthwise convolution over the channels' last K inputs and SiLU give q, k, v
// (C = 2 Nk Dk + H Dv channels); q and k are L2-normed per key head (and q scaled by Dk^-1/2); value
// head h reads key head k_head[h]; with decay exp(g), g = A softplus(a + dt_bias), and beta =
// sigmoid(b), the state S [Dk, Dv] becomes S' = exp(g) S + k (beta (v - exp(g) S^T k))^T and the
// output is S'^T q. Channels run in parallel for the convolution, value heads (of each slot's run
// of tokens) for the rule, whose state stays in the cache between a run's tokens.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "tandem.h"

namespace {

constexpr float L2_EPS = 1e-6f;  // the reference's l2norm epsilon

float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }  // torch's, threshold 20

// x [D] -> x / sqrt(sum x^2 + eps) * scale, in place.
void l2norm(float* x, int64_t D, float scale) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < D; ++i) ss += x[i] * x[i];
  const float inv = scale / std::sqrt(ss + L2_EPS);
  for (int64_t i = 0; i < D; ++i) x[i] *= inv;
}

}  // namespace

namespace tandem {

at::Tensor gated_delta_rows(const at::Tensor& proj, int64_t key_dim, const at::Tensor& conv_weight,
                            const at::Tensor& A, const at::Tensor& dt_bias, const at::Tensor& k_head,
                            at::Tensor conv_store, at::Tensor state_store, const at::Tensor& slots,
                            const at::Tensor& positions) {
  TORCH_CHECK(proj.dim() == 2 && proj.scalar_type() == at::kFloat, "gated_delta_rows: proj [N, C + Dv H + 2H] f32");
  TORCH_CHECK(conv_store.scalar_type() == at::kFloat && state_store.scalar_type() == at::kFloat &&
                  conv_store.is_contiguous() && state_store.is_contiguous() && conv_store.dim() == 4 &&
                  state_store.dim() == 5,
              "gated_delta_rows: contiguous f32 stores conv [S, R, K-1, C] and state [S, R, H, Dk, Dv] expected");
  const int64_t N = proj.size(0), C = conv_store.size(3), K = conv_weight.size(1), R = conv_store.size(1);
  const int64_t H = state_store.size(2), Dk = state_store.size(3), Dv = state_store.size(4), S = state_store.size(0);
  const int64_t Nk = key_dim / Dk, width = proj.size(1);
  TORCH_CHECK(C == 2 * key_dim + H * Dv && width == C + H * Dv + 2 * H && conv_weight.size(0) == C &&
                  conv_store.size(2) == K - 1 && state_store.size(1) == R && k_head.numel() == H,
              "gated_delta_rows: shapes disagree");
  const at::Tensor p = proj.contiguous(), w = conv_weight.contiguous().to(at::kFloat), a_ = A.contiguous(),
                   dt = dt_bias.contiguous(), kh = k_head.contiguous().to(at::kLong);
  const at::Tensor sl = slots.contiguous().to(at::kLong), pos = positions.contiguous().to(at::kLong);
  const float* x = p.data_ptr<float>();
  const float* wc = w.data_ptr<float>();
  const int64_t* s_of = sl.data_ptr<int64_t>();
  const int64_t* p_of = pos.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n)
    TORCH_CHECK(s_of[n] >= 0 && s_of[n] < S && p_of[n] >= 0, "gated_delta_rows: slot or position out of range");
  float* conv = conv_store.data_ptr<float>();
  float* state = state_store.data_ptr<float>();
  const int64_t tail = (K - 1) * C, cell = H * Dk * Dv;
  auto entry = [&](int64_t n, int64_t offset) { return s_of[n] * R + (p_of[n] + offset) % R; };

  // The convolution, channel by channel, each channel's tokens in order (a token reads the tail its
  // slot's previous token wrote). qkv [N, C] gets the convolved, activated inputs.
  at::Tensor qkv = at::empty({N, C}, p.options());
  float* y = qkv.data_ptr<float>();
  at::parallel_for(0, C, 256, [&](int64_t c0, int64_t c1) {
    std::vector<float> window(K);
    for (int64_t n = 0; n < N; ++n) {
      const float* before = p_of[n] == 0 ? nullptr : conv + entry(n, -1) * tail;
      float* after = conv + entry(n, 0) * tail;
      for (int64_t c = c0; c < c1; ++c) {
        for (int64_t i = 0; i < K - 1; ++i) window[i] = before ? before[i * C + c] : 0.f;
        window[K - 1] = x[n * width + c];
        float acc = 0.f;
        for (int64_t i = 0; i < K; ++i) acc += wc[c * K + i] * window[i];
        y[n * C + c] = acc / (1.f + std::exp(-acc));
        for (int64_t i = 0; i < K - 1; ++i) after[i * C + c] = window[i + 1];
      }
    }
  });
  const float scale = 1.f / std::sqrt(static_cast<float>(Dk));
  at::parallel_for(0, N * Nk, 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t n = i / Nk, j = i % Nk;
      l2norm(y + n * C + j * Dk, Dk, scale);            // q
      l2norm(y + n * C + key_dim + j * Dk, Dk, 1.f);    // k
    }
  });

  // The delta rule, per run of one slot's tokens and value head.
  std::vector<int64_t> runs{0};
  for (int64_t n = 1; n < N; ++n)
    if (s_of[n] != s_of[n - 1] || p_of[n] != p_of[n - 1] + 1) runs.push_back(n);
  runs.push_back(N);
  const int64_t num_runs = static_cast<int64_t>(runs.size()) - 1;
  at::Tensor out = at::empty({N, H, Dv}, p.options());
  float* o = out.data_ptr<float>();
  const float* Av = a_.data_ptr<float>();
  const float* dtv = dt.data_ptr<float>();
  const int64_t* khv = kh.data_ptr<int64_t>();
  at::parallel_for(0, num_runs * H, 1, [&](int64_t b, int64_t e) {
    std::vector<float> kv(Dv), delta(Dv);
    for (int64_t i = b; i < e; ++i) {
      const int64_t r = i / H, h = i % H;
      for (int64_t n = runs[r]; n < runs[r + 1]; ++n) {
        const float* row = x + n * width;
        const float decay = std::exp(Av[h] * softplus(row[C + H * Dv + H + h] + dtv[h]));
        const float beta = 1.f / (1.f + std::exp(-row[C + H * Dv + h]));
        const float* q = y + n * C + khv[h] * Dk;
        const float* k = y + n * C + key_dim + khv[h] * Dk;
        const float* v = y + n * C + 2 * key_dim + h * Dv;
        const float* s_in = p_of[n] == 0 ? nullptr : state + entry(n, -1) * cell + h * Dk * Dv;
        float* s_out = state + entry(n, 0) * cell + h * Dk * Dv;
        for (int64_t c = 0; c < Dv; ++c) kv[c] = 0.f;
        if (s_in)
          for (int64_t d = 0; d < Dk; ++d) {
            const float kd = k[d] * decay;
            const float* srow = s_in + d * Dv;
#pragma omp simd
            for (int64_t c = 0; c < Dv; ++c) kv[c] += kd * srow[c];
          }
        for (int64_t c = 0; c < Dv; ++c) delta[c] = (v[c] - kv[c]) * beta;
        float* on = o + (n * H + h) * Dv;
        for (int64_t c = 0; c < Dv; ++c) on[c] = 0.f;
        for (int64_t d = 0; d < Dk; ++d) {
          const float* srow = s_in ? s_in + d * Dv : nullptr;
          float* orow = s_out + d * Dv;
          const float kd = k[d], qd = q[d];
          if (srow) {
#pragma omp simd
            for (int64_t c = 0; c < Dv; ++c) {
              const float s = srow[c] * decay + kd * delta[c];
              orow[c] = s;
              on[c] += qd * s;
            }
          } else {
#pragma omp simd
            for (int64_t c = 0; c < Dv; ++c) {
              const float s = kd * delta[c];
              orow[c] = s;
              on[c] += qd * s;
            }
          }
        }
      }
    }
  });
  return out;
}

}  // namespace tandem

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("gated_delta_rows(Tensor proj, int key_dim, Tensor conv_weight, Tensor A, Tensor dt_bias, Tensor k_head, "
        "Tensor(a!) conv_store, Tensor(b!) state_store, Tensor slots, Tensor positions) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) { m.impl("gated_delta_rows", tandem::gated_delta_rows); }
