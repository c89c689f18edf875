// tandem::hyper_mix and tandem::hyper_inject: the two halves of a hyper-connection
// (engine/model/hyper_connections.py) over a few token rows, each in one call.
//
// A Qwen4-Exp layer has two hyper-connections and each is about twenty small ops (the streams'
// norms, the low-rank mixing weights, the mean over streams, the injection scales); from Python at
// decode these were about 5 ms of a 37 ms step at 16 layers. Here they run as the same ATen ops, in
// hyper_connections.py's order, without a trip through Python for each: the same numbers.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>

#include "tandem.h"

namespace {

using Weights = c10::List<c10::optional<at::Tensor>>;

// x [N, streams * hidden] -> (the block's input [N, hidden], the normed streams [N, streams * hidden]);
// weights: the down and up maps' (weight, scale, bias).
std::tuple<at::Tensor, at::Tensor> hyper_mix(const at::Tensor& x, const at::Tensor& norm_weight, const Weights& weights,
                                             int64_t streams, double eps, bool q8) {
  TORCH_CHECK(x.dim() == 2 && streams > 0 && x.size(1) % streams == 0 && weights.size() == 6,
              "hyper_mix: x [N, streams * hidden] and the down and up maps' (weight, scale, bias) expected, got ",
              x.sizes(), ", ", streams, " streams and ", weights.size(), " weights");
  const int64_t hidden = x.size(1) / streams;
  const at::Tensor each = at::rms_norm(x.to(at::kFloat).unflatten(-1, {streams, hidden}), {hidden}, c10::nullopt, eps);
  const at::Tensor normed = norm_weight * each.flatten(-2).to(x.scalar_type());
  const at::Tensor down = tandem::linear_at(normed, weights, 0, q8, "hyper_mix");
  const at::Tensor mixing = at::sigmoid(tandem::linear_at(at::silu(down / streams), weights, 3, q8, "hyper_mix"));
  const at::Tensor mixed = (mixing.unflatten(-1, {streams, hidden}) * normed.unflatten(-1, {streams, hidden})).mean(-2);
  return {mixed, normed};
}

// x [N, streams * hidden] with the block's output out [N, hidden] added to each stream s, scaled by
// 2 * sigmoid(inject(normed) / streams)_s; weights: the inject map's (weight, scale, bias).
at::Tensor hyper_inject(const at::Tensor& x, const at::Tensor& normed, const at::Tensor& out, const Weights& weights,
                        int64_t streams, bool q8) {
  TORCH_CHECK(x.dim() == 2 && normed.sizes() == x.sizes() && out.dim() == 2 && out.size(1) * streams == x.size(1) &&
                  weights.size() == 3,
              "hyper_inject: x and normed [N, streams * hidden], out [N, hidden] and the inject map's (weight, "
              "scale, bias) expected, got ",
              x.sizes(), ", ", normed.sizes(), ", ", out.sizes(), " and ", weights.size(), " weights");
  const at::Tensor scale = 2 * at::sigmoid(tandem::linear_at(normed, weights, 0, q8, "hyper_inject") / streams);
  return x + (out.unsqueeze(-2) * scale.unsqueeze(-1)).flatten(-2);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("hyper_mix(Tensor x, Tensor norm_weight, Tensor?[] weights, int streams, float eps, bool q8_activations=False) "
        "-> (Tensor, Tensor)");
  m.def("hyper_inject(Tensor x, Tensor normed, Tensor out, Tensor?[] weights, int streams, bool q8_activations=False) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("hyper_mix", hyper_mix);
  m.impl("hyper_inject", hyper_inject);
}
