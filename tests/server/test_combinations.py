"""The whole shape composes: every pair of the options below, and the seed's full shape, starts,
serves through HTTP and answers greedy requests with the tokens of the same format's plain greedy
(no speculation, one slot, one process, one device), by the exact-token rule, and so does a greedy
answer held to a JSON schema (its matcher on the head, whatever the stages); where drafting was
asked for, `timings` report drafts.

Options: weight format {f32, int8, auto} x speculation {none, draft-mtp, draft-mtp-ngram as a
chain and as trees of width 3} x attention {dense, QSA every4:4 under a budget the prompts exceed}
x slots {one, 4 sharing a pool with 2 requests at once} x processes {one, -pp 2} x devices {one,
`--devices cpu,cpu`}. The f32 and int8 cells run the eight-layer tiny Llama and its untrained MTP
draft (most drafts rejected: the rollback is exercised every step); `auto` is the default model's
own Q4_1 file (on the tiny model's f32 file it is f32 again), in a cell here with its trained draft,
whose trees keep siblings, and in the README's commands (tests/test_readme.py) and the seed's
profile (tests/proxy/test_seed_profile.py) beside it.
"""
from __future__ import annotations

import itertools
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from engine.engine import Engine
from engine.sched.grammar import GrammarSpec
from engine.sched.sampling import SamplingParams
from engine.settings import CompressRatios, EngineConfig
from tests.engine.runs import run_all
from tests.engine.test_generation import chat_ids
from tests.engine.test_qsa_engine import write_llama8_with_drafts
from tests.exact_tokens import assert_same_greedy, next_token_logits, under_grammar

TOKENS = 24
PROMPTS = ["Tell me about the tide that comes in twice a day and leaves shells along the sand of the bay.",
           "Describe a lantern in the window of the harbour master's house, lit every night for forty years."]
SPEC = {"none": ["--spec-type", "none"],
        "draft-mtp": ["--spec-type", "draft-mtp"],
        "draft-mtp-ngram": ["--spec-type", "draft-mtp-ngram"],
        "draft-mtp-ngram, width 3": ["--spec-type", "draft-mtp-ngram", "--spec-draft-width", "3",
                                     "--spec-draft-p-sibling", "0"]}
# Drafts at every step, whatever the draft's confidence, for both slots at once: the verify paths run.
DRAFT_EVERY_STEP = ["--spec-draft-p-min", "0", "--no-spec-pacing", "--spec-max-batch", "0"]
SLOTS = {"1 slot": ["-np", "1"], "4 unified slots": ["-np", "4", "--kv-unified"], "2 slots": ["-np", "2"]}
PROCESSES = {"1 process": [], "-pp 2": ["-pp", "2"]}
DEVICES = {"cpu": [], "cpu,cpu": ["--devices", "cpu,cpu"]}
# QSA on every fourth layer, under a budget the prompts exceed (a chat turn of either prompt is
# over 100 tokens on both models).
BUDGET = {"tiny": 8, "default": 16}


# Compact JSON (no whitespace between tokens) with bounded strings: the random tiny model finishes it.
SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 3},
                                                    "maxItems": 2}},
          "required": ["colour", "count", "tags"], "x-guidance": {"whitespace_flexible": False, "whitespace_pattern": None}}
SCHEMA_TOKENS = 96
GRAMMAR = GrammarSpec.json_schema(SCHEMA, "response_format")


@dataclass(frozen=True)
class Cell:
    dtype: str
    spec: str
    qsa: bool
    slots: str
    processes: str
    devices: str
    draft_rank: bool = False

    @property
    def model(self) -> str:
        return "default" if self.dtype == "auto" else "tiny"

    def args(self, tiny_path) -> list[str]:
        model = ["-m", "default"] if self.model == "default" else ["-m", str(tiny_path)]
        draft = [] if self.spec == "none" else \
            [*DRAFT_EVERY_STEP, "-md", "default" if self.model == "default" else str(tiny_path / "draft.safetensors")]
        qsa = ["--compress-ratios", "every4:4", "--qsa-budget", str(BUDGET[self.model])] if self.qsa else []
        return [*model, "--dtype", self.dtype, "-c", "1024", *SPEC[self.spec], *draft, *qsa, *SLOTS[self.slots],
                *PROCESSES[self.processes], *DEVICES[self.devices], *(["--spec-draft-rank"] if self.draft_rank else [])]

    def __str__(self) -> str:
        return ", ".join([self.dtype, self.spec, "qsa" if self.qsa else "dense", self.slots, self.processes,
                          self.devices] + (["the draft on its own rank"] if self.draft_rank else []))


