// tandem::hyper_mix and tandem::hyper_inject: the two halves of a hyper-connection
// (engine/model/hyper_connections.py) over a few token rows, each in one call.
//
// A Qwen4-Exp layer has two hyper-connections and each is about twenty small ops (the streams'
// norms, the low-rank mixing weights, the mean over streams, the injection scales); from Python at
// decode these were about 5 ms of a 37 ms step at 16 layers. Here they run in hyper_connections.py's
// order without a trip through Python for each, the elementwise ones as loops that round as
// torch's kernels do (elementwise.cpp): the same numbers.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

#include "tandem.h"

namespace {

using Weights = c10::List<c10::optional<at::Tensor>>;

// The mean over streams of mixing * normed, both [N, streams * hidden] -> [N, hidden]: in f32 the
// products, then each output's sum over the streams in their order divided by their count, as
// torch's mul and mean round (two loops: elementwise.cpp says why).
at::Tensor mean_over_streams(const at::Tensor& mixing, const at::Tensor& normed, int64_t streams) {
  const int64_t N = normed.size(0), hidden = normed.size(1) / streams;
  if (mixing.scalar_type() != at::kFloat || normed.scalar_type() != at::kFloat)
    return (mixing.unflatten(-1, {streams, hidden}) * normed.unflatten(-1, {streams, hidden})).mean(-2);
  const at::Tensor m = mixing.contiguous(), n = normed.contiguous();
  at::Tensor products = at::empty_like(m);
  float* pp = products.data_ptr<float>();
  const float *mv = m.data_ptr<float>(), *nv = n.data_ptr<float>();
  for (int64_t i = 0, count = products.numel(); i < count; ++i) pp[i] = mv[i] * nv[i];
  at::Tensor mixed = at::empty({N, hidden}, normed.options());
  float* mp = mixed.data_ptr<float>();
  for (int64_t r = 0; r < N; ++r) {
    const float* row = pp + r * streams * hidden;
    float* out = mp + r * hidden;
    std::copy(row, row + hidden, out);
    for (int64_t t = 1; t < streams; ++t)
      for (int64_t j = 0; j < hidden; ++j) out[j] += row[t * hidden + j];
    for (int64_t j = 0; j < hidden; ++j) out[j] /= static_cast<float>(streams);
  }
  return mixed;
}

}  // namespace

namespace tandem {

// x [N, streams * hidden] -> (the block's input [N, hidden], the normed streams [N, streams * hidden]);
// weights: the down and up maps' (weight, scale, bias).
std::tuple<at::Tensor, at::Tensor> hyper_mix(const at::Tensor& x, const at::Tensor& norm_weight, const Weights& weights,
                                             int64_t streams, double eps, bool q8) {
  TORCH_CHECK(x.dim() == 2 && streams > 0 && x.size(1) % streams == 0 && weights.size() == 6,
              "hyper_mix: x [N, streams * hidden] and the down and up maps' (weight, scale, bias) expected, got ",
              x.sizes(), ", ", streams, " streams and ", weights.size(), " weights");
  const int64_t hidden = x.size(1) / streams;
  const at::Tensor normed = tandem::rms_norm(x, norm_weight, eps, hidden);
  const at::Tensor down = tandem::linear_at(normed, weights, 0, q8, "hyper_mix");
  const at::Tensor mixing =
      tandem::sigmoid(tandem::linear_at(tandem::silu(down / streams), weights, 3, q8, "hyper_mix"));
  return {mean_over_streams(mixing, normed, streams), normed};
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
  if (x.scalar_type() != at::kFloat || out.scalar_type() != at::kFloat || scale.scalar_type() != at::kFloat)
    return x + (out.unsqueeze(-2) * scale.unsqueeze(-1)).flatten(-2);
  // The same two roundings in two loops (elementwise.cpp says why not one).
  const at::Tensor o = out.contiguous(), s = scale.contiguous();
  at::Tensor result = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t N = x.size(0), hidden = out.size(1);
  const float *op = o.data_ptr<float>(), *sp = s.data_ptr<float>();
  float* rp = result.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t t = 0; t < streams; ++t)
      for (int64_t j = 0; j < hidden; ++j)
        rp[(n * streams + t) * hidden + j] = op[n * hidden + j] * sp[n * streams + t];
  tandem::add_to(result, x.contiguous());
  return result;
}

}  // namespace tandem

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("hyper_mix(Tensor x, Tensor norm_weight, Tensor?[] weights, int streams, float eps, bool q8_activations=False) "
        "-> (Tensor, Tensor)");
  m.def("hyper_inject(Tensor x, Tensor normed, Tensor out, Tensor?[] weights, int streams, bool q8_activations=False) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("hyper_mix", tandem::hyper_mix);
  m.impl("hyper_inject", tandem::hyper_inject);
}
