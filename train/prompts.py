"""The token sequences the target runs over to make training data: chat prompts from the prompt
files (whole topics of the first file held out for evaluation) and chunks of plain English."""
from __future__ import annotations

import json
import random
from pathlib import Path

PROMPTS = Path(__file__).resolve().parent.parent / "configs" / "drafts" / "mtp-prompts.json"
LICENCES = ("GPL-3", "Apache-2.0", "MPL-2.0", "LGPL-2.1", "GFDL-1.3", "Artistic", "CC0-1.0", "BSD", "GPL-2")


def chat_prompts(tokenizer, n_train: int, n_heldout: int, seed: int,
                 paths: list[Path] = (PROMPTS,)) -> tuple[list[list[int]], list[list[int]]]:
    """Training prompts: each file's in turn, each file shuffled on its own (so a file's order does
    not depend on the files before it). Held-out prompts: the first file's only, one evaluation set."""
    train, heldout = [], []
    for i, path in enumerate(paths):
        spec = json.loads(Path(path).read_text())
        file_train, file_heldout, every = [], [], spec["held_out_every"]  # 0: nothing held out
        for t, topic in enumerate(spec["topics"]):
            for template in spec["templates"]:
                text = tokenizer.apply_chat_template([{"role": "user", "content": template.format(topic=topic)}])
                (file_heldout if every and t % every == every - 1 else file_train).append(tokenizer.encode(text))
        rng = random.Random(seed)
        rng.shuffle(file_train)
        rng.shuffle(file_heldout)
        train += file_train
        if i == 0:
            heldout = file_heldout
    return train[:n_train], heldout[:n_heldout]


def licence_chunks(tokenizer, max_tokens: int, chunk: int = 256) -> list[list[int]]:
    ids = []
    for name in LICENCES:
        path = Path("/usr/share/common-licenses") / name
        if path.is_file():
            ids += tokenizer.encode(path.read_text())
    ids = ids[:max_tokens]
    return [ids[i:i + chunk] for i in range(0, len(ids) - chunk // 2, chunk)]