PAIRWISE = [  # every pair of the tiny model's options at least once (checked below)
    Cell("f32", "draft-mtp", False, "1 slot", "1 process", "cpu"),
    Cell("f32", "draft-mtp-ngram", False, "4 unified slots", "1 process", "cpu"),
    Cell("f32", "draft-mtp-ngram, width 3", True, "4 unified slots", "1 process", "cpu,cpu"),
    Cell("f32", "none", True, "4 unified slots", "-pp 2", "cpu"),
    Cell("int8", "draft-mtp", True, "4 unified slots", "-pp 2", "cpu,cpu"),
    Cell("int8", "draft-mtp-ngram", True, "1 slot", "-pp 2", "cpu,cpu"),
    Cell("int8", "draft-mtp-ngram, width 3", False, "1 slot", "-pp 2", "cpu"),
    Cell("int8", "none", False, "1 slot", "1 process", "cpu,cpu"),
]
CELLS = PAIRWISE + [
    # The seed's shape: a QSA trunk beside a dense MTP draft, 2 slots, 2 stages, the draft on its own rank.
    Cell("f32", "draft-mtp", True, "2 slots", "-pp 2", "cpu", draft_rank=True),
    # The default model's trained draft keeps siblings: trees over QSA layers across two stages.
    Cell("auto", "draft-mtp-ngram, width 3", True, "4 unified slots", "-pp 2", "cpu"),
]


def test_the_tiny_cells_cover_every_pair_of_options():
    options = [("f32", "int8"), tuple(SPEC), (False, True), ("1 slot", "4 unified slots"), tuple(PROCESSES),
               tuple(DEVICES)]
    rows = [(c.dtype, c.spec, c.qsa, c.slots, c.processes, c.devices) for c in PAIRWISE]
    for i, j in itertools.combinations(range(len(options)), 2):
        missing = set(itertools.product(options[i], options[j])) - {(r[i], r[j]) for r in rows}
        assert not missing, f"options {i} and {j}: no cell has {sorted(missing)}"


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_llama8_with_drafts(tmp_path_factory.mktemp("llama8"))


@pytest.fixture(scope="module")
def plain(tiny_path):
    """Per (format, QSA or not): an engine without speculation, one slot, in this process; each
    prompt's chat ids and greedy answer there, and the engine's next-token logits for the
    exact-token rule."""
    references = {}

    def reference(cell: Cell):
        key = (cell.dtype, cell.qsa)
        if key not in references:
            qsa = dict(compress_ratios=CompressRatios.parse("every4:4"), qsa_budget=BUDGET[cell.model]) if cell.qsa else {}
            engine = Engine.load(EngineConfig(model="default" if cell.model == "default" else str(tiny_path),
                                              dtype=cell.dtype, ctx_size=1024, parallel=1, **qsa))
            ids = [chat_ids(engine, p) for p in PROMPTS]
            assert all(len(i) > 2 * BUDGET[cell.model] for i in ids)
            answers = [r.output_ids for r in
                       run_all(engine, ids, SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True))]
            [held] = run_all(engine, ids[:1], SamplingParams(temperature=0, max_tokens=SCHEMA_TOKENS), grammar=GRAMMAR)
            logits = next_token_logits(engine.model)
            references[key] = ids, answers, logits, held.output_ids, \
                under_grammar(logits, lambda: engine.grammars.constraint(GRAMMAR), len(ids[0]))
        return references[key]
    return reference


def chat(server, prompt: str, **fields) -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": TOKENS, "temperature": 0,
            "ignore_eos": True, "cache_prompt": False, "logprobs": True, **fields}
    with server.client() as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("cell", CELLS, ids=str)
def test_each_cell_starts_serves_and_answers_plain_greedys_tokens(start_server, tiny_path, plain, cell):
    ids, expected, logits, held_expected, held_logits = plain(cell)
    server = start_server(cell.args(tiny_path))
    try:
        with ThreadPoolExecutor(2 if cell.slots != "1 slot" else 1) as pool:
            answers = list(pool.map(lambda p: chat(server, p), PROMPTS))
        held = chat(server, PROMPTS[0], max_tokens=SCHEMA_TOKENS, ignore_eos=False,
                    response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}})
        with server.client() as c:
            props = c.get("/props").json()
            metrics = c.get("/metrics").text
    finally:
        server.kill()
    for answer, prompt_ids, want in zip(answers, ids, expected):
        got = [entry["id"] for entry in answer["choices"][0]["logprobs"]["content"]]
        assert len(got) == TOKENS
        assert_same_greedy(got, want, prompt_ids, logits)
        if cell.spec != "none":
            assert answer["timings"]["draft_n"] > 0, "drafting was asked for and nothing was drafted"
    assert_same_greedy([e["id"] for e in held["choices"][0]["logprobs"]["content"]], held_expected, ids[0],
                       held_logits)
    assert held["choices"][0]["finish_reason"] == "stop", "the schema's answer did not end with the grammar"
    assert props["stages"] == (2 if cell.processes == "-pp 2" or cell.devices == "cpu,cpu" else 1)
    assert props["speculative"]["type"] == (None if cell.spec == "none" else cell.spec.split(",")[0])
    assert props["draft_rank"] == (2 if cell.draft_rank else None if cell.spec == "none" else 0)
    if cell.model == "default" and "width" in cell.spec:
        kept = re.search(r"^tandem:draft_siblings_kept_total (\d+)$", metrics, re.M)
        assert int(kept.group(1)) > 0, "no sibling was kept: no tree's move was served"
