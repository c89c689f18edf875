"""Qwen4-Exp GGUF files as llama.cpp's own converter writes them (tests/fixtures/qwen4_exp, remade by
its remake.py; the converter leaves the MTP layer out): tandem reads them as the checkpoint they came
from (experts as three merged tensors, the indexer's projection as two, the n-gram table and its
hash constants from the metadata), so past the QSA budget it computes transformers' selection
(tests/engine/test_qwen4_exp.py). llama-server's selection is not transformers': it keeps the top
budget + ratio - 1 tokens, where the reference keeps budget/ratio whole blocks and the query's tail,
so a query whose tail is short also attends to a few tokens of the next-best block, which ones
decided by the order std::partial_sort leaves equal scores in (docs/architecture.md, "Qwen4-Exp
GGUF files"). So tandem gives llama-server's greedy tokens on every prompt with a budget past the
context, and with the budget of 8 up to where llama.cpp's selection leaves the reference's."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.engine import Engine
from engine.files.weights import open_model
from engine.model.batch import Row
from engine.sched.sampling import SamplingParams
from engine.settings import EngineConfig, SpecConfig
from tests.engine.runs import run_all
from tests.engine.test_parity import assert_matches, load_engine_model, new_cache, one_thread, reference, step  # noqa: F401
from tests.exact_tokens import assert_same_greedy, next_token_logits

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "qwen4_exp"
MODEL = FIXTURES / "tiny-qwen4_exp-f32.gguf"
LLAMA = json.loads((FIXTURES / "llama_server.json").read_text())


def test_the_converted_file_reads_as_the_checkpoint_it_came_from(reference):
    ref = reference("qwen4_exp")  # the same seed and config the fixture was converted from
    c = open_model(MODEL).config
    assert (c.experts.count, c.hc_count, c.indexer.ratio, c.ngram.layers, c.linear_gate_act) == \
        (8, 2, 4, (0,), "sigmoid")
    model = load_engine_model(MODEL)
    (logits,), = [step(model, new_cache(model, 1, 4), [Row(0, 0, ref.tokens)])]
    assert_matches(logits, ref.logits)


def greedy(file: str):
    engine = Engine.load(EngineConfig(model=str(FIXTURES / file), dtype="auto", ctx_size=512))
    return engine, run_all(engine, LLAMA["prompts"], SamplingParams(temperature=0, max_tokens=LLAMA["n_predict"],
                                                                    ignore_eos=True))


def test_with_a_budget_past_the_context_greedy_tokens_equal_llama_servers():
    # Every part but the sparse selection: experts, streams, n-grams, Gated DeltaNet, gated attention.
    engine, requests = greedy("tiny-qwen4_exp-f32-budget512.gguf")
    assert engine.model.config.indexer.budget == 512
    for request, theirs in zip(requests, LLAMA["answers"]["f32-wide plain"]):
        assert_same_greedy(request.output_ids, theirs["tokens"], request.prompt_ids, next_token_logits(engine.model))


@pytest.mark.parametrize("fmt", ["f32", "q8_0"])
def test_greedy_tokens_equal_llama_servers_until_its_selection_leaves_the_references(fmt):
    engine, requests = greedy(f"tiny-qwen4_exp-{fmt}.gguf")
    x = engine.model.config.indexer
    agree = x.budget + x.ratio - 1  # positions a query sees while both selections keep them all
    for request, theirs in zip(requests, LLAMA["answers"][f"{fmt} plain"]):
        n = max(0, min(LLAMA["n_predict"], agree - len(request.prompt_ids) + 1))
        assert_same_greedy(request.output_ids[:n], theirs["tokens"][:n], request.prompt_ids,
                           next_token_logits(engine.model))
    # Past it the tokens part on at least one prompt: the comparison above is not vacuous there.
    assert any(r.output_ids != a["tokens"] for r, a in zip(requests, LLAMA["answers"][f"{fmt} plain"]))


def file_maps(path: Path) -> list[tuple[int, int]]:
    """The address ranges this process maps from `path` (Linux's /proc/self/maps)."""
    spans = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and Path(fields[5]) == path.resolve():
            start, end = (int(a, 16) for a in fields[0].split("-"))
            spans.append((start, end))
    return spans


def bf16_copy(checkpoint: Path, out: Path) -> Path:
    """The checkpoint in bf16, as the real model's is published."""
    import shutil
    from safetensors.torch import load_file, save_file
    out.mkdir()
    for f in checkpoint.iterdir():
        if f.suffix == ".safetensors":
            save_file({n: t.bfloat16() if t.is_floating_point() else t for n, t in load_file(f).items()}, out / f.name)
        else:
            shutil.copy(f, out / f.name)
    return out


@pytest.mark.parametrize("source", ["gguf", "bf16 checkpoint"])
def test_the_n_gram_table_is_read_from_the_files_map_in_its_type_never_copied(reference, tmp_path, source):
    # The real model's table is 27 GB (bf16) of which a token reads a few rows: its shards stay in
    # the file's map, in the file's type (the GGUF's one tensor, the checkpoint's shards).
    from engine.ops.blocks import BlockTensor
    path = MODEL if source == "gguf" else bf16_copy(reference("qwen4_exp").path, tmp_path / "bf16")
    tensors = open_model(path).load_tensors()
    spans = file_maps(path if source == "gguf" else next(path.glob("*.safetensors")))

    def mapped(t) -> bool:
        address = (t.data if isinstance(t, BlockTensor) else t).data_ptr()
        return any(start <= address < end for start, end in spans)
    shards = [n for n in tensors if ".ngram_embedding.shard_" in n]
    assert len(shards) == (1 if source == "gguf" else json.loads((path / "config.json").read_text())["split_ngram_parts"])
    assert all(mapped(tensors[n]) for n in shards)
    assert all(tensors[n].dtype == (torch.float32 if source == "gguf" else torch.bfloat16) for n in shards)
    # What a step reads whole is read into memory (widened from bf16, or from a GGUF's map).
    assert not any(mapped(t) for n, t in tensors.items() if n not in shards and t.dtype != torch.int64)


def mtp_only_gguf(checkpoint: Path, trunk_file: Path, out: Path) -> Path:
    """The checkpoint's MTP layer as an MTP-only GGUF in the layout of llama.cpp's qwen4exp MTP export
    (docs/architecture.md, "Qwen4-Exp's own MTP"; the converter these tests run has no such export):
    the trunk file's metadata with one more block (dense, not recurrent) and no n-gram table; the
    block's tensors under the trunk's GGUF names at blk.N, N the trunk's layer count; fc_embedding
    and fc_hidden as one nextn.eh_proj, the norms as nextn.enorm and nextn.hnorm, the head's mixer
    as nextn.hc_head_*; the token embedding, as that export keeps it."""
    import gguf
    from engine.files.qwen4_exp_layout import gguf_name
    files = open_model(checkpoint)
    c, mtp = files.config, files.load_mtp()
    n = c.num_layers
    reader = gguf.GGUFReader(trunk_file)
    attention = next(i for i in range(n) if not c.is_recurrent(i))
    # The GGUF name of each tensor of a trunk attention layer, by tandem's name within the layer.
    gguf_of = {gguf_name(t.name, n, ()).split(".", 3)[3]: t.name.split(".", 2)[2]
               for t in reader.tensors if t.name.startswith(f"blk.{attention}.")}
    writer = gguf.GGUFWriter(str(out), "qwen4exp")
    arch = "qwen4exp."
    replaced = {arch + "block_count": n + 1, arch + "nextn_predict_layers": 1}
    for field in reader.fields.values():
        name = field.name
        if name.startswith("GGUF.") or name == "general.architecture" or name in replaced or \
                name.startswith((arch + "ple.", arch + "embedding_length_per_layer_input")):
            continue
        value = field.contents()
        if name in (arch + "attention.compress_ratios", arch + "attention.recurrent_layers"):
            value = [*value, 0 if name.endswith("compress_ratios") else False]
        array = field.types[0] == gguf.GGUFValueType.ARRAY
        writer.add_key_value(name, value, field.types[0], sub_type=field.types[-1] if array else None)
    for name, value in replaced.items():
        writer.add_uint32(name, value)
    block = f"blk.{n}."
    tensors = {"token_embd.weight": files.read({"model.embed_tokens.weight": (c.vocab_size, c.hidden_size)})
               ["model.embed_tokens.weight"],
               block + "nextn.eh_proj.weight": torch.cat([mtp.pop("mtp.fc_embedding.weight"),
                                                          mtp.pop("mtp.fc_hidden.weight")], dim=1),
               block + "nextn.enorm.weight": mtp.pop("mtp.pre_fc_norm_embedding.weight"),
               block + "nextn.hnorm.weight": mtp.pop("mtp.pre_fc_norm_hidden.weight")}
    for part, own in (("norm", "hc_norm"), ("down", "input_mix_weight_down"), ("up", "input_mix_weight_up")):
        tensors[block + f"nextn.hc_head_{part}.weight"] = mtp.pop(f"mtp.hyper_connection_mixer.{own}.weight")
    gate_up = mtp.pop("mtp.layers.0.mlp.experts.gate_up_proj")
    mtp["mtp.layers.0.mlp.experts.gate_proj"], mtp["mtp.layers.0.mlp.experts.up_proj"] = gate_up.chunk(2, dim=1)
    for name, tensor in mtp.items():
        tensors[block + gguf_of[name[len("mtp.layers.0."):]]] = tensor
    for name, tensor in tensors.items():
        writer.add_tensor(name, tensor.float().contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_an_mtp_only_gguf_given_with_md_drafts_as_the_checkpoints_own_mtp_layer(reference, tmp_path):
    # The GGUF target with its MTP layer from a file of its own proposes, keeps and rolls back what
    # the checkpoint drafting with its own mtp.* does, and its greedy tokens are the plain ones.
    checkpoint = reference("qwen4_exp").path
    draft = mtp_only_gguf(checkpoint, MODEL, tmp_path / "mtp-tiny-qwen4_exp-f32.gguf")
    files = open_model(draft, trunk=False)
    assert not files.has_trunk and files.has_mtp and "mtp.fc.weight" in files.shapes
    spec = dict(type="draft-mtp", n_max=3, p_min=0.0, pacing=False)
    params = SamplingParams(temperature=0, max_tokens=LLAMA["n_predict"], ignore_eos=True)
    answers = {}
    for name, model, config in (("plain", MODEL, None), ("own", checkpoint, SpecConfig(**spec)),
                                ("-md", MODEL, SpecConfig(**spec, draft_model=str(draft)))):
        engine = Engine.load(EngineConfig(model=str(model), ctx_size=512, spec=config))
        answers[name] = [(r.output_ids, r.draft_n, r.draft_n_accepted)
                         for r in run_all(engine, LLAMA["prompts"], params)]
    assert answers["-md"] == answers["own"]
    assert [tokens for tokens, _, _ in answers["-md"]] == [tokens for tokens, _, _ in answers["plain"]]
    drafted, kept = sum(d for _, d, _ in answers["-md"]), sum(a for _, _, a in answers["-md"])
    assert 0 < kept < drafted, "some drafts are kept, some rolled back"


def test_a_q8_0_files_experts_are_served_in_its_blocks():
    # llama-quantize stores the experts as three stacked [experts, rows, cols] Q8_0 tensors; `auto`
    # serves each expert's rows as stored, as it does a matrix's (the greedy tokens: the test above).
    from engine.ops.quant import Linear
    engine = Engine.load(EngineConfig(model=str(FIXTURES / "tiny-qwen4_exp-q8_0.gguf"), dtype="auto", ctx_size=64))
    experts = [m for layer in engine.model.layers for name, m in layer.mlp.experts.named_modules()
               if isinstance(m, Linear)]
    assert len(experts) == 2 * 8 * 4 and {m.dtype for m in experts} == {"q8_0"}
