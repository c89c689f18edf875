// tandem::decoder_layers: a stack of decoder layers for a few token rows (decode slots, verify
// tokens, a short prompt chunk), in one call.
//
// A decode step of a small model is a few hundred small ops; from Python each costs a dispatch of
// 10-30 us, which at 30 layers is milliseconds a step, as much as the int8 weights take to stream.
// Here the same ops run back to back in C++: the same kernels (linear_rows, rms_norm, rope_,
// decode_attention) and the elementwise ops as torch's CPU kernels compute them, in the order
// model.py runs them, so the results are the same numbers.
//
// Each token is its own row: it writes its K/V at positions[n] of slot slots[n], and once every
// row of the layer has written, it attends to positions 0 .. positions[n] of its slot. The cache is
// slot-major, or one unified pool read through a page table (tandem::Layout); it holds floats, or
// q8_0 with each new key and value quantized as engine/model/kv_cache.py Q8Storage writes it. Tokens
// of one slot at consecutive positions (a verify block, a prompt chunk) thereby attend causally.
// A tree's verify rows give rope_positions too: a node written at positions[n] but standing at
// rope_positions[n] attends to 0 .. rope_positions[n]-1 (the chain before it) and then itself; in a
// QSA layer its budget, its visible blocks and its tail block are those of rope_positions[n].
//
// A QSA layer (engine/model/qsa.py) also keeps its pooled keys: once every row has written, each block a
// row completed gets the mean of its keys. A row whose complete blocks fit the budget attends like
// a dense row (one decode_attention call for all of them, so QSA within the budget is exactly
// dense); a row past it scores the blocks it sees, keeps the best, and attends those and its tail
// block on its own, in ATen ops: at most a few such rows a step, each over a budget of keys.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "kv_rows.h"
#include "tandem.h"

