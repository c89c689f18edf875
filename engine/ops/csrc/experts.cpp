// tandem::experts_rows: a mixture-of-experts MLP (engine/model/experts.py) over a few token rows
// (decode slots, verify tokens), in one call.
//
// At decode a Qwen4-Exp layer's experts are a few dozen small ops from Python (routing, the rows
// each expert takes, four experts' MLPs, their weighted sum, the shared expert and its gate), each
// a dispatch of several microseconds: at 16 layers about 6 ms of a 41 ms step, as much as the
// experts' weights take to stream. Here the same ops run back to back in C++ in the order
// experts.py runs them (the rows of each touched expert in one product, experts in index order,
// each row's sum started from zero, the shared expert added last), the elementwise ones as loops
// that round as torch's kernels do (elementwise.cpp), so the numbers are the same.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "tandem.h"

namespace {

using Weights = c10::List<c10::optional<at::Tensor>>;

// The weights, (weight, scale, bias) per linear layer: the router, the shared expert's gate, its
// gate_up and down (its MLP), then each routed expert's gate_up and down.
enum Slot { ROUTER = 0, SHARED_GATE = 3, SHARED_MLP = 6, EXPERTS = 12 };
constexpr int64_t PER_EXPERT = 6;

// down(silu(gate(x)) * up(x)), gate and up one projection [gate | up] at slot i, down at i + 3.
at::Tensor mlp(const at::Tensor& x, const Weights& w, int64_t i, bool q8) {
  return tandem::linear_at(tandem::silu_mul(tandem::linear_at(x, w, i, q8, "experts_rows")), w, i + 3, q8,
                           "experts_rows");
}

}  // namespace

namespace tandem {

at::Tensor experts_rows(const at::Tensor& x, const Weights& weights, int64_t top_k, bool norm_top_k, bool q8) {
  TORCH_CHECK(x.dim() == 2, "experts_rows: x [N, hidden] expected, got ", x.sizes());
  const int64_t count = (static_cast<int64_t>(weights.size()) - EXPERTS) / PER_EXPERT, N = x.size(0);
  TORCH_CHECK(count > 0 && static_cast<int64_t>(weights.size()) == EXPERTS + count * PER_EXPERT && top_k > 0 &&
                  top_k <= count,
              "experts_rows: the router's, the shared expert's and ", PER_EXPERT / 3,
              " linear layers per expert expected, and top_k within the experts; got ", weights.size(),
              " weights and top_k ", top_k);
  const at::Tensor probs = at::softmax(tandem::linear_at(x, weights, ROUTER, q8, "experts_rows").to(at::kFloat), -1);
  auto [top, chosen] = at::topk(probs, top_k, -1);
  if (norm_top_k) top = top / top.sum(-1, true);
  // Each expert's rows, ascending, and the weight each row gives it: a stable sort by expert.
  const at::Tensor picked = chosen.contiguous(), shares = top.contiguous();
  const int64_t* cp = picked.data_ptr<int64_t>();
  const float* sp = shares.data_ptr<float>();
  std::vector<std::vector<int64_t>> rows(count);
  std::vector<std::vector<float>> share(count);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < top_k; ++j) {
      const int64_t e = cp[n * top_k + j];
      rows[e].push_back(n);
      share[e].push_back(sp[n * top_k + j]);
    }
  at::Tensor out = at::zeros_like(x);
  for (int64_t e = 0; e < count; ++e) {
    if (rows[e].empty()) continue;
    const int64_t n = static_cast<int64_t>(rows[e].size());
    // A lone row (decode) is x itself, not a gathered copy.
    const at::Tensor taken =
        N == 1 && x.is_contiguous() ? x : x.index_select(0, at::from_blob(rows[e].data(), {n}, at::kLong));
    at::Tensor y = mlp(taken, weights, EXPERTS + e * PER_EXPERT, q8);
    // Each share rounded to x's dtype after the gather, as experts.py rounds before it.
    tandem::scaled_rows_add(out, rows[e].data(), y, share[e].data());
  }
  // The shared expert's rows scaled by their gates, each row added to itself.
  const at::Tensor gates =
      at::sigmoid(tandem::linear_at(x, weights, SHARED_GATE, q8, "experts_rows")).to(at::kFloat).contiguous();
  at::Tensor shared = mlp(x, weights, SHARED_MLP, q8);
  std::vector<int64_t> every(N);
  for (int64_t n = 0; n < N; ++n) every[n] = n;
  tandem::scaled_rows_add(out, every.data(), shared, gates.data_ptr<float>());
  return out;
}

}  // namespace tandem

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("experts_rows(Tensor x, Tensor?[] weights, int top_k, bool norm_top_k, bool q8_activations=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) { m.impl("experts_rows", tandem::experts_rows); }
