// tandem::decoder_layers: a stack of decoder layers for a few token rows (decode slots, verify
// tokens, a short prompt chunk), in one call.
//
// A decode step of a small model is a few hundred small ops; from Python each costs a dispatch of
// 10-30 us, which at 30 layers is milliseconds a step, as much as the int8 weights take to stream.
// Here the same ops run back to back in C++: the same kernels (linear_rows, rms_norm, rope_,
// decode_attention) and torch's own elementwise ops, in the order model.py runs them, so the
// results are the same numbers.
//
// Each token is its own row: it writes its K/V at positions[n] of slot slots[n], and once every
// row of the layer has written, it attends to positions 0 .. positions[n] of its slot. Tokens of
// one slot at consecutive positions (a verify block, a prompt chunk) thereby attend causally.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>

#include "tandem.h"

namespace {

// Per layer, in this order, None where the layer has none: the two norms' weights, q_norm and
// k_norm (Qwen3), and each linear layer as (weight, scale, bias).
enum Slot { IN_NORM, QKV, QKV_SCALE, QKV_BIAS, Q_NORM, K_NORM, O, O_SCALE, O_BIAS, POST_NORM, GATE_UP,
            GATE_UP_SCALE, GATE_UP_BIAS, DOWN, DOWN_SCALE, DOWN_BIAS, PER_LAYER };

using Weights = c10::List<c10::optional<at::Tensor>>;

at::Tensor required(const Weights& w, int64_t i) {
  const c10::optional<at::Tensor> t = w.get(i);
  TORCH_CHECK(t.has_value(), "decoder_layers: weight ", i % PER_LAYER, " of layer ", i / PER_LAYER, " is missing");
  return *t;
}

at::Tensor linear(const at::Tensor& x, const Weights& w, int64_t base, Slot s) {
  return tandem::linear_rows(x, required(w, base + s), w.get(base + s + 1), w.get(base + s + 2));
}

// Rows of qk [N, heads, D] normalised per head, in place.
void norm_heads(at::Tensor qk, const at::Tensor& weight, double eps) { qk.copy_(tandem::rms_norm(qk, weight, eps)); }

// Row n's key and value heads (k, v: [N, KVH, D] views of the qkv rows) into the cache at slot
// slots[n], position positions[n].
void write_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor& kc, at::Tensor& vc, const int64_t* slots,
                 const int64_t* positions) {
  const int64_t N = k.size(0), KVH = k.size(1), e = k.element_size(), bytes = k.size(2) * e;
  const char* kr = static_cast<const char*>(k.data_ptr());
  const char* vr = static_cast<const char*>(v.data_ptr());
  char* kb = static_cast<char*>(kc.data_ptr());
  char* vb = static_cast<char*>(vc.data_ptr());
  for (int64_t n = 0; n < N; ++n)
    for (int64_t g = 0; g < KVH; ++g) {
      const int64_t from = (n * k.stride(0) + g * k.stride(1)) * e;
      const int64_t to = (slots[n] * kc.stride(0) + g * kc.stride(1) + positions[n] * kc.stride(2)) * e;
      std::memcpy(kb + to, kr + from, bytes);
      std::memcpy(vb + to, vr + from, bytes);
    }
}

at::Tensor decoder_layers(const at::Tensor& hidden, const Weights& weights, const std::vector<at::Tensor>& k_cache,
                          const std::vector<at::Tensor>& v_cache, const at::Tensor& slots,
                          const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                          int64_t kv_heads, double eps) {
  const int64_t layers = static_cast<int64_t>(k_cache.size()), N = hidden.size(0);
  TORCH_CHECK(hidden.dim() == 2 && v_cache.size() == k_cache.size() &&
                  static_cast<int64_t>(weights.size()) == layers * PER_LAYER,
              "decoder_layers: hidden [N, H], one K and V cache and ", PER_LAYER, " weights per layer expected");
  TORCH_CHECK(slots.numel() == N && positions.numel() == N, "decoder_layers: one slot and one position per row");
  const at::Tensor s = slots.to(at::kLong).contiguous(), p = positions.to(at::kLong).contiguous();
  const at::Tensor lengths = p + 1;
  const int64_t* sp = s.data_ptr<int64_t>();
  const int64_t* pp = p.data_ptr<int64_t>();
  at::Tensor x = hidden.contiguous();
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t b = l * PER_LAYER;
    at::Tensor kc = k_cache[l], vc = v_cache[l];
    TORCH_CHECK(kc.dim() == 4 && kc.is_contiguous() && vc.sizes() == kc.sizes() && vc.is_contiguous() &&
                    kc.scalar_type() == x.scalar_type() && vc.scalar_type() == x.scalar_type() &&
                    kc.size(1) == kv_heads,
                "decoder_layers: layer ", l, "'s cache must be contiguous [S, ", kv_heads, ", C, D] in ",
                x.scalar_type());
    const int64_t D = kc.size(3);
    for (int64_t n = 0; n < N; ++n)
      TORCH_CHECK(sp[n] >= 0 && sp[n] < kc.size(0) && pp[n] >= 0 && pp[n] < kc.size(2), "decoder_layers: row ", n,
                  " writes slot ", sp[n], " position ", pp[n], " outside a cache of ", kc.size(0), " slots x ",
                  kc.size(2));
    const at::Tensor qkv = linear(tandem::rms_norm(x, required(weights, b + IN_NORM), eps), weights, b, QKV)
                               .view({N, heads + 2 * kv_heads, D});
    if (weights.get(b + Q_NORM).has_value()) {
      norm_heads(qkv.narrow(1, 0, heads), required(weights, b + Q_NORM), eps);
      norm_heads(qkv.narrow(1, heads, kv_heads), required(weights, b + K_NORM), eps);
    }
    tandem::rope_(qkv.narrow(1, 0, heads + kv_heads), cos, sin);
    write_cache(qkv.narrow(1, heads, kv_heads), qkv.narrow(1, heads + kv_heads, kv_heads), kc, vc, sp, pp);
    const at::Tensor attn = tandem::decode_attention(qkv.narrow(1, 0, heads), kc, vc, s, lengths,
                                                     1.0 / std::sqrt(static_cast<double>(D)));
    x = x + linear(attn.view({N, heads * D}), weights, b, O);
    const at::Tensor gate_up = linear(tandem::rms_norm(x, required(weights, b + POST_NORM), eps), weights, b, GATE_UP);
    const int64_t inter = gate_up.size(1) / 2;
    x = x + linear(at::silu(gate_up.narrow(1, 0, inter)) * gate_up.narrow(1, inter, inter), weights, b, DOWN);
  }
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("decoder_layers(Tensor hidden, Tensor?[] weights, Tensor[] k_cache, Tensor[] v_cache, Tensor slots, "
        "Tensor positions, Tensor cos, Tensor sin, int heads, int kv_heads, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) { m.impl("decoder_layers", decoder_layers); }
