// tandem::Qwen4ExpLayers: a stack of Qwen4-Exp decoder layers (engine/model/qwen4_exp.py) over
// decode rows, one token a slot, in one call a step.
//
// Each layer is the same kernels engine/model/qwen4_exp.py calls one by one (hyper_mix, the mixer:
// gated_delta_mixer, or the gated attention with the model's QSA indexer; hyper_inject, hyper_mix,
// experts_rows, hyper_inject), and between them the same ATen ops in the same order, so the stack
// gives the numbers the modules give. From Python the calls and the ops between them were about 3 ms
// of a 29 ms decode step of the 1.3B bench model (16 layers, Zen 4), and more where the weights'
// streaming had left the interpreter's data cold.
//
// The stack holds its weights and its layers' cache storage, given once: torch's conversion of a
// list of a few thousand optional tensors on every call took about 0.25 ms.
//
// Attention rows: a dense layer, and a QSA layer whose rows all see no more complete blocks than
// it keeps, attend in one decode_attention call; a QSA layer whose rows are all past that selects
// each row's blocks by its indexer's scores and reads the selected rows where they lie (attend_at:
// f32 storage). The caller (engine/model/qwen4_exp.py) hands the stack no other step.
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "kv_rows.h"
#include "tandem.h"

namespace tandem {

namespace {

using Weights = c10::List<c10::optional<at::Tensor>>;

constexpr const char* OP = "Qwen4ExpLayers";

// A layer's weights, in this order: each hyper-connection's norm weight then its down, up and
// inject maps as (weight, scale, bias); the mixer's; then the experts' as experts_rows reads them.
enum HyperSlot { HC_NORM = 0, HC_MIX = 1, HC_INJECT = 7, PER_HYPER = 10 };
enum LayerSlot { ATTN_HC = 0, MLP_HC = PER_HYPER, MIXER = 2 * PER_HYPER, EXPERTS = MIXER + 13 };
// A recurrent layer's mixer: its two projections, then its tensors and stores as gated_delta_mixer
// takes them. An attention layer's: qkv, the q and k norms, o, the indexer's projection and norms
// (None for a layer without an indexer).
enum RecurrentSlot { IN_PROJ = 0, OUT_PROJ = 3, LINEAR_TENSORS = 6, PER_LINEAR_TENSORS = 7 };
enum AttentionSlot { QKV = 0, Q_NORM = 3, K_NORM = 4, O = 5, INDEX = 8, INDEX_Q_NORM = 11, INDEX_K_NORM = 12 };
// Per layer, these integers.
enum Flag { ATTENTION, RATIO, KEEP, Q8_ATTN_HC, Q8_MLP_HC, Q8_MIXER, Q8_O, Q8_INDEX, Q8_EXPERTS, PER_FLAG };
// Per layer, its storage (None for a recurrent layer): K, V, their q8_0 scales, the indexer's raw
// keys [rows, index_dim] and block keys [rows / ratio, index_dim].
enum StoreSlot { K, V, K_SCALE, V_SCALE, INDEX_KEYS, INDEX_BLOCKS, PER_STORE };
// The stack's dimensions.
enum Dim { STREAMS, HEADS, KV_HEADS, HEAD_DIM, INDEX_HEADS, INDEX_DIM, TOP_K, NORM_TOP_K, SIGMOID_GATE, DIMS };

Weights sub(const Weights& w, int64_t from, int64_t n) {
  Weights out;
  out.reserve(n);
  for (int64_t i = 0; i < n; ++i) out.push_back(w.get(from + i));
  return out;
}

at::Tensor need(const Weights& w, int64_t i, int64_t layer) {
  const c10::optional<at::Tensor> t = w.get(i);
  TORCH_CHECK(t.has_value(), OP, ": layer ", layer, " lacks tensor ", i);
  return *t;
}

// engine/model/rope.py apply_rope in the same ops: x [..., D], cos and sin [..., R], R <= D.
at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t r = cos.size(-1), half = r / 2, d = x.size(-1);
  const at::Tensor turned = x.narrow(-1, 0, r);
  const at::Tensor rotated = at::cat({-turned.narrow(-1, half, r - half), turned.narrow(-1, 0, half)}, -1);
  const at::Tensor out = turned * cos + rotated * sin;
  return r == d ? out : at::cat({out, x.narrow(-1, r, d - r)}, -1);
}

// The `keep` best of one query's block scores [1, n], ascending: torch.topk's set. Where the keep-th
// largest score's ties all fit, that set is every score at least as large, found here in one pass
// (torch's topk and sort cost 0.18 ms a layer cold, after a step's weights stream, against 0.03
// warm); where ties straddle it (relu's exact zeros) or a score is NaN, torch's topk chooses among
// them, as the reference does.
std::vector<int64_t> kept_blocks(const at::Tensor& scores, int64_t keep) {
  const at::Tensor row = scores.to(at::kFloat).contiguous();
  const float* sc = row.data_ptr<float>();
  const int64_t n = row.numel();
  std::vector<float> values(sc, sc + n);
  std::vector<int64_t> top;
  if (std::none_of(values.begin(), values.end(), [](float v) { return std::isnan(v); })) {
    std::nth_element(values.begin(), values.begin() + (keep - 1), values.end(), std::greater<float>());
    const float kth = values[keep - 1];
    if (std::count_if(sc, sc + n, [&](float v) { return v >= kth; }) == keep) {
      for (int64_t b = 0; b < n; ++b)
        if (sc[b] >= kth) top.push_back(b);
      return top;
    }
  }
  const at::Tensor chosen = std::get<1>(row.topk(keep, -1)).contiguous();
  top.assign(chosen.data_ptr<int64_t>(), chosen.data_ptr<int64_t>() + keep);
  std::sort(top.begin(), top.end());
  return top;
}

struct Hyper {
  at::Tensor norm;
  Weights mix, inject;
  bool q8;
};

struct Layer {
  Hyper attn, mlp;
  bool attention;
  Weights mixer, linear, experts;
  int64_t ratio, keep;
  bool q8_mixer, q8_o, q8_index, q8_experts;
  Store k, v;
  Layout layout;  // where a slot's positions lie in k, v and the indexer's stores
  at::Tensor index_keys, index_blocks;
};

}  // namespace

