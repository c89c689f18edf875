"""`python -m bench.quality`: what a weight format and an activation precision cost in quality,
measured as llama.cpp's llama-perplexity measures it, so that the two figures stand side by side.

    python -m bench.quality [-m default] [--text /usr/share/common-licenses/GPL-3] [--ctx 512]
                            [--chunks 8] [--systems auto:f32 auto:q8] [--llama-bin DIR]

The text is read in --chunks chunks of --ctx tokens, each a fresh context; the second half of each
chunk is scored (llama-perplexity's rule: every scored token sees at least ctx/2 before it). Each
system, DTYPE:ACTIVATIONS, reads the same tokens, its weights loaded as the server loads them; the
reference is f32:f32 (every tensor of the file dequantized exactly, f32 activations), so a block
system's figures include what holding a K-quant in the nearest served block format costs. Printed per system: perplexity, the mean KL divergence of each scored
position's next-token distribution from the reference's (KL(reference || system), as
llama-perplexity --kl-divergence), and how often the two argmaxes agree.

--llama-bin DIR (the folder of llama.cpp's tools, built as docs/benchmarks.md "The anchor" says): also
llama-perplexity on the same file, text, --ctx and --chunks, its KL against an F32 copy of the file
that llama-quantize makes (--allow-requantize F32): llama.cpp's own figure for its own activations.
"""
from __future__ import annotations

import argparse
import math
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.files.nearest_format import stored_formats
from engine.files.tokenizer import Tokenizer
from engine.files.weights import open_model
from engine.model.batch import ForwardBatch, Row
from engine.model.kv_cache import KVCache
from engine.model.transformer import Transformer
from engine.ops.quant import keeps_blocks, resolve_activations, use_activations

TEXT = Path("/usr/share/common-licenses/GPL-3")
REFERENCE = "f32:f32"


@dataclass
class Quality:
    system: str
    perplexity: float
    kl: float  # mean KL(reference || system) over the scored positions, nats
    agreement: float  # share of scored positions whose argmax is the reference's


def chunks_of(ids: list[int], ctx: int, chunks: int) -> list[list[int]]:
    n = min(chunks, len(ids) // ctx)
    if n == 0:
        raise SystemExit(f"the text has {len(ids)} tokens: fewer than one chunk of --ctx {ctx}")
    return [ids[i * ctx:(i + 1) * ctx] for i in range(n)]


@torch.inference_mode()
def scored_logprobs(model: Transformer, chunks: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities [positions, vocab] at the scored positions, their next tokens [positions])."""
    c = model.config
    logps, targets = [], []
    for chunk in chunks:
        cache = KVCache(c.num_layers, 1, len(chunk), c.num_kv_heads, c.head_dim, model.compute_dtype,
                        specs=model.specs)
        logits = model.logits(model(ForwardBatch.build([Row(0, 0, chunk)]), cache))
        first = len(chunk) // 2
        logps.append(torch.log_softmax(logits[first:-1].float(), -1))
        targets.append(torch.tensor(chunk[first + 1:]))
    return torch.cat(logps), torch.cat(targets)


def compare(system: str, logp: torch.Tensor, targets: torch.Tensor, ref: torch.Tensor) -> Quality:
    nll = -logp[torch.arange(len(targets)), targets].mean().item()
    kl = (ref.exp() * (ref - logp)).sum(-1).mean().item()
    agreement = (logp.argmax(-1) == ref.argmax(-1)).float().mean().item()
    return Quality(system, math.exp(nll), kl, agreement)


def measure(model_name: str, systems: list[str], ctx: int, chunks: int, text: Path) -> list[Quality]:
    files = open_model(model_name)
    ids = Tokenizer.load(files).encode(text.read_text())
    parts = chunks_of(ids, ctx, chunks)
    readings = {}
    for system in [REFERENCE, *[s for s in systems if s != REFERENCE]]:
        dtype, activations = system.split(":")
        # As the server loads it: f32 reads the file's types dequantized exactly, a block dtype
        # keeps blocks (a K-quant in the nearest block format the kernels read).
        tensors = files.load_tensors(keep_blocks=keeps_blocks(dtype))
        model = Transformer(files.config, tensors, dtype, max_positions=ctx)
        use_activations(model, resolve_activations(activations, dtype, stored_formats(files)))
        readings[system] = scored_logprobs(model, parts)
    ref, targets = readings[REFERENCE]
    return [compare(s, readings[s][0], targets, ref) for s in readings]


def llama_figures(bin_dir: Path, gguf: Path, text: Path, ctx: int, chunks: int) -> Quality:
    """llama-perplexity's perplexity, mean KL from the F32 copy and top-1 agreement with it, on the file."""
    with tempfile.TemporaryDirectory() as tmp:
        f32, base = Path(tmp) / "f32.gguf", Path(tmp) / "base.kld"
        subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", str(gguf), str(f32), "F32"],
                       check=True, capture_output=True)
        common = ["-f", str(text), "-c", str(ctx), "--chunks", str(chunks), "-t", str(torch.get_num_threads())]
        subprocess.run([str(bin_dir / "llama-perplexity"), "-m", str(f32), "--kl-divergence-base", str(base), *common],
                       check=True, capture_output=True)
        out = subprocess.run([str(bin_dir / "llama-perplexity"), "-m", str(gguf), "--kl-divergence-base", str(base),
                              "--kl-divergence", *common], check=True, capture_output=True, text=True)
    log = out.stdout + out.stderr
    ppl = re.search(r"Mean PPL\(Q\)\s*:\s*([\d.]+)", log) or re.search(r"PPL = ([\d.]+)", log)
    kl = re.search(r"Mean\s+KLD:\s*([\d.]+)", log)
    same = re.search(r"Same top p:\s*([\d.]+)", log)
    if not ppl or not kl or not same:
        raise SystemExit(f"llama-perplexity printed no PPL, KLD or top-1 agreement:\n{log[-2000:]}")
    return Quality("llama-perplexity", float(ppl.group(1)), float(kl.group(1)), float(same.group(1)) / 100)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.quality", description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default="default")
    p.add_argument("--text", type=Path, default=TEXT)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--systems", nargs="+", default=["auto:f32", "auto:q8"], help="DTYPE:ACTIVATIONS each")
    p.add_argument("--llama-bin", type=Path, help="folder of llama-perplexity and llama-quantize")
    p.add_argument("-t", "--threads", type=int)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    rows = measure(a.model, a.systems, a.ctx, a.chunks, a.text)
    print(f"{a.model}, {a.text.name}, {a.chunks} chunks of {a.ctx} tokens (second halves scored)")
    print(f"| system | perplexity | KL from {REFERENCE} | top-1 agreement |\n|---|---:|---:|---:|")
    for q in rows:
        print(f"| tandem {q.system} | {q.perplexity:.4f} | {q.kl:.6f} | {q.agreement:.4f} |")
    if a.llama_bin:
        q = llama_figures(a.llama_bin, open_model(a.model).path, a.text, a.ctx, a.chunks)
        print(f"| llama-perplexity, the file (its own activations) | {q.perplexity:.4f} | {q.kl:.6f} | "
              f"{q.agreement:.4f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
