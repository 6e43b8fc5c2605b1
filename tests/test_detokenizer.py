"""Incremental detokenization: multi-byte characters, stop strings, and what may be streamed."""

import pytest

from aserve.engine.output_processor import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def stream(tokenizer, text, stops=(), include=False, prompt="The prompt."):
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), list(stops), include, skip_special_tokens=True)
    sent, chunks, stop = 0, [], None
    for token_id in tokenizer.encode(text):
        stop = detok.add_token(token_id)
        end = detok.streamable_len(finished=stop is not None)
        chunks.append(detok.text[sent:end])
        sent = end
        if stop:
            break
    return detok, chunks, stop


def test_multibyte_characters_are_never_split(tokenizer):
    text = "Grüße aus Köln, 日本語 and emoji 🙂 done"
    detok, chunks, _ = stream(tokenizer, text)
    assert detok.text == text and "".join(chunks) == text
    assert all("\ufffd" not in c for c in chunks)


def test_stop_string_cut_and_never_leaked(tokenizer):
    text = "The cache stores keys and values in blocks."
    detok, chunks, stop = stream(tokenizer, text, stops=["values", "nothing"])
    assert stop == "values" and detok.text == "The cache stores keys and "
    streamed = "".join(chunks)
    assert streamed == detok.text
    # While running, a prefix of the stop string was held back rather than streamed.
    for i in range(len(chunks)):
        assert not "".join(chunks[: i + 1]).endswith(("v", "va", "val", "valu", "value"))


def test_include_stop_string_and_earliest_match(tokenizer):
    detok, _, stop = stream(tokenizer, "one two three four", stops=["four", "two"], include=True)
    assert stop == "two" and detok.text == "one two"


def test_special_tokens_skipped(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], [], False, skip_special_tokens=True)
    for token_id in tokenizer.encode("Hi") + [tokenizer.eos_token_id]:
        detok.add_token(token_id)
    assert detok.text == "Hi"


def test_undecodable_id_does_not_raise(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], [], False, skip_special_tokens=True)
    detok.add_token(10**6)
    for token_id in tokenizer.encode(" ok"):
        detok.add_token(token_id)
    assert detok.text.endswith("ok")
