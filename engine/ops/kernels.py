"""tandem's own CPU kernels (engine/ops/csrc), compiled on first use for the CPU they run on.

The build is cached (torch's extension directory, keyed by source and CPU), so only the first
load on a machine pays the compile, about a minute. Where no compiler is available the engine
falls back to torch's kernels and says so once: slower, same results.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path

import torch

from engine import cpu

log = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc"
SOURCES = sorted(CSRC.glob("*.cpp"))


def _build_name() -> str:
    # -march=native code must not be reused on another CPU: the CPU's flags are part of the name.
    # So is the sources' folder: torch's build files name the sources by path, so two checkouts
    # sharing one build would each rebuild it whenever the other had built last.
    digest = hashlib.sha256(cpu.flags().encode() + str(CSRC.resolve()).encode())
    for source in sorted(CSRC.glob("*.[ch]*")):  # the header too: every source includes it
        digest.update(source.read_bytes())
    return f"tandem_kernels_{digest.hexdigest()[:12]}"


@functools.cache
def available() -> bool:
    """Compiles (or finds the cached build of) the kernels and registers torch.ops.tandem."""
    if os.environ.get("TANDEM_NO_KERNELS"):
        return False
    try:
        import ninja  # the build runs through ninja; its wheel puts the binary here
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    try:
        from torch.utils.cpp_extension import load
        # -fopenmp: at::parallel_for runs on torch's own OpenMP pool (one runtime, same SONAME).
        load(name=_build_name(), sources=[str(s) for s in SOURCES], extra_cflags=["-O3", "-march=native", "-fopenmp"],
             extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
        return True
    except Exception as e:  # no compiler, no headers: torch's kernels still give the same results
        log.warning("tandem kernels unavailable, using torch's (slower at decode): %s", e)
        return False


def usable(x: torch.Tensor | None = None) -> bool:
    """Whether to run the kernels now: they are built, this is plain inference, and `x` (the tensor
    the kernel would read, when the caller has one) lies in CPU memory. They have no backward and
    do not follow autocast, so training and evaluation under autocast (e.g. `python -m train`) run
    on torch's ops; so do the stages on other devices (engine/placement.py)."""
    return available() and not torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu") \
        and (x is None or x.is_cpu)


def _ops():
    if not available():
        raise RuntimeError("tandem kernels are not built on this machine (see the warning above)")
    return torch.ops.tandem


@functools.cache
def q8_activations_supported() -> bool:
    """Whether the kernels were built with an 8-bit activation path (AVX-512 VNNI and VBMI, or AVX2)."""
    return available() and torch.ops.tandem.q8_activations_supported()


@functools.cache
def q8_activations_cover(fmt: str) -> bool:
    """Whether 8-bit activations reach the products of block format `fmt`: every format with AVX-512
    VNNI and VBMI; with AVX2, the 32-weight blocks, the K-quants' super-blocks keeping f32 activations."""
    from engine.ops.blocks import SUPER_BYTES
    return q8_activations_supported() and (fmt not in SUPER_BYTES or torch.ops.tandem.q8_super_blocks_supported())


