"""Vision-language checkpoints (Gemma 3 4B+, Mistral Small 3.x, LLaVA, Qwen2-VL, Qwen2.5-VL, Qwen3-VL) served by their
language model: greedy tokens equal transformers' generate on the whole checkpoint for text prompts (float32, tiny
random models as transformers writes them), whichever tensor names the checkpoint uses; over HTTP with the official
client, image parts are refused with a 400."""

import os
import random

import openai
import pytest
from aserve_server import running_server
from safetensors.torch import load_file, save_file
from tiny_models import VISION_LANGUAGE, hf_greedy, make_vision_language_config

from aserve import LLM, SamplingParams
from aserve.models.vision_language import text_side


def prompts_for(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 384) for _ in range(n)] for n in (3, 21, 40)]


@pytest.mark.parametrize(
    "variant", [pytest.param(v, marks=pytest.mark.slow) if v in ("llava", "qwen2_vl") else v for v in VISION_LANGUAGE]
)
def test_the_language_model_matches_transformers(tiny_model_factory, variant):
    """Chunked prefill (16-token budget), then the same prompts again from the prefix cache."""
    path = tiny_model_factory(variant)
    prompts = prompts_for(1)
    expected = hf_greedy(path, prompts, 12)
    llm = LLM(path, dtype="float32", enforce_eager=True, max_num_batched_tokens=16)
    assert llm.engine.config.hf_config.architectures[0].endswith("ForCausalLM")
    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=12),
                            use_tqdm=False)  # fmt: skip
        assert [list(o.outputs[0].token_ids) for o in outs] == expected
    assert llm.engine.stats.prefix_cache_hits_total > 0


@pytest.mark.parametrize("variant, renames", [
    ("gemma3_vl", {"language_model.model.": "model.language_model.", "language_model.lm_head.": "lm_head.",
                   "vision_tower.": "model.vision_tower.", "multi_modal_projector.": "model.multi_modal_projector."}),
    ("qwen2_5_vl", {"model.": "model.language_model.", "visual.": "model.visual."}),
])  # fmt: skip
def test_either_generation_of_tensor_names_loads(tiny_model_factory, tmp_path, variant, renames):
    """transformers writes `language_model.model.*` (Gemma 3, Mistral 3, LLaVA) or `model.*` + `visual.*` (Qwen2-VL,
    Qwen2.5-VL); checkpoints written by other versions (and Qwen3-VL's) use `model.language_model.*`: the same model
    either way."""
    src = tiny_model_factory(variant)
    dst = str(tmp_path / variant)
    os.makedirs(dst)
    for name in os.listdir(src):
        if name != "model.safetensors":
            os.symlink(os.path.join(src, name), os.path.join(dst, name))
    tensors = {}
    for name, tensor in load_file(os.path.join(src, "model.safetensors")).items():
        old = next((o for o in renames if name.startswith(o)), None)
        tensors[name if old is None else renames[old] + name[len(old) :]] = tensor
    assert set(tensors) != set(load_file(os.path.join(src, "model.safetensors")))
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    prompts = prompts_for(2)
    params = SamplingParams(temperature=0, max_tokens=8)
    want = [o.outputs[0].token_ids for o in LLM(src, dtype="float32", enforce_eager=True).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]  # fmt: skip
    got = [o.outputs[0].token_ids for o in LLM(dst, dtype="float32", enforce_eager=True).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]  # fmt: skip
    assert got == want


def test_a_llava_around_an_unsupported_language_model_is_named(tmp_path):
    config = make_vision_language_config("llava")
    config.architectures = ["LlavaForConditionalGeneration"]
    config.text_config = type(make_vision_language_config("gemma3_vl").text_config)()
    with pytest.raises(ValueError, match="LlavaForConditionalGeneration with a 'gemma3_text' language model"):
        text_side(config, str(tmp_path))


def test_a_vision_language_checkpoint_over_http(tiny_model_factory):
    """`aserve serve` on a Gemma 3 vision-language checkpoint: token-id completions equal transformers'; a chat of
    text parts is answered, one with an image part gets a 400 naming the content and the server goes on serving."""
    path = tiny_model_factory("gemma3_vl")
    prompts = prompts_for(3)
    expected = hf_greedy(path, prompts, 10)
    with running_server("--model", path, "--dtype", "float32", "--max-model-len", "256", "--served-model-name",
                        "gemma3") as url:  # fmt: skip
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        resp = client.completions.create(model="gemma3", prompt=prompts, max_tokens=10, temperature=0,
                                         extra_body={"return_token_ids": True})  # fmt: skip
        assert [c.model_dump()["token_ids"] for c in sorted(resp.choices, key=lambda c: c.index)] == expected
        text_parts = [{"role": "user", "content": [{"type": "text", "text": "Hello world!"}]}]
        chat = client.chat.completions.create(model="gemma3", messages=text_parts, max_tokens=5, temperature=0)
        assert chat.choices[0].message.content and chat.usage.completion_tokens == 5
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="gemma3", max_tokens=5, messages=[
                {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}])  # fmt: skip
        assert err.value.body["param"] == "messages[0].content" and "'image_url'" in err.value.body["message"]
        again = client.chat.completions.create(model="gemma3", messages=text_parts, max_tokens=5, temperature=0)
        assert again.choices[0].message.content == chat.choices[0].message.content


def test_the_text_config_keeps_the_checkpoints_head_and_quantisation(tiny_model_factory):
    """Qwen2.5-VL's untied head (an lm_head tensor) stays untied, Gemma 3's (none) is tied; the text config is the
    text family's own (Qwen2's q/k/v biases follow from it) with the plain rotary and the checkpoint's
    quantization_config."""
    for variant, tied, arch in (("qwen2_5_vl", False, "Qwen2ForCausalLM"), ("gemma3_vl", True, "Gemma3ForCausalLM")):
        path = tiny_model_factory(variant)
        cfg = LLM(path, dtype="float32", enforce_eager=True).engine.config.hf_config
        assert (cfg.architectures, cfg.tie_word_embeddings) == ([arch], tied)
    assert cfg.model_type == "gemma3_text"
    config = make_vision_language_config("qwen2_5_vl")
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    config.quantization_config = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    qwen = text_side(config, tiny_model_factory("qwen2_5_vl"))
    assert qwen.model_type == "qwen2" and "mrope_section" not in qwen.rope_parameters
    assert qwen.quantization_config == config.quantization_config and not qwen.tie_word_embeddings
