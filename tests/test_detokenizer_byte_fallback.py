"""Text of SentencePiece tokenizers with byte fallback (<0xNN> tokens, as in Llama 2, Mistral and Gemma files): the
tokenizer decodes a run of byte tokens as a whole, valid UTF-8 as its characters and anything else as one U+FFFD per
byte, so a late byte can turn characters it already decoded into U+FFFD. The text streamed token by token (deltas) and
the final text are the tokenizer's `decode` of the whole output: no characters lost after invalid bytes, a character
split over byte tokens whole."""

import json
import random

import pytest
import torch
from tiny_models import make_config
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from aserve import LLM, SamplingParams
from aserve.core.outputs import EngineCoreOutput
from aserve.engine.detokenizer import TokenBytes, byte_fallback_ids
from aserve.engine.output_processor import OutputProcessor
from aserve.sampling_params import RequestOutputKind

CORPUS = "The cache stores keys and values in blocks. Grüße aus Köln, 日本語 and emoji 🙂 done. " * 4
SPECIAL = ["<unk>", "<s>", "</s>", "<end_of_turn>"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]


def spm_tokenizer(strip_first_space: bool) -> PreTrainedTokenizerFast:
    """A BPE with byte fallback over "▁" pieces, its vocabulary laid out as SentencePiece's: special tokens, the 256
    byte tokens, then pieces of a few characters (the rest of the alphabet falls back to bytes). The decoder is Gemma's,
    with `strip_first_space` Llama 2's (the first space of the text dropped)."""
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=len(SPECIAL) + len(BYTES) + 60,
        limit_alphabet=30,
        special_tokens=SPECIAL + BYTES,
        show_progress=False,
    )
    trained.train_from_iterator([CORPUS], trainer)
    model = json.loads(trained.to_str())["model"]  # byte tokens in the model's vocabulary, not added tokens
    merges = [tuple(m) for m in model["merges"]]
    tok = Tokenizer(models.BPE(model["vocab"], merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if strip_first_space else []))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=SPECIAL[3:],
    )


@pytest.fixture(scope="module")
def gemma_style():
    return spm_tokenizer(strip_first_space=False)


@pytest.fixture(scope="module")
def llama_style():
    return spm_tokenizer(strip_first_space=True)


def ids_of(tokenizer, *tokens: str) -> list[int]:
    """(Letters: the corpus's frequent ones only. The trainer keeps 30 of its 31 characters, dropping one of those
    seen 4 times, which one varying from run to run.)"""
    ids = tokenizer.convert_tokens_to_ids(list(tokens))
    assert tokenizer.unk_token_id not in ids, tokens
    return ids


def run(tokenizer, prompt_ids, output_ids, *, skip=True, finish="length", stop=(), delta=True):
    """The output processor fed one token per step as the engine core feeds it; the last step ends the sequence
    (`finish` "stop": the last token is the stop token). Returns the text (deltas joined) and the last output."""
    proc = OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=len(output_ids), skip_special_tokens=skip, stop=list(stop))
    kind = RequestOutputKind.DELTA if delta else RequestOutputKind.FINAL_ONLY
    proc.add_request("r", None, list(prompt_ids), params, ["r"], kind)
    texts, last = [], None
    for i, token_id in enumerate(output_ids):
        ended = i == len(output_ids) - 1
        stop_reason = token_id if ended and finish == "stop" else None
        outs, _ = proc.process([EngineCoreOutput("r", [token_id], None, finish if ended else None, stop_reason)])
        for out in outs:
            texts.append(out.outputs[0].text)
            last = out
        if last is not None and last.finished:
            break
    assert last is not None and last.finished
    return ("".join(texts) if delta else last.outputs[0].text), last


def assert_streams_decode(tokenizer, prompt_ids, output_ids, skip=True, finish="length", after_prompt=False):
    """Deltas joined and the offline API's final text both equal the tokenizer's decode of the output; `after_prompt`:
    of the output after the prompt (Llama 2's decoder drops the first space of a text, not of an output after one)."""
    decoded = output_ids[:-1] if finish == "stop" else output_ids
    expected = tokenizer.decode(decoded, skip_special_tokens=skip)
    if after_prompt:
        whole = tokenizer.decode(prompt_ids + decoded, skip_special_tokens=skip)
        expected = whole[len(tokenizer.decode(prompt_ids, skip_special_tokens=skip)) :]
    for delta in (True, False):
        text, _ = run(tokenizer, prompt_ids, output_ids, skip=skip, finish=finish, delta=delta)
        assert text == expected, (tokenizer.convert_ids_to_tokens(output_ids), delta)
    return expected


def test_byte_fallback_uses_decode_stream_with_byte_ids(gemma_style):
    assert TokenBytes.build(gemma_style) is None
    byte_ids = byte_fallback_ids(gemma_style, skip_special_tokens=False)
    assert byte_ids == frozenset(ids_of(gemma_style, *BYTES))
    assert byte_fallback_ids(gemma_style, skip_special_tokens=True) == byte_ids | set(gemma_style.all_special_ids)


