"""Incremental detokenization (both ways: the token-bytes table and tokenizers' DecodeStream): multi-byte characters,
stop strings, and what may be streamed; the table agrees with the tokenizer's own decode, and is not used where it
cannot."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from aserve.engine import detokenizer
from aserve.engine.detokenizer import TokenBytes


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


CHOSEN: dict = {}


@pytest.fixture(params=["table", "decode_stream"], autouse=True)
def way(request, tokenizer):
    """Every test runs with the token-bytes table and with DecodeStream."""
    table = TokenBytes.build(tokenizer) if request.param == "table" else None
    assert request.param != "table" or table is not None
    CHOSEN["token_bytes"] = table
    return request.param


def IncrementalDetokenizer(*args, **kwargs):  # noqa: N802  (the class under test, built the way `way` chose)
    return detokenizer.IncrementalDetokenizer(*args, **kwargs, token_bytes=CHOSEN["token_bytes"])


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


def test_no_stop_string_ends_within_the_first_min_tokens(tokenizer):
    """vLLM's rule: the text of the first min_tokens tokens is not searched (a match may begin there and end after)."""
    ids = tokenizer.encode("a cat and a dog and a cow")
    for min_tokens in range(len(ids)):
        detok = IncrementalDetokenizer(tokenizer, [], ["a"], False, skip_special_tokens=True, min_tokens=min_tokens)
        stop = next((s for s in map(detok.add_token, ids) if s), None)
        floor = len(tokenizer.decode(ids[:min_tokens]))
        full = tokenizer.decode(ids)
        first = full.find("a", floor)  # the first "a" ending after the text of the first min_tokens tokens
        assert (stop, detok.text) == ("a", full[:first]) if first != -1 else (stop is None and detok.text == full)


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


CORPUS = "The cache stores keys and values in blocks. Grüße aus Köln, 日本語 and emoji 🙂 done. " * 4


def assert_table_matches_decode(tokenizer, valid_texts, random_ids):
    """Valid text: the table streams what DecodeStream streams. Any ids: the table's text is the tokenizer's own
    decode of the whole sequence (DecodeStream differs where invalid bytes end a stream: it holds back a U+FFFD)."""
    table = TokenBytes.build(tokenizer)
    assert table is not None
    prime = tokenizer.encode("The", add_special_tokens=False)[:1]
    for ids in valid_texts + random_ids:
        for skip in (True, False):
            fast = detokenizer.IncrementalDetokenizer(tokenizer, prime, [], False, skip, token_bytes=table)
            slow = detokenizer.IncrementalDetokenizer(tokenizer, prime, [], False, skip)
            for token_id in ids:
                fast.add_token(token_id)
                slow.add_token(token_id)
            if ids in valid_texts:
                assert fast.text == slow.text, (ids, skip)
            whole = tokenizer.decode(prime + ids, skip_special_tokens=skip)
            streamed = tokenizer.decode(prime, skip_special_tokens=skip) + fast.text
            # a character still incomplete at the end is held back, where a whole decode shows U+FFFD
            assert prime and whole in (streamed, streamed + "\ufffd"), (ids, skip)


def test_byte_level_table_matches_decode_stream(tokenizer, way):
    rng = random.Random(0)
    vocab = len(tokenizer)
    valid = [tokenizer.encode(CORPUS), [tokenizer.eos_token_id, *tokenizer.encode("after the end")]]
    assert_table_matches_decode(tokenizer, valid, [[rng.randrange(vocab) for _ in range(40)] for _ in range(50)])


def test_other_decoders_use_decode_stream(way):
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.train_from_iterator([CORPUS], trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"]))
    assert TokenBytes.build(PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")) is None


def test_wordpiece_uses_decode_stream(way):
    tok = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece()
    assert TokenBytes.build(PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")) is None


@pytest.mark.parametrize("clean_up", [False, True])
def test_single_token_texts_match_batch_decode(tokenizer, way, clean_up, monkeypatch):
    """Logprobs' decoded_token through the fast tokenizer's own decode_batch = transformers' batch_decode of each id
    alone, over the whole vocabulary, with and without transformers' clean-up of spaces."""
    if way != "table":
        pytest.skip("independent of the detokenizing way")
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", clean_up)
    ids = list(range(len(tokenizer)))
    assert detokenizer.single_token_decoder(tokenizer)(ids) == tokenizer.batch_decode([[i] for i in ids])