namespace {

// Per layer, in this order, None where the layer has none: the two norms' weights, q_norm and
// k_norm (Qwen3), and each linear layer as (weight, scale, bias). A linear-attention layer's QKV is
// its input projection [qkv | z | b | a] and O its out_proj.
enum Slot { IN_NORM, QKV, QKV_SCALE, QKV_BIAS, Q_NORM, K_NORM, O, O_SCALE, O_BIAS, POST_NORM, GATE_UP,
            GATE_UP_SCALE, GATE_UP_BIAS, DOWN, DOWN_SCALE, DOWN_BIAS, PER_LAYER };
// A linear-attention layer's own tensors, in this order (all None for an attention layer): its
// convolution [C, K], A and dt_bias [H] f32, each value head's key head [H] int64, the gated norm's
// weight [Dv] f32, and its stores in the cache, conv [S, R, K-1, C] and state [S, R, H, Dk, Dv].
enum LinearSlot { CONV_WEIGHT, A, DT_BIAS, K_HEAD, GATED_NORM, CONV_STORE, STATE_STORE, PER_LINEAR };

using Weights = c10::List<c10::optional<at::Tensor>>;

at::Tensor required(const Weights& w, int64_t i) {
  const c10::optional<at::Tensor> t = w.get(i);
  TORCH_CHECK(t.has_value(), "decoder_layers: weight ", i % PER_LAYER, " of layer ", i / PER_LAYER, " is missing");
  return *t;
}

// q8: block weights take 8-bit activations (linear_rows).
at::Tensor linear(const at::Tensor& x, const Weights& w, int64_t base, Slot s, bool q8) {
  return tandem::linear_rows(x, required(w, base + s), w.get(base + s + 1), w.get(base + s + 2), q8);
}

// Rows of qk [N, heads, D] normalised per head, in place.
void norm_heads(at::Tensor qk, const at::Tensor& weight, double eps) { qk.copy_(tandem::rms_norm(qk, weight, eps)); }

// The MLP's output for x [N, hidden] of layer b: down(silu(gate) * up).
at::Tensor mlp(const at::Tensor& x, const Weights& w, int64_t b, double eps, bool q8) {
  const at::Tensor gate_up = linear(tandem::rms_norm(x, required(w, b + POST_NORM), eps), w, b, GATE_UP, q8);
  return linear(tandem::silu_mul(gate_up), w, b, DOWN, q8);
}

using tandem::Layout;
using tandem::Store;
using tandem::offset;
using tandem::write_cache;

// Pooled keys [S, KVH, C / ratio, D] f32 of a QSA layer (a pool's: [1, KVH, P / ratio, D]): block
// p / ratio of slot slots[n] for each row n whose position p ends its block, from the keys now in
// the cache (as engine/model/qsa.py block_means computes them). A block lies in one page.
void pool_blocks(const Store& kc, const at::Tensor& kpool, const int64_t* slots, const int64_t* positions,
                 int64_t N, int64_t ratio, const Layout& at) {
  for (int64_t n = 0; n < N; ++n) {
    if ((positions[n] + 1) % ratio) continue;
    const int64_t first = at.row(slots[n], positions[n] / ratio * ratio), c = at.pages ? 0 : slots[n];
    kpool[c].select(1, first / ratio).copy_(kc.floats([&](const at::Tensor& t) {
      return t[c].narrow(1, first, ratio);
    }).mean(1));
  }
}

// weight * o / rms(o) * act(z) per value head, in f32: core [N, H, Dv], z [N, H * Dv] (a view) -> [N, H * Dv],
// in engine/model/norm.py GatedRMSNorm's order; act SiLU (Qwen3.5) or the sigmoid (Qwen4-Exp's output_gate_type).
at::Tensor gated_norm(const at::Tensor& core, const at::Tensor& z, const at::Tensor& weight, double eps, bool sigmoid) {
  const int64_t N = core.size(0), H = core.size(1), Dv = core.size(2);
  const at::Tensor zc = z.to(at::kFloat).contiguous(), w = weight.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({N, H * Dv}, core.options());
  const float* o = core.data_ptr<float>();
  const float* zp = zc.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* y = out.data_ptr<float>();
  for (int64_t r = 0; r < N * H; ++r) {
    const float* on = o + r * Dv;
    float ss = 0.f;
    for (int64_t c = 0; c < Dv; ++c) ss += on[c] * on[c];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(Dv) + static_cast<float>(eps));
    for (int64_t c = 0; c < Dv; ++c) {
      const float g = zp[r * Dv + c];
      y[r * Dv + c] = wp[c] * (on[c] * inv) * ((sigmoid ? 1.f : g) / (1.f + std::exp(-g)));
    }
  }
  return out;
}

// A linear-attention layer's mixer over its normed input h [N, hidden] -> [N, hidden] (its stores
// written); its output gate SiLU, or the sigmoid.
at::Tensor linear_attention(const at::Tensor& h, const Weights& w, int64_t b, const Weights& lin, int64_t l,
                            const at::Tensor& slots, const at::Tensor& positions, double eps, bool q8,
                            bool sigmoid_gate = false) {
  const auto get = [&](LinearSlot t) { return *lin.get(l * PER_LINEAR + t); };
  const at::Tensor conv_weight = get(CONV_WEIGHT), state = get(STATE_STORE);
  const int64_t H = state.size(2), Dv = state.size(4), C = conv_weight.size(0);
  const at::Tensor proj = linear(h, w, b, QKV, q8).to(at::kFloat);
  const at::Tensor core = tandem::gated_delta_rows(proj, (C - H * Dv) / 2, conv_weight, get(A), get(DT_BIAS),
                                                   get(K_HEAD), get(CONV_STORE), state, slots, positions);
  const at::Tensor normed = gated_norm(core, proj.narrow(1, C, H * Dv), get(GATED_NORM), eps, sigmoid_gate);
  return linear(normed.to(h.scalar_type()), w, b, O, q8);
}

