"""LLM's constructor, chat and progress-bar arguments as a vLLM offline script passes them: kv_cache_memory_bytes and
structured_outputs_config, several conversations with one SamplingParams each, chat_template_kwargs and tools,
continue_final_message, use_tqdm as a callable, and vLLM's attribute names (llm.model_config, supported_tasks)."""

import io

import pytest
import torch
from tqdm import tqdm

from aserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4)
# A template reading a keyword of chat_template_kwargs and the tools
TEMPLATE = (
    "{% if tools %}tools={{ tools | map(attribute='function.name') | join(',') }}\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}{{ reply_prefix | default('assistant:') }}{% endif %}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model, dtype=torch.float32, enforce_eager=True, max_model_len=128, debug_invariants=True)


def test_chat_runs_a_list_of_conversations_each_with_its_sampling_params(llm):
    conversations = [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Bye"}]]
    params = [SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)]  # fmt: skip
    outs = llm.chat(conversations, params, use_tqdm=False)
    assert [o.prompt for o in outs] == ["user: Hi\nassistant:", "user: Bye\nassistant:"]
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 5]
    with pytest.raises(ValueError, match="2 prompts but 1 sampling params"):
        llm.chat(conversations, params[:1], use_tqdm=False)


def test_chat_template_kwargs_and_tools_reach_the_template(llm):
    chat = lambda **kw: llm.chat([{"role": "user", "content": "Hi"}], GREEDY, chat_template=TEMPLATE,  # noqa: E731
                                 use_tqdm=False, **kw)[0].prompt  # fmt: skip
    assert chat(chat_template_kwargs={"reply_prefix": "bot>"}) == "user: Hi\nbot>"
    assert chat(tools=[WEATHER]) == "tools=get_weather\nuser: Hi\nassistant:"
    other = {"type": "function", "function": {"name": "other"}}
    assert chat(chat_template_kwargs={"tools": [other]}) == "tools=other\nuser: Hi\nassistant:"
    assert chat(chat_template_kwargs={"tools": [other]}, tools=[WEATHER]).startswith("tools=get_weather\n")


@pytest.mark.parametrize("key", ["add_generation_prompt", "continue_final_message", "tokenize", "chat_template",
                                 "conversation", "return_dict"])  # fmt: skip
def test_chat_template_kwargs_that_control_rendering_are_refused_by_name(llm, key):
    with pytest.raises(ValueError, match=f"chat_template_kwargs may not set '{key}': LLM.chat takes"):
        llm.chat([{"role": "user", "content": "Hi"}], GREEDY, chat_template_kwargs={key: False}, use_tqdm=False)


def test_chat_template_kwargs_must_be_a_dict(llm):
    with pytest.raises(TypeError, match="chat_template_kwargs must be a dict, got list"):
        llm.chat([{"role": "user", "content": "Hi"}], GREEDY, chat_template_kwargs=["x"], use_tqdm=False)


def test_continue_final_message_extends_the_assistant_reply(llm):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]
    out = llm.chat(messages, GREEDY, add_generation_prompt=False, continue_final_message=True, use_tqdm=False)[0]
    assert out.prompt == "user: Hi\nassistant: The answer is"
    assert out.prompt_token_ids == llm.get_tokenizer().encode(out.prompt, add_special_tokens=False)
    with pytest.raises(ValueError, match="Cannot set both `continue_final_message` and `add_generation_prompt`"):
        llm.chat(messages, GREEDY, continue_final_message=True, use_tqdm=False)


def test_use_tqdm_callable_makes_the_progress_bar(llm):
    bars = []

    def make_bar(**kwargs):
        bars.append(tqdm(file=io.StringIO(), **kwargs))
        return bars[-1]

    outs = llm.generate(["a", "b", "c"], GREEDY, use_tqdm=make_bar)
    assert len(outs) == 3 and len(bars) == 1
    assert (bars[0].total, bars[0].n) == (3, 3)
    llm.chat([{"role": "user", "content": "Hi"}], GREEDY, use_tqdm=make_bar)
    assert len(bars) == 2 and bars[1].n == 1 and "Generating: 100%" in bars[1].fp.getvalue()


def test_vllms_attribute_names(llm, tiny_model):
    assert llm.model_config is llm.llm_engine.model_config
    assert llm.model_config.max_model_len == 128 and llm.model_config.model == tiny_model
    assert llm.model_config.get_vocab_size() == llm.model_config.hf_config.vocab_size
    assert llm.model_config.max_logprobs == 20
    assert llm.supported_tasks == ("generate",) and llm.get_world_size() == 1


def test_kv_cache_memory_bytes_and_structured_outputs_config(tiny_model):
    common = dict(dtype=torch.float32, enforce_eager=True, max_model_len=64)
    by_bytes = LLM(tiny_model, kv_cache_memory_bytes=2**20, structured_outputs_config={"backend": "xgrammar"}, **common)
    by_gib = LLM(tiny_model, kv_cache_memory_gb=2**-10, **common)
    assert by_bytes.llm_engine.core.num_kv_blocks == by_gib.llm_engine.core.num_kv_blocks > 0
    assert by_bytes.generate("Hi", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="kv_cache_memory_bytes or kv_cache_memory_gb, not both"):
        LLM(tiny_model, kv_cache_memory_bytes=2**20, kv_cache_memory_gb=1, **common)
    with pytest.raises(ValueError, match="structured output always uses xgrammar"):
        LLM(tiny_model, structured_outputs_config={"backend": "outlines"}, **common)
