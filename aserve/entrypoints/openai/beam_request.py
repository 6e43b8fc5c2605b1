"""`use_beam_search` on /v1/completions and /v1/chat/completions (vLLM's request field): each prompt's n best beams
(aserve/beam_search.py; beam_width = n, with the request's max_tokens, ignore_eos, temperature, length_penalty and
cache_salt) are its n choices, best first, their text the generated tokens' (an end-of-sequence token left out). The
response comes whole: a stream, logprobs, echo, tools, structured output and the sampling fields its steps do not
apply are refused with it (_REFUSED)."""

from __future__ import annotations

import asyncio

from aserve.beam_search import BeamSearch, BeamSearchParams
from aserve.engine.async_engine import AsyncEngine
from aserve.entrypoints.openai.responses import ChoiceState, add_token_ids, chat_chunk, completion_chunk, usage
from aserve.sampling_params import ParamError

# what a beam-search request may not ask for -> its check: the shapes of response it cannot give, and the sampling
# fields its one-token steps do not apply (they take temperature only, as vLLM's; vLLM ignores these, aserve refuses)
_REFUSED = {
    "stream": lambda req: req.stream,
    "logprobs": lambda req: req.num_logprobs() is not None,
    "echo": lambda req: req.echo,
    "tools": lambda req: getattr(req, "tools", None),
    "structured_outputs": lambda req: req.structured_outputs_params() is not None,
    **{
        name: lambda req, name=name: getattr(req, name) not in (None, [], {})
        for name in (
            "stop",
            "stop_token_ids",
            "logit_bias",
            "allowed_token_ids",
            "bad_words",
            "prompt_logprobs",
            "seed",
            "top_p",
            "top_k",
            "min_p",
            "repetition_penalty",
        )
    },
    "presence_penalty": lambda req: req.presence_penalty != 0,
    "frequency_penalty": lambda req: req.frequency_penalty != 0,
    "min_tokens": lambda req: req.min_tokens != 0,
}


def check_beam_request(req, max_logprobs: int) -> None:
    for field, asks in _REFUSED.items():
        if asks(req):
            raise ParamError(field, f"{field} is not supported with use_beam_search (the beams come whole, as text)")
    if max_logprobs != -1 and 2 * req.n > max_logprobs:
        raise ParamError("n", f"use_beam_search takes n <= {max_logprobs // 2}: each beam's step asks for 2 x n "
                         "candidates' logprobs (--max-logprobs)")  # fmt: skip


async def search(engine: AsyncEngine, ids: list[int], params: BeamSearchParams, request_id: str,
                 cache_salt: str | None = None):  # fmt: skip
    """One prompt's beam search over the engine, a one-token request per live beam per step (salted with the
    request's cache_salt: its steps share prefix-cache blocks only with that tenant's requests)."""
    config = engine.config
    beams = BeamSearch([ids], params, config.eos_token_id, config.max_model_len)
    step = params.step_params().clone(cache_salt=cache_salt)
    while not beams.done:
        streams = []
        try:
            for i, tokens in enumerate(beams.step_prompts()):
                streams.append(await engine.add_request(None, step, f"{request_id}-{beams.steps}-{i}", tokens))
            beams.advance([await _candidates(stream) for stream in streams])
        finally:
            for stream in streams:  # a client gone mid-search: its step requests end (a finished one: no-op)
                await stream.aclose()
    return beams.outputs()[0]  # (the response decodes the generated tokens only)


async def _candidates(stream) -> dict:
    logprobs = []
    async for out in stream:
        logprobs += out.outputs[0].logprobs or []
    return logprobs[0]


async def beam_response(state, req, request_id: str, engine_id: str, prompts, chat: bool, created: int):
    """The whole response of a beam-search request: prompts (text, ids, params) -> (its body, its choices).
    engine_id: the prefix of its step requests' engine ids."""
    engine: AsyncEngine = state.engine
    check_beam_request(req, engine.config.args.max_logprobs)
    eos = engine.config.eos_token_id

    max_model_len = engine.config.max_model_len
    searches = []
    for _, ids, params in prompts:  # all checked before any runs
        engine.engine.validate_prompt(ids)
        room = max_model_len - len(ids)
        if room < 1 or (params.max_tokens or 0) > room:
            field = "max_tokens" if room >= 1 else "messages" if chat else "prompt"
            raise ParamError(field, f"the prompt's {len(ids)} tokens and max_tokens {params.max_tokens} do not fit "
                             f"the context of {max_model_len} tokens", "context_length_exceeded")  # fmt: skip
        searches.append((ids, BeamSearchParams(beam_width=req.n, max_tokens=params.max_tokens or room,
                                               ignore_eos=params.ignore_eos, temperature=params.temperature,
                                               length_penalty=req.length_penalty)))  # fmt: skip
    tasks = [asyncio.ensure_future(search(engine, ids, p, f"{engine_id}-{i}", req.cache_salt))
             for i, (ids, p) in enumerate(searches)]  # fmt: skip
    try:
        found = [output.sequences for output in await asyncio.gather(*tasks)]
    finally:  # one search failing (or the client leaving) ends the others, and their step requests
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    choices, completion_tokens = [], 0
    for i, ((_, ids, _), sequences) in enumerate(zip(prompts, found)):
        for j, beam in enumerate(sequences):
            choice = ChoiceState(i * req.n + j, None)
            generated = beam.tokens[len(ids) :]
            text_ids = generated[:-1] if beam.finish_reason == "stop" and generated[-1:] == [eos] else generated
            choice.text = await engine.detokenize(text_ids)
            choice.token_ids = choice.output_token_ids = generated
            choice.prompt_token_ids = ids
            choice.num_tokens, choice.finish_reason = len(generated), beam.finish_reason
            choices.append(choice)
            completion_tokens += len(generated)
    if chat:
        body = chat_chunk(request_id, created, state.model_name, choices, final=True, role=state.response_role)
    else:
        body = completion_chunk(request_id, created, state.model_name, choices, final=True)
    if req.return_token_ids:
        add_token_ids(body, choices, chat, final=True)
    body["usage"] = usage(sum(len(ids) for _, ids, _ in prompts), completion_tokens)
    return body, choices