// Where slot s's positions 0 .. length-1 lie in a pool of `pool` rows, [length] int64.
at::Tensor slot_rows(const at::Tensor& pages, int64_t s, int64_t length, int64_t pool) {
  const int64_t page = pool / pages.size(1), held = (length + page - 1) / page;
  const at::Tensor runs = pages[s].narrow(0, 0, held).unsqueeze(1) * page + at::arange(page, pages.options());
  return runs.flatten().narrow(0, 0, length);
}

// One QSA query q [H, D] standing at position p past the budget, its key written at position w (p
// but for a tree's sibling, whose key lies past its chain), against its slot's keys and values
// (cache entry c: [KVH, C, D]) and pooled keys [KVH, C / ratio, D], by engine/model/qsa.py's rule:
// the `keep` best of its (p+1) / ratio complete blocks (torch.topk over their scores) and its tail
// up to p, its own key read at w -> [H, D]. A sibling whose position ends a block pools that block
// with its own key in place of the chain's. rows: where the slot's positions 0 .. w lie in a pool's
// keys (undefined: at their own indices).
at::Tensor attend_selected(const at::Tensor& q, const Store& keys, const Store& values, int64_t c,
                           const at::Tensor& pool, int64_t p, int64_t w, int64_t ratio, int64_t keep,
                           const at::Tensor& rows) {
  const int64_t H = q.size(0), D = q.size(1), KVH = keys.data.size(1), complete = (p + 1) / ratio;
  const at::TensorOptions index = at::TensorOptions().dtype(at::kLong);
  const auto at_rows = [&](const at::Tensor& logical) { return rows.defined() ? rows.index_select(0, logical) : logical; };
  const auto pick = [&](const at::Tensor& where) {
    return [&, where](const at::Tensor& t) { return t[c].index_select(1, where); };
  };
  const at::Tensor qg = q.to(at::kFloat).view({KVH, H / KVH, D});
  at::Tensor blocks = rows.defined()
                          ? pool.index_select(1, rows.narrow(0, 0, complete * ratio).slice(0, 0, c10::nullopt, ratio)
                                                     .div(ratio, "floor"))
                          : pool.narrow(1, 0, complete);
  if (w != p && (p + 1) % ratio == 0) {
    const at::Tensor own = at_rows(at::cat({at::arange(p + 1 - ratio, p, index), at::full({1}, w, index)}));
    blocks = blocks.clone();  // the pool's own entry holds the chain's key
    blocks.select(1, complete - 1).copy_(keys.floats(pick(own)).mean(1));
  }
  const at::Tensor scores =
      at::matmul(qg, blocks.transpose(1, 2)).relu().sum({0, 1}) / std::sqrt(static_cast<double>(D));
  const at::Tensor kept = std::get<0>(std::get<1>(scores.topk(keep)).sort());
  at::Tensor logical = at::cat({(kept.unsqueeze(1) * ratio + at::arange(ratio, index)).flatten(),
                                at::arange(complete * ratio, p + 1, index)});
  logical.masked_fill_(logical == p, w);
  const at::Tensor seen = at_rows(logical);
  const at::Tensor k = keys.floats(pick(seen)), v = values.floats(pick(seen));
  const at::Tensor weights = at::softmax(at::matmul(qg, k.transpose(1, 2)) / std::sqrt(static_cast<double>(D)), -1);
  return at::matmul(weights, v).view({H, D}).to(q.scalar_type());
}

