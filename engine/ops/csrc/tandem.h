// The kernels of engine/csrc as C++ functions, so that one kernel can call another without a trip
// through Python (layers.cpp runs whole decoder layers this way). Each is also registered as a torch
// op, torch.ops.tandem.<name>, in its own file.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace tandem {

// Elementwise steps between the products of a kernel (elementwise.cpp), computed as torch's CPU
// kernels compute them, so a kernel gives the numbers its module gives: from C++ each torch op
// still costs 2-3 us to dispatch and plan, several a layer. In f32 (silu and the sigmoid with
// AVX-512); other dtypes go through torch's ops.
// x += y, in place.
void add_to(at::Tensor& x, const at::Tensor& y);
// silu(gate) * up for gate_up [N, 2 I] -> [N, I].
at::Tensor silu_mul(const at::Tensor& gate_up);
// silu(x) and sigmoid(x), x's shape. A contiguous x is one run of numel values, as torch takes it
// (silu_mul's rows, views into gate_up, are runs of their own).
at::Tensor silu(const at::Tensor& x);
at::Tensor sigmoid(const at::Tensor& x);
// out[rows[k]] += y[k] * weights[k] for y [n, D], out [M, D]: index_add_ of y scaled per row; y is
// scaled in place.
void scaled_rows_add(at::Tensor& out, const int64_t* rows, at::Tensor& y, const float* weights);

// x [M, K] @ weight [N, K]^T * scale [N] + bias [N] -> [M, N] in x's dtype; weight f32, bf16, int8,
// uint8 [N, K / 32 * B]: rows of GGUF blocks of B bytes (18 Q4_0, 20 Q4_1, 22 Q5_0, 24 Q5_1, 34 Q8_0),
// or uint8 [N, K / 256, B]: rows of K-quant super-blocks (144 Q4_K, 176 Q5_K, 210 Q6_K), or a stacked
// weight, parts of such formats one after another: uint8 [total] with its layout int64 [parts, 2],
// each part's rows and bytes per block, in the scale's place (a fused projection whose parts a file
// holds in different formats). Block weights with q8_activations multiply x quantized per block of
// 32 to 8 bits (where q8_activations_supported()).
at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& scale,
                       const c10::optional<at::Tensor>& bias, bool q8_activations = false);
// linear_rows over x with the (weight, scale, bias) at w[i], w[i+1], w[i+2] of a kernel's list of
// weights (layers.cpp, experts.cpp, ...); a missing weight is an error naming `op` and i.
at::Tensor linear_at(const at::Tensor& x, const c10::List<c10::optional<at::Tensor>>& w, int64_t i, bool q8_activations,
                     const char* op);
// Whether this build (the CPU it was compiled for) has linear_rows' 8-bit activation path.
bool q8_activations_supported();

// uint8 blocks [N, K / 32 * B] (or K-quant super-blocks [N, K / 256, B], or a stacked weight with its
// layout) as linear_rows reads them -> f32 [N, K].
at::Tensor dequantize_blocks(const at::Tensor& weight, int64_t K, const c10::optional<at::Tensor>& layout);

// linear_rows' product for a K-quant weight, uint8 [N, K / 256, B] (kquants.cpp): x f32 [M, K]
// contiguous, bias [N] or null, out [M, N] with rows ldo apart. check_super_blocks names a weight of
// any other shape.
int64_t check_super_blocks(const at::Tensor& weight, int64_t K, const char* op);
void super_block_rows(const float* x, int64_t M, int64_t K, const at::Tensor& weight, const float* bias, float* out,
                      int64_t ldo, bool q8_activations);
at::Tensor dequantize_super_blocks(const at::Tensor& weight, int64_t K);

// weight * round(x / rms(x)) over the last axis, or over each run of `group` values along it (its
// residual streams' norm, hyper_connections.cpp), weight then covering the whole axis.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, int64_t group = 0);

// Rotates x [N, H, D] in place (unit stride along D); cos, sin [N, D].
void rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin);

// Where slot s's position l lies in a cache layer. Slot-major ([S, KVH, C, D], no page table): at
// [s, :, l]. A unified pool ([1, KVH, P, D] with a page table [S, pages] of int64): slot s's
// positions fill its pages in order, pages[s][i] holding positions i * page .. i * page + page-1,
// so row l sits at [0, :, pages[s][l / page] * page + l % page]. A page is a power of two of at
// least 16 rows, so 16 aligned positions are always one run of rows.
struct Layout {
  const int64_t* pages = nullptr;
  int64_t pages_per_slot = 0, shift = 0;

  // The layout of cache layer k for the optional page table (which the caller has checked).
  static Layout of(const at::Tensor& k, const c10::optional<at::Tensor>& pages);
  // Where kv head g of slot s starts in t, a tensor of the layer shaped as k's leading axes (its
  // keys or values, or a q8_0 layer's scales), in elements.
  int64_t head_offset(const at::Tensor& t, int64_t s, int64_t g) const {
    return (pages ? 0 : s * t.stride(0)) + g * t.stride(1);
  }
  int64_t row(int64_t s, int64_t l) const {
    if (!pages) return l;
    return (pages[s * pages_per_slot + (l >> shift)] << shift) | (l & ((int64_t{1} << shift) - 1));
  }
};