def linear_rows(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
                bias: torch.Tensor | None, q8_activations: bool = False) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T * scale [N] + bias [N] -> [M, N] in x's dtype, for small M.

    weight is f32, bf16 or int8 [N, K], or uint8 [N, K / 32 * B]: each row K / 32 GGUF blocks of
    B bytes, B naming the format (18 q4_0, 20 q4_1, 22 q5_0, 24 q5_1, 34 q8_0; engine/ops/blocks.py has the
    layouts), or uint8 [N, K / 256, B]: K-quant super-blocks (144 q4_k, 176 q5_k, 210 q6_k), so a block
    weight travels through the whole-layer kernel in the same slot as any other, scale None; or a
    stacked weight's bytes [total], its layout in the scale's place (blocks.StackedBlocks).
    q8_activations: a block weight multiplies x quantized per block of 32 to 8 bits, in integer dot
    products (where q8_activations_supported(); docs/architecture.md, "Weight formats").
    """
    return _ops().linear_rows(x, weight, scale, bias, q8_activations)


def dequantize_blocks(weight: torch.Tensor, cols: int, layout: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 GGUF blocks (as linear_rows reads them; a stacked weight with its layout) -> f32
    [N, cols], the same numbers as engine.ops.blocks.dequantize."""
    return _ops().dequantize_blocks(weight, cols, layout)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, group: int = 0) -> torch.Tensor:
    """weight * x / rms(x) over the last axis, or over each run of `group` values along it."""
    return _ops().rms_norm(x, weight, eps, group)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotates x [N, H, D] in place; cos, sin [N, D]."""
    _ops().rope_(x, cos, sin)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                     lengths: torch.Tensor, scale: float, last: torch.Tensor | None = None,
                     pages: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One query per row and head, q [R, H, D], against the first lengths[r] positions of slot
    slots[r] of a cache layer k, v [S, KVH, C, D] -> [R, H, D]. last: where each row's own key
    lies when not at lengths[r]-1 (a tree node's scratch position); the row then attends to
    positions 0 .. lengths[r]-2 and last[r], as it would if it stood at lengths[r]-1.
    pages: a unified pool's page table [slots, pages] int64, k and v then [1, KVH, P, D] with
    slot s's position l at row pages[s][l // page] * page + l % page (page = P // pages).
    k_scale, v_scale: a q8_0 layer's f16 scales (engine/model/kv_cache.py Q8Storage), k and v then its
    int8 values and q f32."""
    return _ops().decode_attention(q, k, v, slots, lengths, scale, last, pages, k_scale, v_scale)


def quantize_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """f32 rows [..., D] -> (int8 [..., D], f16 scales [..., D // block]) as decoder_layers writes a
    q8_0 cache; equal to Q8Storage's own quantization."""
    return _ops().quantize_q8(x)


def decoder_layers(x: torch.Tensor, weights: list[torch.Tensor | None], k_cache: list[torch.Tensor],
                   v_cache: list[torch.Tensor], k_scales: list[torch.Tensor | None],
                   v_scales: list[torch.Tensor | None], kpools: list[torch.Tensor | None], ratios: list[int],
                   budgets: list[int], slots: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, heads: int, kv_heads: int, eps: float,
                   rope_positions: torch.Tensor | None = None, pages: torch.Tensor | None = None,
                   linear_layers: list[torch.Tensor | None] | None = None,
                   q8_activations: bool = False) -> torch.Tensor:
    """Decoder layers over x [N, hidden], each token a row at positions[n] of slot slots[n]: it
    writes its K/V there and attends causally to its slot. weights: each layer's kernel_weights,
    concatenated; k_cache, v_cache: each layer's [S, KVH, C, D], and k_scales, v_scales its q8_0
    scales where it holds q8_0 (None where floats); cos, sin [N, D]. Per layer, its
    LayerSpec's ratio and budget (0 and 0 for a dense layer) and, for a QSA layer, its pooled keys
    [S, KVH, C // ratio, D] f32 (None for a dense one), which the rows' completed blocks update.
    rope_positions: a tree's verify rows: token n, written at positions[n], standing at rope_positions[n],
    attends to 0 .. rope_positions[n]-1 and then itself (engine/model/batch.py tree_mask).
    pages: a unified pool's page table, as decode_attention takes it, each layer's cache then one
    pool [1, KVH, P, D] (and its pooled keys [1, KVH, P // ratio, D]).
    A gated attention layer (Qwen3.5) gives its output gates after q, k and v in its fused projection,
    and cos, sin [N, R] may turn fewer dims than D (partial RoPE). linear_layers: per layer a linear-
    attention layer's 7 tensors (its convolution, A, dt_bias, each value head's key head, the gated
    norm's weight, its conv and state stores: engine/model/gated_delta.py) or 7 None for an attention
    layer, whose K/V cache entries then stand in (unread) for its own. q8_activations: as linear_rows'."""
    return _ops().decoder_layers(x, weights, k_cache, v_cache, k_scales, v_scales, kpools, ratios, budgets, slots,
                                 positions, cos, sin,
                                 heads, kv_heads, eps, rope_positions, pages, linear_layers, q8_activations)


