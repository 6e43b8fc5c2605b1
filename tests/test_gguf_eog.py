"""GGUF chat models stop where llama.cpp stops them: at the file's EOS and at its end-of-generation tokens (the
metadata's eot / eom ids, the end-of-turn texts llama.cpp knows such as <|im_end|> or <end_of_turn>, the FIM tokens),
which the converted directory's generation_config.json lists."""

import json
import os

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_gguf_families import (  # noqa: F401  (cache: the fixture)
    SPM_BOS,
    SPM_EOS,
    SPM_SPECIAL,
    _sentencepiece_section,
    cache,
    gguf_config,
    hf_greedy,
    make_bf16_model,
    write_gguf,
)

from aserve import LLM, SamplingParams
from aserve.models.gguf_eog import gguf_eog_token_ids
from aserve.models.model_path import default_model_path, gguf_cache_dir

END_OF_TURN = SPM_SPECIAL.index("<end_of_turn>")


def vocab_file(path, tokens, **ids) -> gguf.GGUFReader:
    """A GGUF file with only a vocabulary: `tokens`, and tokenizer.ggml.<name>_token_id for each of `ids`."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list(tokens)
    for name, token_id in ids.items():
        writer.add_uint32(f"tokenizer.ggml.{name}_token_id", token_id)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf.GGUFReader(str(path))


def test_eog_ids_as_llama_cpp_finds_them(tmp_path):
    # Llama 3 instruct: EOS <|end_of_text|> in the metadata, <|eot_id|> and <|eom_id|> by their text
    tokens = ["a", "<|begin_of_text|>", "<|end_of_text|>", "b", "<|eom_id|>", "<|eot_id|>", "<|start_header_id|>"]
    assert gguf_eog_token_ids(vocab_file(tmp_path / "l3.gguf", tokens, eos=2)) == [2, 4, 5]
    # ids from the metadata, whatever their text; the EOS first
    tokens = ["<s>", "<turn_end>", "x", "<eos>", "<msg_end>"]
    assert gguf_eog_token_ids(vocab_file(tmp_path / "m.gguf", tokens, eos=3, eot=1, eom=4)) == [3, 1, 4]
    # Qwen 2.5 Coder: FIM pad / repo / file separator end generation too (by text where the metadata has no id)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "c"]
    assert gguf_eog_token_ids(vocab_file(tmp_path / "q.gguf", tokens, eos=2)) == [2, 0, 3, 4, 5]
    # gpt-oss: <|end|> ends a message, not the generation, where <|return|> and <|call|> are there
    tokens = ["<|endoftext|>", "<|return|>", "<|call|>", "<|end|>", "d"]
    assert gguf_eog_token_ids(vocab_file(tmp_path / "o.gguf", tokens, eos=1)) == [1, 0, 2]
    assert gguf_eog_token_ids(vocab_file(tmp_path / "p.gguf", ["<|end|>", "e"], eos=1)) == [1, 0]


def test_default_model_eog_ids():
    """SmolLM2's file: EOS <|im_end|>; <|endoftext|> by its text, <reponame> as the FIM repository token (what
    llama.cpp lists as its EOG tokens)."""
    reader = gguf.GGUFReader(default_model_path())
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    ids = gguf_eog_token_ids(reader)
    assert [tokens[i] for i in ids] == ["<|im_end|>", "<|endoftext|>", "<reponame>"]


@pytest.mark.usefixtures("cache")
def test_gguf_chat_model_stops_at_end_of_turn(tmp_path):
    """A Gemma 3 GGUF whose random weights make it say <end_of_turn> within three tokens: generation stops there,
    as llama.cpp and transformers (with the converted generation_config.json) stop, and goes on with ignore_eos."""
    config = gguf_config("gemma3")
    config.bos_token_id, config.eos_token_id, config.pad_token_id = SPM_BOS, SPM_EOS, SPM_SPECIAL.index("<pad>")
    hf_dir = make_bf16_model(str(tmp_path / "gemma3"), "gemma3", config=config)
    prompt = [SPM_BOS, 300, 301, 302, 303]
    greedy = hf_greedy(hf_dir, [prompt], 3)[0]
    assert len(greedy) == 3 and SPM_EOS not in greedy and END_OF_TURN not in greedy
    # <end_of_turn>'s embedding (tied to the head) twice the third token's: its logit doubles that token's
    weights = load_file(os.path.join(hf_dir, "model.safetensors"))
    embed = weights["model.embed_tokens.weight"]
    embed[END_OF_TURN] = 2 * embed[greedy[2]]
    save_file(weights, os.path.join(hf_dir, "model.safetensors"), metadata={"format": "pt"})
    gguf_path = write_gguf(hf_dir, str(tmp_path / "tiny-gemma3-chat.gguf"), vocab=_sentencepiece_section)

    llm = LLM(gguf_path, dtype="float32", enforce_eager=True)
    with open(os.path.join(gguf_cache_dir(gguf_path), "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == [SPM_EOS, END_OF_TURN]
    on = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    ignoring = list(on[0].outputs[0].token_ids)
    assert len(ignoring) == 8 and END_OF_TURN in ignoring[:3]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    assert list(out.token_ids) == ignoring[: ignoring.index(END_OF_TURN) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == END_OF_TURN
    assert "<end_of_turn>" not in out.text

    # transformers' generate on the converted directory stops there too
    assert hf_greedy_converted(gguf_cache_dir(gguf_path), prompt, 8) == list(out.token_ids)


def hf_greedy_converted(model_dir: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.tensor([prompt])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    return gen[0, len(prompt) :].tolist()
