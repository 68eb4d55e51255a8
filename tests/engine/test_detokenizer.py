"""Incremental detokenisation never splits a multi-byte character."""

from __future__ import annotations

import pytest

from radixkv.engine.detokenizer import IncrementalDetokenizer


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


@pytest.mark.parametrize("text", ["plain ascii", "héllo wörld", "a🙂b 🙂🙂 日本語", "🙂"])
def test_one_token_at_a_time(byte_tokenizer, text):
    ids = byte_tokenizer.encode(text)
    detok = IncrementalDetokenizer(byte_tokenizer)
    deltas = [detok.push([t]) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.finish() == text
    assert "".join(deltas) == text  # nothing was pending at the end


def test_special_tokens_are_skipped_and_a_dangling_byte_is_flushed(byte_tokenizer):
    ids = byte_tokenizer.encode("ok 🙂")
    detok = IncrementalDetokenizer(byte_tokenizer)
    # The emoji's last byte never comes: the held-back bytes are flushed by finish().
    text = "".join(detok.push([t]) for t in [*ids[:-1], byte_tokenizer.eos_token_id])
    assert text == "ok "
    assert detok.finish() == byte_tokenizer.decode(ids[:-1], skip_special_tokens=True)[3:]


def test_without_tokenizer_there_is_no_text():
    detok = IncrementalDetokenizer(None)
    assert detok.push([1, 2, 3]) == "" and detok.finish() == ""
