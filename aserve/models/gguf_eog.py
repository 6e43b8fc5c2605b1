"""The end-of-generation tokens of a GGUF file, found as llama.cpp's vocabulary loader finds them (src/llama-vocab.cpp,
`special_eog_ids`): GGUF has one `tokenizer.ggml.eos_token_id`, but chat models end a turn with another token
(<|im_end|>, <|eot_id|>, <end_of_turn>, ...), which llama.cpp stops at too. The converted HF directory lists them in
generation_config.json's eos_token_id, as the original checkpoints of Llama 3 or Gemma 3 do."""

from __future__ import annotations

from gguf import GGUFReader, Keys

# token texts that end generation wherever they are in the vocabulary
_EOG_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",  # o200k_harmony
        "<|call|>",  # o200k_harmony
        "<|flush|>",  # solar-open
        "<|calls|>",  # solar-open
        "<end_of_turn>",
        "<|endoftext|>",
        "</s>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",  # Kimi-K2
        "[EOS]",  # Kimi-K2
        "<|end_of_text|>",
        "<end_of_utterance>",  # SmolDocling
        "<eos>",  # Gemma 4
        "<turn|>",  # Gemma 4
        "<|tool_response>",  # Gemma 4
        "<\uff5cend\u2581of\u2581sentence\uff5c>",  # DeepSeek-OCR
        "[e~[",  # MiniMax-M2
    }
)
# fill-in-the-middle tokens that end generation: the metadata's id, else the first of these texts in the vocabulary
_FIM_EOG = {
    Keys.Tokenizer.FIM_PAD_ID: ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    Keys.Tokenizer.FIM_REP_ID: ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    Keys.Tokenizer.FIM_SEP_ID: ("<|file_sep|>",),
}


def gguf_eog_token_ids(reader: GGUFReader) -> list[int]:
    """The end-of-generation token ids of the file `reader` reads: its EOS first, then the others by id."""

    def metadata_id(key: str) -> int | None:
        field = reader.fields.get(key)
        return None if field is None else int(field.contents())

    tokens = reader.fields[Keys.Tokenizer.LIST].contents()
    ids = {i for i, t in enumerate(tokens) if t in _EOG_TEXTS}
    ids.update(i for key in (Keys.Tokenizer.EOT_ID, Keys.Tokenizer.EOM_ID) if (i := metadata_id(key)) is not None)
    index = {t: i for i, t in enumerate(tokens) if any(t in texts for texts in _FIM_EOG.values())}
    for key, texts in _FIM_EOG.items():
        fim = metadata_id(key)
        if fim is None:
            fim = next((index[t] for t in texts if t in index), None)
        if fim is not None:
            ids.add(fim)
    # llama.cpp's exceptions: <|end|> ends a message, not the generation, where <|return|> and <|call|> (or <|calls|>
    # and <|flush|>) are there; </s> is no end where <|tool_response> is (Gemma 4)
    texts = {tokens[i]: i for i in ids if 0 <= i < len(tokens)}
    if "<|end|>" in texts and (
        {"<|return|>", "<|call|>"} <= texts.keys() or {"<|calls|>", "<|flush|>"} <= texts.keys()
    ):
        ids.discard(texts["<|end|>"])
    if "</s>" in texts and "<|tool_response>" in texts:
        ids.discard(texts["</s>"])
    eos = metadata_id(Keys.Tokenizer.EOS_ID)
    ids = sorted(i for i in ids if 0 <= i < len(tokens) and i != eos)
    return ([eos] if eos is not None and 0 <= eos < len(tokens) else []) + ids