// Checks a page table for cache layer k [1, KVH, P, D]: [S, P / page] int64, contiguous, page a
// power of two >= 16; returns the slots it has (S). Without one, k's own slots.
int64_t check_pages(const at::Tensor& k, const c10::optional<at::Tensor>& pages, const char* op);

// Checks that the pages slot s's first `length` positions lie in are pages of a pool of `pool`
// positions (nothing to check without a page table).
void check_rows(const c10::optional<at::Tensor>& pages, int64_t s, int64_t length, int64_t pool, const char* op);

// A q8_0 cache layer (engine/model/kv_cache.py Q8Storage): values int8 [..., D] and one f16 scale
// per block of 32 values, or per row where D is not a multiple of 32, scales [..., D / block].
int64_t q8_block(int64_t D);
// Checks values and scales as a q8_0 layer: int8 and f16, contiguous, scales [..., D / q8_block(D)].
void check_q8(const at::Tensor& values, const at::Tensor& scales, const char* op);
// values, scales -> f32 [..., D], the numbers Q8Storage reads back.
at::Tensor dequantize_q8(const at::Tensor& values, const at::Tensor& scales);
// One row of D floats into q8_0 as Q8Storage writes it: each block's scale the f16 of its largest
// magnitude / 127, each value round-half-even(x / scale) within +-127 (0 for a zero block).
void quantize_q8_row(const float* x, int8_t* values, at::Half* scales, int64_t D);

// q [R, H, D], one query per row, against positions 0 .. lengths[r]-2 and last[r] (default
// lengths[r]-1) of slot slots[r] of a cache layer k, v [S, KVH, C, D] (or a pool through `pages`,
// see Layout) -> [R, H, D]. k_scale, v_scale: given for a q8_0 layer (k and v int8, q f32).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
                            const at::Tensor& lengths, double scale, const c10::optional<at::Tensor>& last,
                            const c10::optional<at::Tensor>& pages, const c10::optional<at::Tensor>& k_scale,
                            const c10::optional<at::Tensor>& v_scale);

// A Gated DeltaNet layer's rule token by token (gated_delta.cpp): proj [N, C + H Dv + 2H] f32, its
// input projection; token n at positions[n] of slot slots[n] (a slot's tokens in order); the stores
// conv [S, R, K-1, C] and state [S, R, H, Dk, Dv] -> [N, H, Dv].
at::Tensor gated_delta_rows(const at::Tensor& proj, int64_t key_dim, const at::Tensor& conv_weight,
                            const at::Tensor& A, const at::Tensor& dt_bias, const at::Tensor& k_head,
                            at::Tensor conv_store, at::Tensor state_store, const at::Tensor& slots,
                            const at::Tensor& positions);

// One query q [H, D] f32 against the keys and values at rows[0 .. m-1] of a slot's storage k, v
// [KVH, rows, D] f32 (last axis contiguous) -> [H, D] (attention.cpp): a QSA query past its budget.
at::Tensor attend_at(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& rows,
                     double scale);

// QSA's block scores (qsa.cpp): q [T, H, D], blocks [KVH, n, D] -> [T, n] f32, each query's the
// same numbers whatever other queries share the call.
at::Tensor block_scores(const at::Tensor& q, const at::Tensor& blocks);

// A hyper-connection's halves (hyper_connections.cpp): x [N, streams * hidden] -> (the block's input
// [N, hidden], the normed streams), weights the down and up maps' (weight, scale, bias); and x with
// the block's output `out` injected into each stream, weights the inject map's.
std::tuple<at::Tensor, at::Tensor> hyper_mix(const at::Tensor& x, const at::Tensor& norm_weight,
                                             const c10::List<c10::optional<at::Tensor>>& weights, int64_t streams,
                                             double eps, bool q8);
at::Tensor hyper_inject(const at::Tensor& x, const at::Tensor& normed, const at::Tensor& out,
                        const c10::List<c10::optional<at::Tensor>>& weights, int64_t streams, bool q8);

// A mixture-of-experts MLP over x [N, hidden] (experts.cpp): weights the router's, the shared
// expert's gate and MLP, then each routed expert's gate_up and down, as (weight, scale, bias).
at::Tensor experts_rows(const at::Tensor& x, const c10::List<c10::optional<at::Tensor>>& weights, int64_t top_k,
                        bool norm_top_k, bool q8);

// A Gated DeltaNet layer's mixer over h [N, hidden], each token a row (layers.cpp): weights the
// input projection's and out_proj's (weight, scale, bias); tensors its convolution, A, dt_bias,
// k_head, gated norm weight and its stores conv and state, as decoder_layers takes them.
at::Tensor gated_delta_mixer(const at::Tensor& h, const c10::List<c10::optional<at::Tensor>>& weights,
                             const c10::List<c10::optional<at::Tensor>>& tensors, const at::Tensor& slots,
                             const at::Tensor& positions, double eps, bool sigmoid_gate, bool q8_activations);

}  // namespace tandem