// Every row's attention [N, H, D] to its slot, q [N, H, D]; row n stands at lengths[n] - 1 and is
// written at positions[n] (last: a tree's positions, where they differ). A dense layer (ratio 0),
// and the rows of a QSA layer whose complete blocks number at most `keep`, attend in one
// decode_attention call; a QSA layer's other rows attend their selected blocks.
at::Tensor attend_rows(const at::Tensor& q, const Store& kc, const Store& vc, const at::Tensor& kpool,
                       const at::Tensor& slots, const at::Tensor& positions, const at::Tensor& lengths,
                       const c10::optional<at::Tensor>& last, int64_t ratio, int64_t keep,
                       const c10::optional<at::Tensor>& pages) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(kc.data.size(3)));
  const auto attend = [&](const at::Tensor& rows_q, const at::Tensor& rows_slots, const at::Tensor& rows_lengths,
                          const c10::optional<at::Tensor>& rows_last) {
    return tandem::decode_attention(rows_q, kc.data, vc.data, rows_slots, rows_lengths, scale, rows_last, pages,
                                    kc.scales, vc.scales);
  };
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* pp = positions.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  std::vector<int64_t> within, past;
  for (int64_t n = 0; n < q.size(0); ++n) (ratio && lp[n] / ratio > keep ? past : within).push_back(n);
  if (past.empty()) return attend(q, slots, lengths, last);
  at::Tensor out = at::empty(q.sizes(), q.options());
  if (!within.empty()) {
    const at::Tensor rows = at::tensor(within, at::kLong);
    const c10::optional<at::Tensor> rows_last =
        last.has_value() ? c10::optional<at::Tensor>(last->index_select(0, rows)) : c10::nullopt;
    out.index_copy_(0, rows, attend(q.index_select(0, rows), slots.index_select(0, rows), lengths.index_select(0, rows),
                                    rows_last));
  }
  for (const int64_t n : past) {
    const int64_t c = pages.has_value() ? 0 : sp[n];
    const at::Tensor rows = pages.has_value() ? slot_rows(*pages, sp[n], pp[n] + 1, kc.data.size(2)) : at::Tensor();
    out[n].copy_(attend_selected(q[n], kc, vc, c, kpool[c], lp[n] - 1, pp[n], ratio, keep, rows));
  }
  return out;
}

