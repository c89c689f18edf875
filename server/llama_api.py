"""POST /completion: llama-server's native completion endpoint, which editor plugins and older
clients call. Its answer is llama-server's: `content`, `tokens`, `stop`, the counts and
`timings`; streamed, one JSON object per event and no [DONE], as llama-server streams it."""
from __future__ import annotations

import json
from typing import AsyncIterator

from fastapi import APIRouter, Request
from sse_starlette import EventSourceResponse

from server.generation import Final, Piece, constrain, prepare, run
from server.openai_api import engine_error, get_state, whole
from server.protocol import LlamaCompletionRequest
from server.state import ServerState

router = APIRouter()


@router.post("/completion")
async def completion(body: LlamaCompletionRequest, request: Request):
    state = get_state(request)
    prompt_ids = list(body.prompt) if isinstance(body.prompt, list) else await state.prompts.prompt_ids(body.prompt)
    prepared = prepare(state, body, prompt_ids, body.n_logprobs)
    prepared.constraint = await constrain(state, body.grammar_source)
    fmt = LlamaFormat(state, body.model)
    if not body.stream:
        return await whole(state, prepared, fmt, request)

    async def events() -> AsyncIterator[dict]:
        async for item in run(state, prepared):
            if isinstance(item, Final):
                yield {"data": json.dumps(engine_error(state).body() if item.finish_reason == "error" else
                                          fmt.last(item))}
            else:
                yield {"data": json.dumps({"index": 0, "content": item.text, "tokens": item.token_ids,
                                           "stop": False, **fmt.probs([item])})}
    return EventSourceResponse(events(), ping=15)


class LlamaFormat:
    def __init__(self, state: ServerState, model: str | None):
        self.model = state.model_name if not model or model == "default" else model
        self.decode = state.runner.engine.tokenizer.decode

    def probs(self, pieces: list[Piece]) -> dict:
        """llama-server's completion_probabilities (with n_probs): each token's and its top ones'."""
        entries = [e for p in pieces for e in (p.logprobs or [])]
        if not entries:
            return {}
        return {"completion_probabilities": [
            {"id": e["token"], "token": self.decode([e["token"]]), "logprob": e["logprob"],
             "top_logprobs": [{"id": t, "token": self.decode([t]), "logprob": lp} for t, lp in e["top"]]}
            for e in entries]}

    def last(self, final: Final) -> dict:
        """The closing object: stop true, the counts, why it stopped, timings."""
        return {"index": 0, "content": "", "tokens": [], "stop": True, "model": self.model,
                "tokens_predicted": final.usage["completion_tokens"], "tokens_evaluated": final.usage["prompt_tokens"],
                "tokens_cached": final.timings["cache_n"], "truncated": False,
                "stop_type": {"stop": "eos", "length": "limit"}.get(final.finish_reason, final.finish_reason),
                "timings": final.timings}

    def whole(self, pieces: list[Piece], final: Final) -> dict:
        return {**self.last(final), "content": "".join(p.text for p in pieces),
                "tokens": [t for p in pieces for t in p.token_ids], **self.probs(pieces)}
