"""The offline API as a vLLM user drives it: LLM's arguments, SamplingParams' checks, chat's arguments, output fields,
and bad input refused before anything is queued."""

import math
import socket

import pytest
import torch

from aserve import LLM, SamplingParams
from aserve.cli import main as cli_main
from aserve.sampling_params import ParamError

GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model, dtype=torch.float32, enforce_eager=True, max_model_len=128, trust_remote_code=True,
               swap_space=4, disable_log_stats=True, enable_chunked_prefill=True, tokenizer_mode="auto",
               load_format="safetensors", seed=None)  # fmt: skip


@pytest.mark.parametrize("fields, param", [
    ({"temperature": math.nan}, "temperature"), ({"temperature": math.inf}, "temperature"),
    ({"temperature": "0.5"}, "temperature"), ({"top_p": math.nan}, "top_p"), ({"stop": 5}, "stop"),
    ({"stop_token_ids": 5}, "stop_token_ids"), ({"stop_token_ids": [True]}, "stop_token_ids"), ({"seed": "a"}, "seed"),
    ({"n": True}, "n"), ({"top_k": True}, "top_k"), ({"logprobs": -2}, "logprobs"), ({"ignore_eos": 1}, "ignore_eos"),
    ({"repetition_penalty": math.inf}, "repetition_penalty"),
])  # fmt: skip
def test_sampling_params_refuse_what_is_not_a_value(fields, param):
    with pytest.raises(ParamError) as e:
        SamplingParams(**fields)
    assert e.value.param == param


def test_vllm_conventions(llm):
    assert SamplingParams(seed=-1).seed is None and SamplingParams(top_k=-1).top_k == 0
    assert llm.llm_engine is llm.engine and isinstance(llm.get_default_sampling_params(), SamplingParams)
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=5, logprobs=2))[0].outputs[0]
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for e, t in zip(out.logprobs, out.token_ids)))
    assert llm.generate("Hello", GREEDY)[0].outputs[0].cumulative_logprob is None
    for logprobs in (21, -1):  # max_logprobs 20 by default
        with pytest.raises(ParamError, match="max_logprobs"):
            llm.generate("Hello", SamplingParams(max_tokens=2, logprobs=logprobs))


def test_max_logprobs_minus_one_gives_the_vocabulary(tiny_model):
    llm = LLM(tiny_model, dtype="float32", enforce_eager=True, max_model_len=64, max_logprobs=-1)
    out = llm.generate("Hi", SamplingParams(max_tokens=1, logprobs=-1))[0].outputs[0]
    assert len(out.logprobs[0]) >= llm.engine.config.vocab_size


@pytest.mark.parametrize("args, message", [
    ({"max_model_len": 0}, "max_model_len must be >= 1"), ({"device": "tpu"}, "device must be auto, cpu or cuda"),
    ({"enable_chunked_prefill": False}, "always chunks prompts"), ({"revision": "main"}, "is not one"),
    ({"kv_cache_memory_gb": -1}, "kv_cache_memory_gb must be > 0"), ({"tokenizer_mode": "slow"}, "fast \\(Rust\\)"),
    ({"load_format": "pt"}, "load_format must be auto"),
])  # fmt: skip
def test_engine_arguments_refused_clearly(tiny_model, args, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_model, enforce_eager=True, **args)


def test_bad_input_leaves_nothing_queued(llm):
    for prompts, params in ((["a", "b"], [GREEDY, SamplingParams(seed=2**70)]),
                            (["a", "b"], [GREEDY, SamplingParams(logit_bias={10**6: 1.0})]),
                            (["a", {"prompt_token_ids": "abc"}], GREEDY)):  # fmt: skip
        with pytest.raises(ValueError):
            llm.generate(prompts, params)
        assert not llm.engine.output_processor.states and not llm.engine.core.scheduler.has_unfinished()
    for prompts in (5, None):
        with pytest.raises(TypeError, match="prompts must be"):
            llm.generate(prompts)
    for kwargs in ({"lora_request": object()}, {"priority": [1]}):
        with pytest.raises(ValueError, match="lora_request|priority"):
            llm.generate("Hello", GREEDY, **kwargs)
    assert llm.generate("Hello", GREEDY, lora_request=None, priority=None)[0].outputs[0].token_ids
    with pytest.raises(ParamError, match="prompt token ids must be integers"):
        llm.generate({"prompt_token_ids": [1.0]})


def test_chat_takes_vllms_arguments(llm):
    tokenizer = llm.get_tokenizer()
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    out = llm.chat(msgs, GREEDY)[0]
    assert out.prompt == tokenizer.apply_chat_template([{"role": "user", "content": "Hi\nthere"}],
                                                       add_generation_prompt=True, tokenize=False)  # fmt: skip
    assert out.prompt_token_ids == tokenizer.encode(out.prompt, add_special_tokens=False)
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    closed = llm.chat(history, GREEDY, add_generation_prompt=False)[0].prompt
    open_ = llm.chat(history, GREEDY, add_generation_prompt=False, continue_final_message=True)[0].prompt
    assert closed.startswith(open_) and open_.endswith("Hel") and closed != open_
    template = "{% for m in messages %}[{{ m['role'] }}|{{ m['content'] }}|{{ flavour }}]{% endfor %}"
    custom = llm.chat(history, GREEDY, chat_template=template, chat_template_kwargs={"flavour": "x"})[0].prompt
    assert custom == "[user|Hi|x][assistant|Hel|x]"
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(history, GREEDY, continue_final_message=True)
    with pytest.raises(ValueError, match="chat_template_content_format"):
        llm.chat(history, GREEDY, chat_template_content_format="markdown")