def test_invalid_bytes_then_pieces(gemma_style):
    tok = gemma_style
    prompt = tok.encode("The cache")
    # 'r', '~' decode alone, then bytes that make the run invalid: all five are U+FFFD, the pieces after them kept
    out = ids_of(tok, "▁", "<0x72>", "<0x7E>", "<0xE6>", "<0x97>", "<0xFF>", "▁", "d", "o", "n", "e")
    assert assert_streams_decode(tok, prompt, out) == " " + "\ufffd" * 5 + " done"
    # invalid bytes first, a valid run after a piece
    out = ids_of(tok, "<0xE6>", "<0x72>", "a", "<0xC3>", "<0x9F>", "e")
    assert assert_streams_decode(tok, prompt, out) == "\ufffd\ufffdaße"
    # a valid character, then a byte that makes its run invalid
    out = ids_of(tok, "<0xC3>", "<0x9F>", "<0xE6>", "e")
    assert assert_streams_decode(tok, prompt, out) == "\ufffd\ufffd\ufffde"


def test_character_split_over_byte_tokens_comes_out_whole(gemma_style, llama_style):
    for tok in (gemma_style, llama_style):
        prompt = tok.encode("The cache")
        out = ids_of(tok, "▁", "<0xF0>", "<0x9F>", "<0x99>", "<0x82>", "▁", "d", "o", "n", "e")
        assert assert_streams_decode(tok, prompt, out, after_prompt=True) == " 🙂 done"
        if tok is gemma_style:
            assert assert_streams_decode(tok, prompt, out) == " 🙂 done"
        # at the very end, before the stop token (which adds no text) and at the length limit
        out = ids_of(tok, "a", "<0xC3>", "<0x9F>", "</s>")
        assert assert_streams_decode(tok, prompt, out, finish="stop") == "aß"
        assert assert_streams_decode(tok, prompt, out[:-1]) == "aß"
        # cut inside a character: U+FFFD, as the whole decode shows it
        assert assert_streams_decode(tok, prompt, out[:-2]) == "a\ufffd"
        # a byte run at the end of the prompt does not join the output's bytes
        prompt_bytes = prompt + ids_of(tok, "<0xE6>", "<0x97>")
        assert assert_streams_decode(tok, prompt_bytes, ids_of(tok, "<0xA5>", "a")) == "\ufffda"


def test_skipped_special_token_inside_a_byte_run(gemma_style):
    tok = gemma_style
    out = ids_of(tok, "a", "<0xC3>", "<end_of_turn>", "<0x9F>", "e", "<0xE6>", "</s>", "<0x72>", "a")
    assert assert_streams_decode(tok, [], out, skip=True) == "aße\ufffd\ufffda"
    assert assert_streams_decode(tok, [], out, skip=False) == "a\ufffd<end_of_turn>\ufffde\ufffd</s>ra"


def test_stop_string_in_bytes_held_to_the_end(gemma_style):
    tok = gemma_style
    text, last = run(tok, [], ids_of(tok, "a", "c", "<0xC3>", "<0x9F>"), stop=["ß"])
    assert text == "ac" and last.outputs[0].finish_reason == "stop" and last.outputs[0].stop_reason == "ß"


def random_ids(rng, tok, n):
    bytes_at = tok.convert_tokens_to_ids("<0x00>")
    picks = []
    for _ in range(n):
        r = rng.random()
        if r < 0.3:
            picks.append(bytes_at + rng.randrange(256))
        elif r < 0.45:
            picks.append(bytes_at + rng.randrange(0x20, 0x7F))  # ASCII: valid alone
        elif r < 0.55:
            picks.append(bytes_at + rng.choice([0xC3, 0x9F, 0xE6, 0x97, 0xA5, 0xF0, 0x99, 0x82]))
        elif r < 0.6:
            picks.append(rng.randrange(bytes_at))  # special tokens
        else:
            picks.append(rng.randrange(bytes_at + 256, len(tok)))
    return picks


@pytest.mark.parametrize("style", ["gemma", "llama"])
def test_random_ids_stream_the_whole_decode(gemma_style, llama_style, style):
    """Random mixes of bytes (valid, invalid, ASCII), special tokens and pieces after random prompts."""
    tok = gemma_style if style == "gemma" else llama_style
    rng = random.Random(0)
    piece = ids_of(tok, "▁")
    for _ in range(150):
        prompt = random_ids(rng, tok, rng.randrange(8))
        out = random_ids(rng, tok, rng.randrange(1, 25))
        skip = rng.random() < 0.5
        text, _ = run(tok, prompt, out, skip=skip)
        if style == "gemma":
            assert text == tok.decode(out, skip_special_tokens=skip), (prompt, out, skip)
        else:  # Llama 2's decoder drops the first space of a text: the output's text is that after a prompt
            text, _ = run(tok, piece, out, skip=skip)
            whole = tok.decode(piece + out, skip_special_tokens=skip)
            assert text == whole[len(tok.decode(piece, skip_special_tokens=skip)) :], (out, skip)


def test_generate_text_is_decode_of_tokens(tmp_path, gemma_style):
    """End to end: a tiny random model whose vocabulary is mostly byte tokens emits invalid byte runs; each output's
    text is the tokenizer's decode of its tokens."""
    tok = gemma_style
    config = make_config("gqa")
    config.vocab_size = len(tok)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = tok.bos_token_id, tok.eos_token_id, 0
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)

    llm = LLM(str(tmp_path), dtype="float32", enforce_eager=True)
    prompts = ["The cache stores", "Grüße aus Köln", "日本語 and emoji 🙂", "values in blocks."]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    texts = [o.outputs[0].text for o in outs]
    assert texts == [tok.decode(o.outputs[0].token_ids, skip_special_tokens=True) for o in outs]
    assert any("\ufffd" in t for t in texts)  # invalid byte runs were generated
