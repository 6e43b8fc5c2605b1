"""A vLLM offline script ported to aserve: prompt dicts (cache_salt, refused keys), vLLM's names (TokensPrompt,
RequestOutputKind, GuidedDecodingParams, ...), SamplingParams' vLLM fields, RequestOutput's, and LLM's methods and
arguments (priority, tokenization_kwargs, chat's content formats); what aserve does not do is refused by name."""

import pickle

import pytest
import torch

import aserve
from aserve import LLM, SamplingParams, StructuredOutputsParams
from aserve.beam_search import BeamSearchParams
from aserve.core.outputs import EngineCoreOutput
from aserve.engine.output_processor import OutputProcessor
from aserve.outputs import CompletionOutput, Logprob
from aserve.sampling_params import ParamError, RequestOutputKind

GREEDY = SamplingParams(temperature=0, max_tokens=4)
LONG = list(range(5, 45))  # 40 token ids: two full 16-token blocks to share


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model, dtype=torch.float32, enforce_eager=True, max_model_len=128, debug_invariants=True)


def cached(llm, prompt, params=GREEDY) -> int:
    return llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens


def test_prompt_cache_salt_isolates_the_prefix_cache(llm):
    """vLLM's TextPrompt / TokensPrompt cache_salt: a salt shares cached prefixes only with the same salt."""
    llm.reset_prefix_cache()
    tokens = {"prompt_token_ids": LONG}
    assert cached(llm, tokens) == 0 and cached(llm, tokens) == 32
    assert cached(llm, {**tokens, "cache_salt": "tenant-a"}) == 0
    assert cached(llm, {**tokens, "cache_salt": "tenant-a"}) == 32
    assert cached(llm, {**tokens, "cache_salt": "tenant-b"}) == 0
    # the same salt given in SamplingParams is the same salt; a different one is refused
    assert cached(llm, tokens, GREEDY.clone(cache_salt="tenant-b")) == 32
    assert cached(llm, {**tokens, "cache_salt": "tenant-b"}, GREEDY.clone(cache_salt="tenant-b")) == 32
    with pytest.raises(ParamError, match="cache_salt"):
        llm.generate({**tokens, "cache_salt": "tenant-a"}, GREEDY.clone(cache_salt="tenant-b"))
    text = "one two three four five six seven eight nine ten " * 2
    out = llm.generate({"prompt": text, "cache_salt": "c"}, GREEDY)[0]
    assert out.prompt == text and out.num_cached_tokens == 0 and cached(llm, {"prompt": text, "cache_salt": "c"})
    assert cached(llm, text) == 0
    engine = llm.llm_engine  # the engine's own add_request reads the dict too
    engine.add_request("salted", {**tokens, "cache_salt": "tenant-b"}, GREEDY)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].num_cached_tokens == 32
    assert not engine.output_processor.states
    llm.reset_prefix_cache()  # beam search's steps run under their prompt's salt
    llm.beam_search([{**tokens, "cache_salt": "beams"}], BeamSearchParams(beam_width=2, max_tokens=2))
    assert cached(llm, tokens) == 0 and cached(llm, {**tokens, "cache_salt": "beams"}) == 32