def attend_at(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, scale: float) -> torch.Tensor:
    """One query q [H, D] against the keys and values at `rows` of a slot's storage k, v [KVH, rows,
    D] (f32, read in place: a QSA query's selected positions) -> [H, D]."""
    return _ops().attend_at(q, k, v, rows, scale)


def block_scores(q: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """QSA's block scores (engine/model/qsa.py `scores`): q [T, H, D], blocks [KVH, n, D] -> [T, n],
    each score's additions in one order whatever the call's T."""
    return _ops().block_scores(q, blocks)


def experts_rows(x: torch.Tensor, weights: list[torch.Tensor | None], top_k: int, norm_top_k: bool,
                 q8_activations: bool = False) -> torch.Tensor:
    """A mixture-of-experts MLP over x [N, hidden] as engine/model/experts.py computes it, for small
    N: weights (weight, scale, bias) per linear layer, the router's, the shared expert's gate, its
    gate_up and down, then each expert's gate_up and down. q8_activations: as linear_rows'."""
    return _ops().experts_rows(x, weights, top_k, norm_top_k, q8_activations)


def gated_delta_mixer(h: torch.Tensor, weights: list[torch.Tensor | None], tensors: list[torch.Tensor | None],
                      slots: torch.Tensor, positions: torch.Tensor, eps: float, sigmoid_gate: bool,
                      q8_activations: bool = False) -> torch.Tensor:
    """A Gated DeltaNet mixer over h [N, hidden], each token a row at positions[n] of slot slots[n]
    (its states written), as decoder_layers runs a linear-attention layer's: weights, the input
    projection's and out_proj's (weight, scale, bias); tensors, the layer's 7 as decoder_layers'
    linear_layers takes them; the output gate the sigmoid (sigmoid_gate) or SiLU."""
    return _ops().gated_delta_mixer(h, weights, tensors, slots, positions, eps, sigmoid_gate, q8_activations)


def hyper_mix(x: torch.Tensor, norm_weight: torch.Tensor, weights: list[torch.Tensor | None], streams: int,
              eps: float, q8_activations: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A hyper-connection's input half as engine/model/hyper_connections.py computes it, for small N:
    x [N, streams * hidden] -> (the block's input [N, hidden], the normed streams); weights: the
    down and up maps' (weight, scale, bias). q8_activations: as linear_rows'."""
    return _ops().hyper_mix(x, norm_weight, weights, streams, eps, q8_activations)


def hyper_inject(x: torch.Tensor, normed: torch.Tensor, out: torch.Tensor, weights: list[torch.Tensor | None],
                 streams: int, q8_activations: bool = False) -> torch.Tensor:
    """Its output half: x with the block's output out [N, hidden] added to every stream, scaled by
    the inject map's (weight, scale, bias) on the normed streams."""
    return _ops().hyper_inject(x, normed, out, weights, streams, q8_activations)


def gated_delta_rows(proj: torch.Tensor, key_dim: int, conv_weight: torch.Tensor, A: torch.Tensor,
                     dt_bias: torch.Tensor, k_head: torch.Tensor, conv_store: torch.Tensor, state_store: torch.Tensor,
                     slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A Gated DeltaNet layer's rule token by token (engine/model/gated_delta.py): proj [N, C + Dv H +
    2H] f32, its input projection [qkv | z | b | a]; token n at positions[n] of slot slots[n], a slot's
    tokens in order; the layer's stores conv [S, R, K-1, C] and state [S, R, H, Dk, Dv], entry p % R
    the state after position p (read at p - 1, written at p). -> [N, H, Dv], the rule's outputs."""
    return _ops().gated_delta_rows(proj, key_dim, conv_weight, A, dt_bias, k_head, conv_store, state_store, slots,
                                   positions)