@pytest.mark.parametrize("flags, message", [(["--port", "99999"], "--port must be in 1..65535"),
                                            (["--log-level", "bogus"], "--log-level must be")])  # fmt: skip
def test_serve_flag_values_refused(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["serve", *flags])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_port_in_use_is_refused_before_loading(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as e:
            cli_main(["serve", "--port", str(port), "--model", "/no/such/model"])  # fails on the port, not the model
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"cannot listen on 127.0.0.1:{port}" in err


def test_engine_level_api(llm):
    engine = llm.llm_engine
    assert engine.get_tokenizer() is llm.get_tokenizer()
    for request_id in ("x", "y"):
        engine.add_request(request_id, "Hello", SamplingParams(max_tokens=50, ignore_eos=True))
    assert engine.get_num_unfinished_requests() == 2
    assert engine.abort_request(["x", "y"]) is None  # vLLM's list form
    assert engine.get_num_unfinished_requests() == 0 and not engine.core.scheduler.has_unfinished()
    with pytest.raises(ParamError, match="stop_token_ids must be < the vocabulary size"):
        llm.generate("Hello", SamplingParams(stop_token_ids=[10**9]))


async def test_generation_config_gives_the_sampling_defaults(tiny_model, tmp_path):
    """generation_config.json's sampling fields are the defaults (vLLM's --generation-config auto): top_k 1 makes a
    request that sets no sampling field greedy; --generation-config vllm ignores them."""
    import json
    import shutil

    from test_server import MODEL, make_client

    from aserve import EngineArgs, LLMEngine

    model = str(tmp_path / "model")
    shutil.copytree(tiny_model, model)
    path = f"{model}/generation_config.json"
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump({**config, "top_k": 1, "temperature": 0.7, "do_sample": True}, f)
    llm = LLM(model, dtype="float32", enforce_eager=True, max_model_len=64)
    defaults = llm.get_default_sampling_params()
    assert (defaults.top_k, defaults.temperature, defaults.top_p) == (1, 0.7, 1.0)
    assert LLM(model, dtype="float32", enforce_eager=True, max_model_len=64,
               generation_config="vllm").engine.config.default_sampling == {}  # fmt: skip
    engine = LLMEngine(EngineArgs(model=model, dtype="float32", enforce_eager=True, max_model_len=64,
                                  served_model_name=MODEL))  # fmt: skip
    client = await make_client(engine)
    try:
        body = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 8, "ignore_eos": True}
        texts = []
        for extra in ({}, {"seed": 1}, {"temperature": 0}):
            resp = await client.post("/v1/completions", json={**body, **extra})
            texts.append((await resp.json())["choices"][0]["text"])
        assert texts[0] == texts[1] == texts[2]  # top_k 1 by default: greedy whatever the seed
        resp = await client.post("/v1/completions", json={**body, "top_k": 0, "temperature": 5.0, "seed": 3})
        assert (await resp.json())["choices"][0]["text"] != texts[0]  # a request's own fields win
    finally:
        await client.close()
    with pytest.raises(ValueError, match="no generation_config.json there"):
        LLM(model, enforce_eager=True, generation_config=str(tmp_path))


def test_detokenize_false_gives_token_ids_only(llm):
    with_text = llm.generate("Hello", GREEDY)[0].outputs[0]
    ids_only = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=6, detokenize=False))[0].outputs[0]
    assert ids_only.token_ids == with_text.token_ids and ids_only.text == "" and with_text.text
    with pytest.raises(ParamError, match="detokenize=False"):
        SamplingParams(stop=["x"], detokenize=False)


def test_bad_words_are_never_completed(llm):
    """vLLM's bad_words: a one-token word is never sampled; a longer word's last token is masked only where the output
    ends with its other tokens."""
    from aserve.core.request import Request
    from aserve.worker.sampler import Sampler, SampleRow

    tokenizer = llm.get_tokenizer()
    base = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    token = next(t for t in base.token_ids if tokenizer.encode(tokenizer.decode([t]).strip(), add_special_tokens=False)
                 == [t])  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, bad_words=[tokenizer.decode([token])])
    banned = llm.generate("Hello", params)[0].outputs[0]
    assert token not in banned.token_ids and banned.token_ids != base.token_ids
    request = Request("r", [1, 2], SamplingParams(bad_words=["x"]), None)
    request.bad_words_token_ids = [[5, 6, 7], [9], [4, 8]]
    request.all_token_ids += [3, 5, 6]  # output so far: 3, 5, 6
    logits = Sampler(torch.device("cpu"), 0)._mask_bad_words(torch.zeros(1, 12), [SampleRow(request, [])])
    assert torch.isinf(logits[0]).nonzero().flatten().tolist() == [7, 9]