at::Tensor decoder_layers(const at::Tensor& hidden, const Weights& weights, const std::vector<at::Tensor>& k_cache,
                          const std::vector<at::Tensor>& v_cache, const c10::List<c10::optional<at::Tensor>>& k_scales,
                          const c10::List<c10::optional<at::Tensor>>& v_scales,
                          const c10::List<c10::optional<at::Tensor>>& kpools,
                          at::IntArrayRef ratios, at::IntArrayRef budgets, const at::Tensor& slots,
                          const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                          int64_t kv_heads, double eps, const c10::optional<at::Tensor>& rope_positions,
                          const c10::optional<at::Tensor>& pages, const c10::optional<Weights>& linear_layers,
                          bool q8_activations) {
  const int64_t layers = static_cast<int64_t>(k_cache.size()), N = hidden.size(0);
  TORCH_CHECK(hidden.dim() == 2 && v_cache.size() == k_cache.size() &&
                  static_cast<int64_t>(weights.size()) == layers * PER_LAYER,
              "decoder_layers: hidden [N, H], one K and V cache and ", PER_LAYER, " weights per layer expected");
  TORCH_CHECK(static_cast<int64_t>(kpools.size()) == layers && static_cast<int64_t>(k_scales.size()) == layers &&
                  static_cast<int64_t>(v_scales.size()) == layers && static_cast<int64_t>(ratios.size()) == layers &&
                  static_cast<int64_t>(budgets.size()) == layers,
              "decoder_layers: one pool, pair of q8_0 scales, ratio and budget per layer expected");
  TORCH_CHECK(slots.numel() == N && positions.numel() == N, "decoder_layers: one slot and one position per row");
  const at::Tensor s = slots.to(at::kLong).contiguous(), p = positions.to(at::kLong).contiguous();
  const bool tree = rope_positions.has_value();
  TORCH_CHECK(!tree || rope_positions->numel() == N, "decoder_layers: one rope position per row");
  const at::Tensor lengths = (tree ? rope_positions->to(at::kLong) + 1 : p + 1).contiguous();
  const c10::optional<at::Tensor> last = tree ? c10::optional<at::Tensor>(p) : c10::nullopt;
  const int64_t* sp = s.data_ptr<int64_t>();
  const int64_t* pp = p.data_ptr<int64_t>();
  const Weights lin = linear_layers.has_value() ? *linear_layers : Weights();
  TORCH_CHECK(!linear_layers.has_value() || static_cast<int64_t>(lin.size()) == layers * PER_LINEAR,
              "decoder_layers: ", PER_LINEAR, " linear-attention tensors per layer expected (None for attention)");
  TORCH_CHECK(!tree || lin.empty(), "decoder_layers: a tree's rows need an attention layer's cache");
  at::Tensor x = hidden.clone(at::MemoryFormat::Contiguous);  // the residual stream, updated in place
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t b = l * PER_LAYER;
    if (!lin.empty() && lin.get(l * PER_LINEAR).has_value()) {  // a linear-attention (recurrent) layer
      const at::Tensor normed = tandem::rms_norm(x, required(weights, b + IN_NORM), eps);
      tandem::add_to(x, linear_attention(normed, weights, b, lin, l, s, p, eps, q8_activations));
      tandem::add_to(x, mlp(x, weights, b, eps, q8_activations));
      continue;
    }
    Store ks{k_cache[l], k_scales.get(l)}, vs{v_cache[l], v_scales.get(l)};
    const at::Tensor &kc = ks.data, &vc = vs.data;
    const bool q8 = ks.scales.has_value();
    TORCH_CHECK(vs.scales.has_value() == q8 && (!q8 || x.scalar_type() == at::kFloat), "decoder_layers: layer ", l,
                ": a q8_0 cache gives both K's and V's scales, and takes f32 rows");
    if (q8) {
      tandem::check_q8(kc, *ks.scales, "decoder_layers");
      tandem::check_q8(vc, *vs.scales, "decoder_layers");
    }
    TORCH_CHECK(kc.dim() == 4 && kc.is_contiguous() && vc.sizes() == kc.sizes() && vc.is_contiguous() &&
                    (q8 || (kc.scalar_type() == x.scalar_type() && vc.scalar_type() == x.scalar_type())) &&
                    kc.size(1) == kv_heads,
                "decoder_layers: layer ", l, "'s cache must be contiguous [S, ", kv_heads, ", C, D] in ",
                x.scalar_type(), " or q8_0");
    const int64_t S = tandem::check_pages(kc, pages, "decoder_layers");
    const Layout at = Layout::of(kc, pages);
    const int64_t D = kc.size(3), ratio = ratios[l];
    const c10::optional<at::Tensor> pool = kpools.get(l);
    TORCH_CHECK(pool.has_value() == (ratio > 0), "decoder_layers: layer ", l, " has ratio ", ratio,
                pool.has_value() ? " and a pool: a pool belongs to a QSA layer (ratio >= 2)"
                                 : " and no pool: a QSA layer needs one");
    const at::Tensor kpool = pool.has_value() ? *pool : at::Tensor();
    if (ratio) {
      TORCH_CHECK(ratio >= 2 && budgets[l] % ratio == 0, "decoder_layers: layer ", l, "'s budget ", budgets[l],
                  " must be a multiple of its ratio ", ratio, " (>= 2)");
      TORCH_CHECK(kpool.dim() == 4 && kpool.is_contiguous() && kpool.scalar_type() == at::kFloat &&
                      kpool.size(0) == kc.size(0) && kpool.size(1) == kv_heads &&
                      kpool.size(2) == kc.size(2) / ratio && kpool.size(3) == D,
                  "decoder_layers: layer ", l, "'s pool must be contiguous [", kc.size(0), ", ", kv_heads, ", ",
                  kc.size(2) / ratio, ", ", D, "] in float, got ", kpool.sizes(), " in ", kpool.scalar_type());
    }
    for (int64_t n = 0; n < N; ++n) {
      TORCH_CHECK(sp[n] >= 0 && sp[n] < S && pp[n] >= 0 && pp[n] < kc.size(2), "decoder_layers: row ", n,
                  " writes slot ", sp[n], " position ", pp[n], " outside a cache of ", S, " slots x ", kc.size(2));
      tandem::check_rows(pages, sp[n], pp[n] + 1, kc.size(2), "decoder_layers");
    }
    // [q | k | v] heads, then a gated layer's output gates, one per query head (Qwen3.5).
    const at::Tensor qkv = linear(tandem::rms_norm(x, required(weights, b + IN_NORM), eps), weights, b, QKV, q8_activations)
                               .view({N, -1, D});
    const bool gated = qkv.size(1) == 2 * heads + 2 * kv_heads;
    if (weights.get(b + Q_NORM).has_value()) {
      norm_heads(qkv.narrow(1, 0, heads), required(weights, b + Q_NORM), eps);
      norm_heads(qkv.narrow(1, heads, kv_heads), required(weights, b + K_NORM), eps);
    }
    tandem::rope_(qkv.narrow(1, 0, heads + kv_heads), cos, sin);
    write_cache(qkv.narrow(1, heads, kv_heads), ks, sp, pp, at);
    write_cache(qkv.narrow(1, heads + kv_heads, kv_heads), vs, sp, pp, at);
    if (ratio) pool_blocks(ks, kpool, sp, pp, N, ratio, at);
    at::Tensor attn = attend_rows(qkv.narrow(1, 0, heads), ks, vs, kpool, s, p, lengths, last, ratio,
                                  ratio ? budgets[l] / ratio : 0, pages);
    if (gated) attn = attn * at::sigmoid(qkv.narrow(1, heads + 2 * kv_heads, heads));
    tandem::add_to(x, linear(attn.reshape({N, heads * D}), weights, b, O, q8_activations));
    tandem::add_to(x, mlp(x, weights, b, eps, q8_activations));
  }
  return x;
}

}  // namespace