class Qwen4ExpLayers : public torch::CustomClassHolder {
 public:
  // weights: every layer's, `per_layer` each (the layout above); stores: PER_STORE per layer;
  // flags: PER_FLAG per layer; dims: DIMS; pages: a unified pool's page table; cos, sin: the
  // model's RoPE tables [positions, R], read at a block's first position when it is pooled.
  Qwen4ExpLayers(Weights weights, Weights stores, std::vector<int64_t> flags, std::vector<int64_t> dims, double eps,
                 c10::optional<at::Tensor> pages, at::Tensor cos, at::Tensor sin)
      : pages_(std::move(pages)), cos_(std::move(cos)), sin_(std::move(sin)), eps_(eps) {
    TORCH_CHECK(static_cast<int64_t>(dims.size()) == DIMS && !flags.empty() && flags.size() % PER_FLAG == 0, OP,
                ": ", DIMS, " dims and ", PER_FLAG, " flags per layer expected");
    const int64_t layers = static_cast<int64_t>(flags.size()) / PER_FLAG;
    const int64_t per_layer = static_cast<int64_t>(weights.size()) / layers;
    TORCH_CHECK(per_layer > EXPERTS && static_cast<int64_t>(weights.size()) == layers * per_layer &&
                    static_cast<int64_t>(stores.size()) == layers * PER_STORE,
                OP, ": weights and ", PER_STORE, " stores per layer expected");
    std::copy(dims.begin(), dims.end(), dims_);
    for (int64_t l = 0; l < layers; ++l) {
      const int64_t b = l * per_layer, s = l * PER_STORE;
      const int64_t* f = flags.data() + l * PER_FLAG;
      const auto hyper = [&](int64_t at, bool q8) {
        return Hyper{need(weights, b + at + HC_NORM, l), sub(weights, b + at + HC_MIX, 6),
                     sub(weights, b + at + HC_INJECT, 3), q8};
      };
      Layer layer{hyper(ATTN_HC, f[Q8_ATTN_HC]), hyper(MLP_HC, f[Q8_MLP_HC]), f[ATTENTION] != 0,
                  sub(weights, b + MIXER, EXPERTS - MIXER), Weights(), sub(weights, b + EXPERTS, per_layer - EXPERTS),
                  f[RATIO], f[KEEP], f[Q8_MIXER] != 0, f[Q8_O] != 0, f[Q8_INDEX] != 0, f[Q8_EXPERTS] != 0};
      if (layer.attention) {
        layer.k = Store{need(stores, s + K, l), stores.get(s + K_SCALE)};
        layer.v = Store{need(stores, s + V, l), stores.get(s + V_SCALE)};
        tandem::check_pages(layer.k.data, pages_, OP);
        layer.layout = Layout::of(layer.k.data, pages_);  // the page table is updated in place, never replaced
        if (layer.ratio) {
          layer.index_keys = need(stores, s + INDEX_KEYS, l);
          layer.index_blocks = need(stores, s + INDEX_BLOCKS, l);
        }
      } else {
        layer.linear = sub(layer.mixer, LINEAR_TENSORS, PER_LINEAR_TENSORS);
        layer.mixer = sub(layer.mixer, IN_PROJ, LINEAR_TENSORS);
      }
      layers_.push_back(std::move(layer));
    }
  }