@pytest.mark.parametrize("prompt, message", [
    ({"prompt": "Describe <image>", "multi_modal_data": {"image": b""}}, "'multi_modal_data' is not supported"),
    ({"prompt_token_ids": [5, 6], "mm_processor_kwargs": {}}, "'mm_processor_kwargs' is not supported"),
    ({"prompt_embeds": [[0.0]]}, "'prompt_embeds' is not supported"),
    ({"promt": "hello"}, "unknown prompt key 'promt'"),
    ({"prompt": "x", "cache_salt": 3}, "cache_salt"),
])  # fmt: skip
def test_prompt_keys_aserve_does_not_take_are_refused_by_name(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(["Hello", prompt], GREEDY)
    assert not llm.engine.output_processor.states and not llm.engine.core.scheduler.has_unfinished()


def test_vllm_names_are_exported():
    from aserve.inputs import TokensPrompt
    from aserve.sampling_params import BeamSearchParams as ReExported
    from aserve.sampling_params import GuidedDecodingParams

    assert aserve.TokensPrompt is TokensPrompt and aserve.TextPrompt and aserve.PromptType
    assert TokensPrompt(prompt_token_ids=[1, 2]) == {"prompt_token_ids": [1, 2]}
    assert ReExported is BeamSearchParams and GuidedDecodingParams is StructuredOutputsParams
    assert [k.value for k in RequestOutputKind] == [0, 1, 2]


def test_guided_decoding_is_structured_outputs(llm):
    """vLLM's older names: SamplingParams(guided_decoding=GuidedDecodingParams(...)) constrains the output."""
    from aserve.sampling_params import GuidedDecodingParams

    params = SamplingParams(temperature=0, max_tokens=8, guided_decoding=GuidedDecodingParams(choice=["yes", "no"]))
    assert params.structured_outputs is params.guided_decoding
    assert llm.generate("Is it?", params)[0].outputs[0].text in ("yes", "no")
    with pytest.raises(ParamError, match="guided_decoding"):
        SamplingParams(guided_decoding=GuidedDecodingParams(regex="a"), structured_outputs=params.structured_outputs)


def test_sampling_params_take_vllms_fields():
    params = SamplingParams(logprobs=True, prompt_logprobs=True, stop=None, stop_token_ids=[2, 2, 3], bad_words=None)
    assert (params.logprobs, params.prompt_logprobs) == (1, 1)
    assert (params.stop, params.stop_token_ids, params.bad_words) == ([], [2, 3], [])
    assert SamplingParams(stop="x").stop == ["x"] and SamplingParams(bad_words=["a", "a"]).bad_words == ["a"]
    assert SamplingParams().output_kind is RequestOutputKind.CUMULATIVE
    assert SamplingParams(output_kind=2).output_kind is RequestOutputKind.FINAL_ONLY
    assert SamplingParams(spaces_between_special_tokens=False, extra_args={}).extra_args == {}
    optional = SamplingParams.from_optional(n=None, temperature=None, top_p=None, logit_bias={"5": 250, 6: -1})
    assert (optional.n, optional.temperature, optional.top_p) == (1, 1.0, 1.0)
    assert optional.logit_bias == {5: 100.0, 6: -1}
    copy = pickle.loads(pickle.dumps(SamplingParams(stop="x", output_kind=RequestOutputKind.DELTA)))
    assert copy == SamplingParams(stop=["x"], output_kind=RequestOutputKind.DELTA) and copy.clone(n=2).n == 2
    # vLLM's fields for what aserve does not do are accepted where they ask for nothing
    SamplingParams(n=2, best_of=2, logits_processors=[], flat_logprobs=False, thinking_token_budget=None,
                   skip_reading_prefix_cache=None, repetition_detection=None, skip_clone=True)  # fmt: skip


@pytest.mark.parametrize("fields, param", [
    ({"best_of": 3}, "best_of"), ({"logits_processors": [lambda ids, logits: logits]}, "logits_processors"),
    ({"thinking_token_budget": 10}, "thinking_token_budget"), ({"logprob_token_ids": [1]}, "logprob_token_ids"),
    ({"flat_logprobs": True}, "flat_logprobs"), ({"skip_reading_prefix_cache": True}, "skip_reading_prefix_cache"),
    ({"repetition_detection": object()}, "repetition_detection"), ({"extra_args": {"x": 1}}, "extra_args"),
    ({"output_kind": "delta"}, "output_kind"), ({"spaces_between_special_tokens": 0}, "spaces_between_special_tokens"),
    ({"logit_bias": {"a": 1}}, "logit_bias"),
])  # fmt: skip
def test_sampling_params_refuse_what_aserve_does_not_do_by_name(fields, param):
    make = SamplingParams.from_optional if param == "logit_bias" else SamplingParams
    with pytest.raises(ParamError, match=param) as e:
        make(**fields)
    assert e.value.param == param


def test_request_output_has_vllms_fields(llm):
    out = llm.generate("Hello", GREEDY)[0]
    assert (out.metrics, out.lora_request, out.encoder_prompt, out.encoder_prompt_token_ids) == (None,) * 4
    assert out.kv_transfer_params is None and out.outputs[0].lora_request is None
    assert out.outputs[0].finished() is True and out.finished is True
    # vLLM's positional order: index, text, token_ids, cumulative_logprob, logprobs, finish_reason, stop_reason
    built = CompletionOutput(0, "a", [7], -0.5, [{7: Logprob(-0.5, 1, "a")}], "stop", "\n")
    assert (built.cumulative_logprob, built.logprobs[0][7].rank, built.finish_reason, built.stop_reason) == (
        -0.5, 1, "stop", "\n")  # fmt: skip


def test_llm_methods(llm):
    assert llm.llm_engine.model_config.max_model_len == 128
    tokens = {"prompt_token_ids": LONG}
    llm.generate(tokens, GREEDY)
    assert cached(llm, tokens) == 32
    assert llm.reset_prefix_cache() is True and llm.reset_mm_cache() is None
    assert cached(llm, tokens) == 0 and cached(llm, tokens) == 32
    for name in ("encode", "embed", "score", "classify", "reward"):
        with pytest.raises(ValueError, match=f"LLM.{name}.. is not supported: aserve serves generative models only"):
            getattr(llm, name)(["Hello"])
    for name in ("sleep", "wake_up", "collective_rpc", "apply_model"):
        with pytest.raises(NotImplementedError, match=f"LLM.{name}.. is not supported"):
            getattr(llm, name)()


def test_generate_takes_priority_zero_and_tokenization_kwargs(llm):
    tokenizer = llm.get_tokenizer()
    assert len(llm.generate(["a", "b"], GREEDY, priority=[0, 0])) == 2
    for priority, message in (([0, 1], "first come"), ([0], "1 entries for 2 prompts")):
        with pytest.raises(ValueError, match=message):
            llm.generate(["a", "b"], GREEDY, priority=priority)
    text = "one two three four five six"
    ids = tokenizer.encode(text, add_special_tokens=False)
    plain = llm.generate(text, GREEDY, tokenization_kwargs={"add_special_tokens": False})[0]
    assert plain.prompt_token_ids == ids and plain.prompt == text and len(ids) > 4
    for kwargs in ({"truncate_prompt_tokens": 3}, {"truncation": True, "max_length": 3}):
        kept = llm.generate(text, GREEDY, tokenization_kwargs={"add_special_tokens": False, **kwargs})[0]
        assert kept.prompt_token_ids == ids[-3:]
    tokens = llm.generate({"prompt_token_ids": LONG}, GREEDY, tokenization_kwargs={"truncate_prompt_tokens": -1})[0]
    assert tokens.prompt_token_ids == LONG  # -1: max_length, the context
    for kwargs, message in (({"max_length": 2}, "more than tokenization_kwargs' max_length"),
                            ({"padding": True}, r"\['padding'\] are not supported"),
                            ({"truncation": "only_first"}, "truncation='only_first' is not supported"),
                            ({"do_lower_case": True}, "do_lower_case=True is not supported")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            llm.generate(text, GREEDY, tokenization_kwargs=kwargs)


def test_chat_takes_vllms_arguments(llm):
    history = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    as_is = "{% for m in messages %}{{ m['content'] }}|{% endfor %}"
    loops = "{% for m in messages %}{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}{% endfor %}"
    chat = lambda messages, template, **kw: llm.chat(messages, GREEDY, chat_template=template, **kw)[0].prompt  # noqa: E731
    assert chat(history, as_is, chat_template_content_format="string") == "Hi\nthere|"
    assert chat(history, loops, chat_template_content_format="string", add_generation_prompt=False) != "[Hi][there]"
    assert chat(history, loops, chat_template_content_format="auto") == "[Hi][there]"
    plain = [{"role": "user", "content": "Hi"}]
    assert chat(plain, loops, chat_template_content_format="openai") == "[Hi]"  # a string is one text part
    assert chat(plain, as_is, chat_template_content_format="openai") == "[{'type': 'text', 'text': 'Hi'}]|"
    out = llm.chat(plain, GREEDY, lora_request=None, chat_template=as_is, tokenization_kwargs={"truncation": True,
                   "max_length": 2})[0]  # fmt: skip
    assert out.prompt_token_ids == llm.get_tokenizer().encode("Hi|", add_special_tokens=False)[-2:]
    with pytest.raises(ValueError, match="mm_processor_kwargs"):
        llm.chat(plain, GREEDY, chat_template=as_is, mm_processor_kwargs={"num_crops": 4})
    with pytest.raises(ValueError, match="lora_request"):
        llm.chat(plain, GREEDY, chat_template=as_is, lora_request=object())


def test_spaces_between_special_tokens():
    """vLLM's rule: with spaces_between_special_tokens off (special tokens kept), an added token right after another
    is written without the space a decoder (WordPiece's here) puts between tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordPiece({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.Whitespace(), decoders.WordPiece()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<a>", "<b>"]})
    processor = OutputProcessor(tokenizer)

    def text(**fields) -> str:
        params = SamplingParams(skip_special_tokens=False, **fields)
        processor.add_request("r", None, [1], params, ["r"], RequestOutputKind.FINAL_ONLY)
        outputs, _ = processor.process([EngineCoreOutput("r", [3, 4, 2, 3], finish_reason="length")])
        return outputs[0].outputs[0].text

    assert text() == " <a> <b> world <a>"
    assert text(spaces_between_special_tokens=False) == " <a><b> world <a>"


def test_engine_add_request_takes_vllms_positional_arguments(llm):
    """LLMEngine.add_request(request_id, prompt, params, arrival_time, lora_request, tokenization_kwargs,
    trace_headers, priority, prompt_text), as a vLLM step loop calls it; what aserve does not do is refused by name
    and leaves nothing queued."""
    engine = llm.llm_engine
    text = "one two three four five six"
    ids = llm.get_tokenizer().encode(text, add_special_tokens=False)

    def run(*args):
        engine.add_request("p", *args)
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        return outs[-1]

    whole = run(text, GREEDY, None, None, None, None, 0)
    kept = run(text, GREEDY, None, None, {"add_special_tokens": False, "truncate_prompt_tokens": 3})
    assert kept.prompt_token_ids == ids[-3:] and whole.prompt_token_ids != kept.prompt_token_ids
    named = run({"prompt_token_ids": ids}, GREEDY, None, None, None, None, 0, "my text")
    assert named.prompt == "my text" and named.prompt_token_ids == ids
    for args, param in (((None, object()), "lora_request"), ((None, None, None, {"x-trace": "1"}), "trace_headers"),
                        ((None, None, None, None, 2), "priority"),
                        ((None, None, {"padding": True}), "tokenization_kwargs")):  # fmt: skip
        with pytest.raises(ValueError) as info:
            engine.add_request("q", text, GREEDY, *args)
        assert param in str(info.value)
        assert not engine.has_unfinished_requests() and not engine.output_processor.states