namespace tandem {

// One linear-attention layer's mixer over h [N, hidden], each token a row (decode, verify) at
// positions[n] of slot slots[n]: a family whose layers are not decoder_layers' (Qwen4-Exp) runs its
// Gated DeltaNet in one call. weights: the input projection's and out_proj's (weight, scale, bias);
// tensors: the layer's PER_LINEAR tensors and stores, as decoder_layers takes them.
at::Tensor gated_delta_mixer(const at::Tensor& h, const Weights& weights, const Weights& tensors,
                             const at::Tensor& slots, const at::Tensor& positions, double eps, bool sigmoid_gate,
                             bool q8_activations) {
  TORCH_CHECK(h.dim() == 2 && weights.size() == 6 && static_cast<int64_t>(tensors.size()) == PER_LINEAR &&
                  slots.numel() == h.size(0) && positions.numel() == h.size(0),
              "gated_delta_mixer: h [N, hidden], the two projections' (weight, scale, bias), ", PER_LINEAR,
              " tensors and one slot and position per row expected");
  Weights layer;
  for (int64_t i = 0; i < PER_LAYER; ++i) layer.push_back(c10::nullopt);
  for (int64_t i = 0; i < 3; ++i) {
    layer.set(QKV + i, weights.get(i));
    layer.set(O + i, weights.get(3 + i));
  }
  return linear_attention(h, layer, 0, tensors, 0, slots.to(at::kLong).contiguous(),
                          positions.to(at::kLong).contiguous(), eps, q8_activations, sigmoid_gate);
}

}  // namespace tandem

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("decoder_layers(Tensor hidden, Tensor?[] weights, Tensor[] k_cache, Tensor[] v_cache, Tensor?[] k_scales, "
        "Tensor?[] v_scales, Tensor?[] kpools, "
        "int[] ratios, int[] budgets, Tensor slots, Tensor positions, Tensor cos, Tensor sin, int heads, int kv_heads, "
        "float eps, Tensor? rope_positions=None, Tensor? pages=None, Tensor?[]? linear_layers=None, bool q8_activations=False) -> Tensor");
  m.def("gated_delta_mixer(Tensor h, Tensor?[] weights, Tensor?[] tensors, Tensor slots, Tensor positions, float eps, "
        "bool sigmoid_gate, bool q8_activations=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("decoder_layers", decoder_layers);
  m.impl("gated_delta_mixer", tandem::gated_delta_mixer);
}
