"""Incremental detokenisation never splits a multi-byte character, and both of its paths (the
`tokenizers` DecodeStream and the decoding window) give exactly `tokenizer.decode`'s text."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.engine.model import detokenizer
from radixkv.engine.model.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def byte_tokenizer():
    """Byte-level BPE without merges: one token per UTF-8 byte, so 🙂 takes four tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@pytest.fixture(scope="module")
def metaspace_tokenizer():
    """SentencePiece-style (Llama 2's decoder): "▁" marks a space, the first one is stripped,
    characters outside the vocabulary fall back to <0xNN> byte tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["▁", "▁Hello", "▁world", "!", "▁the", "é", "日本", "▁語"]
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [], byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1, right=0),
        ]
    )
    tok.add_special_tokens(["<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def word_tokenizer():
    from tiny_llama import build_tokenizer

    return build_tokenizer()


@pytest.fixture(params=["stream", "window"])
def path(request, monkeypatch):
    """Run a test on the DecodeStream path and on the window path."""
    if request.param == "window":
        monkeypatch.setattr(detokenizer, "_decode_stream", lambda tokenizer: None)
    return request.param


def stream_text(tokenizer, ids, chunk: int = 1) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    rest = detok.finish()
    assert detok.emitted == "".join(deltas) + rest
    return deltas, rest


@pytest.mark.parametrize("text", ["plain ascii", "héllo wörld", "a🙂b 🙂🙂 日本語", "🙂"])
def test_one_token_at_a_time(byte_tokenizer, path, text):
    ids = byte_tokenizer.encode(text)
    deltas, rest = stream_text(byte_tokenizer, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text and rest == ""  # nothing was pending at the end


def test_special_tokens_are_skipped_and_a_cut_character_is_dropped(byte_tokenizer, path):
    ids = byte_tokenizer.encode("ok 🙂 x🙂")
    detok = IncrementalDetokenizer(byte_tokenizer)
    # The last emoji's last byte never comes (a reply cut by max_tokens): the reply ends before
    # that character, not in the U+FFFD its first bytes decode to.
    text = "".join(detok.push([t]) for t in [*ids[:-1], byte_tokenizer.eos_token_id])
    assert byte_tokenizer.decode(ids[:-1], skip_special_tokens=True).endswith("\ufffd")
    assert text + detok.finish() == "ok 🙂 x" == detok.emitted


def test_the_fast_path_serves_the_tokenizers_backed_tokenizers(
    byte_tokenizer, metaspace_tokenizer, word_tokenizer
):
    for tokenizer in (byte_tokenizer, metaspace_tokenizer, word_tokenizer):
        assert IncrementalDetokenizer(tokenizer)._stream is not None
    word_tokenizer.clean_up_tokenization_spaces = True  # decode() would post-process the text
    try:
        assert IncrementalDetokenizer(word_tokenizer)._stream is None
    finally:
        word_tokenizer.clean_up_tokenization_spaces = False


TOKENIZERS = ["byte_tokenizer", "metaspace_tokenizer", "word_tokenizer"]


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_any_text_streams_to_exactly_its_decode(request, name, data):
    """Random text (multi-byte UTF-8, CJK, emoji, runs of spaces; characters outside a
    vocabulary become byte-fallback or unknown tokens) with special tokens inserted anywhere,
    fed one token at a time or in chunks: both paths emit exactly `decode`'s text."""
    tokenizer = request.getfixturevalue(name)
    alphabet = st.sampled_from(list("ab ,!éü日本語🙂—") + ["Hello", " world", " the", "\n"])
    text = "".join(data.draw(st.lists(alphabet, max_size=12)))
    ids = tokenizer.encode(text, add_special_tokens=False)
    specials = sorted(tokenizer.all_special_ids)
    for _ in range(data.draw(st.integers(0, 3))):
        ids.insert(data.draw(st.integers(0, len(ids))), data.draw(st.sampled_from(specials)))
    chunk = data.draw(st.integers(1, 3))
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    fast, fast_rest = stream_text(tokenizer, ids, chunk)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(detokenizer, "_decode_stream", lambda tokenizer: None)
        slow, slow_rest = stream_text(tokenizer, ids, chunk)
    assert "".join(fast) + fast_rest == expected == "".join(slow) + slow_rest
    assert all(not d.endswith("\ufffd") for d in fast + slow)


def test_a_stream_that_fails_falls_back_to_full_decodes(metaspace_tokenizer, monkeypatch):
    ids = metaspace_tokenizer.encode("Hello world! the 日本 é 語", add_special_tokens=False)
    detok = IncrementalDetokenizer(metaspace_tokenizer)
    first = detok.push(ids[:3])

    class Broken:
        def step(self, tokenizer, token):
            raise Exception("Invalid prefix encountered")

    detok._stream = (Broken(), detok._stream[1])
    rest = "".join(detok.push([t]) for t in ids[3:]) + detok.finish()
    assert detok._stream is None
    assert first + rest == metaspace_tokenizer.decode(ids, skip_special_tokens=True)


def test_without_tokenizer_there_is_no_text():
    detok = IncrementalDetokenizer(None)
    assert detok.push([1, 2, 3]) == "" and detok.finish() == ""


@pytest.mark.slow
def test_smollm2s_tokenizer_streams_its_text_exactly():
    """The embedded model's tokenizer (byte-level BPE with chat specials) on text with emoji,
    CJK and special tokens, and on random ids."""
    from transformers import AutoTokenizer

    from radixkv.engine.model.model_loader import load_model

    folder = os.path.join(os.path.expanduser("~"), ".cache", "radixkv", "models")
    name = "SmolLM2-135M-Instruct"
    if not os.path.isdir(os.path.join(folder, name)):
        load_model(None)  # converts the bundled model once
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(folder, name))
    text = "<|im_start|>assistant\nBonjour 🙂 — 日本語 «ok»<|im_end|>\n  x"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert IncrementalDetokenizer(tokenizer)._stream is not None
    deltas, rest = stream_text(tokenizer, ids)
    assert "".join(deltas) + rest == tokenizer.decode(ids, skip_special_tokens=True)
    import random

    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(len(tokenizer)) for _ in range(30)]
        deltas, rest = stream_text(tokenizer, ids, chunk=rng.randint(1, 3))
        assert "".join(deltas) + rest == tokenizer.decode(ids, skip_special_tokens=True)