  // x [N, streams * hidden], row n the token at positions[n] of slot slots[n] (one a slot); cos,
  // sin [N, R] the rows' -> x after the stack.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& slots, const at::Tensor& positions, const at::Tensor& cos,
                     const at::Tensor& sin) {
    TORCH_CHECK(x.dim() == 2 && slots.numel() == x.size(0) && positions.numel() == x.size(0), OP,
                ": x [N, streams * hidden] and one slot and position per row expected");
    const at::Tensor s = slots.to(at::kLong).contiguous(), p = positions.to(at::kLong).contiguous();
    const int64_t streams = dims_[STREAMS];
    at::Tensor h = x;
    for (const Layer& layer : layers_) {
      auto [mixed, normed] = tandem::hyper_mix(h, layer.attn.norm, layer.attn.mix, streams, eps_, layer.attn.q8);
      const at::Tensor out = layer.attention ? attention(mixed, layer, s, p, cos, sin)
                                             : tandem::gated_delta_mixer(mixed, layer.mixer, layer.linear, s, p, eps_,
                                                                         dims_[SIGMOID_GATE] != 0, layer.q8_mixer);
      h = tandem::hyper_inject(h, normed, out, layer.attn.inject, streams, layer.attn.q8);
      auto [mlp_in, mlp_normed] = tandem::hyper_mix(h, layer.mlp.norm, layer.mlp.mix, streams, eps_, layer.mlp.q8);
      const at::Tensor experts = tandem::experts_rows(mlp_in, layer.experts, dims_[TOP_K], dims_[NORM_TOP_K] != 0,
                                                      layer.q8_experts);
      h = tandem::hyper_inject(h, mlp_normed, experts, layer.mlp.inject, streams, layer.mlp.q8);
    }
    return h;
  }

 private:
  // engine/model/attention.py's decode rows of a layer: h [N, hidden] -> [N, hidden].
  at::Tensor attention(const at::Tensor& h, const Layer& layer, const at::Tensor& s, const at::Tensor& p,
                       const at::Tensor& cos, const at::Tensor& sin) const {
    const int64_t N = h.size(0), H = dims_[HEADS], KVH = dims_[KV_HEADS], D = dims_[HEAD_DIM];
    const Weights& w = layer.mixer;
    const at::Tensor qkv = tandem::linear_at(h, w, QKV, layer.q8_mixer, OP).view({N, -1, D});
    at::Tensor qk = qkv.narrow(1, 0, H + KVH);
    if (w.get(Q_NORM).has_value())
      qk = at::cat({tandem::rms_norm(qk.narrow(1, 0, H), *w.get(Q_NORM), eps_),
                    tandem::rms_norm(qk.narrow(1, H, KVH), *w.get(K_NORM), eps_)},
                   1);
    tandem::rope_(qk, cos, sin);
    const at::Tensor q = qk.narrow(1, 0, H), k = qk.narrow(1, H, KVH), v = qkv.narrow(1, H + KVH, KVH);
    const int64_t* sp = s.data_ptr<int64_t>();
    const int64_t* pp = p.data_ptr<int64_t>();
    int64_t past = 0;  // rows that see more complete blocks than the layer keeps
    for (int64_t n = 0; n < N; ++n) {
      tandem::check_rows(pages_, sp[n], pp[n] + 1, layer.k.data.size(2), OP);
      past += layer.ratio && (pp[n] + 1) / layer.ratio > layer.keep;
    }
    TORCH_CHECK(past == 0 || past == N, OP, ": a QSA layer's rows must all be within its budget or all past it");
    write_cache(k, layer.k, sp, pp, layer.layout);
    write_cache(v, layer.v, sp, pp, layer.layout);
    const double scale = std::pow(static_cast<double>(D), -0.5);  // as Python's head_dim ** -0.5 rounds
    const bool sparse = past > 0;
    at::Tensor out;
    if (!sparse)
      out = tandem::decode_attention(q, layer.k.data, layer.v.data, s, p + 1, scale, c10::nullopt, pages_,
                                     layer.k.scales, layer.v.scales);
    if (layer.ratio) {
      const at::Tensor index_q = index_keys(h, layer, sp, pp, cos, sin);
      if (sparse) {
        out = at::empty({N, H, D}, q.options());
        for (int64_t n = 0; n < N; ++n) out[n].copy_(attend_selected(q[n], index_q.narrow(0, n, 1), layer, sp[n], pp[n], scale));
      }
    }
    if (qkv.size(1) == 2 * H + 2 * KVH) out = out * at::sigmoid(qkv.narrow(1, H + 2 * KVH, H));
    return tandem::linear_at(out.reshape({N, H * D}), w, O, layer.q8_o, OP);
  }

  // The rows' indexer queries [N, heads, index_dim], normed and turned; their raw keys written, and
  // the key of each block a row completes (engine/model/indexer.py).
  at::Tensor index_keys(const at::Tensor& h, const Layer& layer, const int64_t* sp, const int64_t* pp,
                        const at::Tensor& cos, const at::Tensor& sin) const {
    const int64_t N = h.size(0), HI = dims_[INDEX_HEADS], DI = dims_[INDEX_DIM], r = layer.ratio;
    const Weights& w = layer.mixer;
    const at::Tensor proj = tandem::linear_at(h, w, INDEX, layer.q8_index, OP);
    const at::Tensor q = tandem::rms_norm(proj.narrow(1, 0, HI * DI).reshape({-1, HI, DI}), *w.get(INDEX_Q_NORM), eps_);
    const at::Tensor raw = proj.narrow(1, HI * DI, DI);
    for (int64_t n = 0; n < N; ++n) {
      layer.index_keys[key_row(layer, sp[n], pp[n])].copy_(raw[n]);
      if ((pp[n] + 1) % r) continue;
      const int64_t first = pp[n] / r * r;
      const at::Tensor block = layer.index_keys.narrow(0, key_row(layer, sp[n], first), r);
      const at::Tensor pooled = tandem::rms_norm(block.to(at::kFloat).unflatten(0, {-1, r}).mean(1).to(block.scalar_type()),
                                                 *w.get(INDEX_K_NORM), eps_);
      const auto turn = [&](const at::Tensor& table) { return table.narrow(0, first, 1).unsqueeze(1).to(pooled.scalar_type()); };
      layer.index_blocks[block_row(layer, sp[n], first / r)].copy_(apply_rope(pooled.unsqueeze(1), turn(cos_), turn(sin_))[0][0]);
    }
    return apply_rope(q, cos.unsqueeze(1).to(q.scalar_type()), sin.unsqueeze(1).to(q.scalar_type()));
  }

  // One query q [H, D] at position pos of slot s past its layer's budget: its `keep` best complete
  // blocks by its indexer query index_q [1, heads, index_dim] and its tail (engine/model/qsa.py
  // `attended`), read where they lie.
  at::Tensor attend_selected(const at::Tensor& q, const at::Tensor& index_q, const Layer& layer, int64_t s, int64_t pos,
                             double scale) const {
    const int64_t r = layer.ratio, complete = (pos + 1) / r;
    const at::TensorOptions index = at::TensorOptions().dtype(at::kLong);
    at::Tensor blocks;
    if (pages_.has_value()) {
      std::vector<int64_t> rows(complete);
      for (int64_t b = 0; b < complete; ++b) rows[b] = block_row(layer, s, b);
      blocks = layer.index_blocks.index_select(0, at::tensor(rows, index));
    } else {
      blocks = layer.index_blocks.narrow(0, block_row(layer, s, 0), complete);
    }
    const at::Tensor scores = tandem::block_scores(index_q, blocks.unsqueeze(0));
    const at::Tensor top = at::tensor(kept_blocks(scores.narrow(1, 0, complete), layer.keep), index);
    at::Tensor positions = at::cat({(top.unsqueeze(1) * r + at::arange(r, index)).flatten(),
                                    at::arange(complete * r, pos + 1, index)});
    const int64_t c = pages_.has_value() ? 0 : s;
    if (pages_.has_value()) {
      int64_t* pp = positions.data_ptr<int64_t>();
      for (int64_t i = 0, m = positions.numel(); i < m; ++i) pp[i] = layer.layout.row(s, pp[i]);
    }
    return tandem::attend_at(q, layer.k.data[c], layer.v.data[c], positions, scale);
  }

  // The indexer stores' row of slot s's position pos, and of its block b (engine/model/kv_cache.py
  // _rows and _block_rows: slot-major, (s C + b r) / r = s C / r + b, a slot's first row's block
  // row plus b, as read_index_blocks reads them).
  int64_t key_row(const Layer& layer, int64_t s, int64_t pos) const {
    return pages_.has_value() ? layer.layout.row(s, pos) : s * layer.k.data.size(2) + pos;
  }
  int64_t block_row(const Layer& layer, int64_t s, int64_t b) const { return key_row(layer, s, b * layer.ratio) / layer.ratio; }

  std::vector<Layer> layers_;
  c10::optional<at::Tensor> pages_;
  at::Tensor cos_, sin_;
  double eps_;
  int64_t dims_[DIMS];
};

}  // namespace tandem

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.class_<tandem::Qwen4ExpLayers>("Qwen4ExpLayers")
      .def(torch::init<c10::List<c10::optional<at::Tensor>>, c10::List<c10::optional<at::Tensor>>,
                       std::vector<int64_t>, std::vector<int64_t>, double, c10::optional<at::Tensor>, at::Tensor,
                       at::Tensor>())
      .def("forward", &tandem::Qwen4ExpLayers::forward);
}
