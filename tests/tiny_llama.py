"""Tiny randomly initialised Llama models (no download) and seeded prompts for the engine tests.

Each model comes with a word-level tokenizer ("w6 w7 ..." round-trips token for token, so chat
histories re-render exactly) and a ChatML-like template.
"""

from __future__ import annotations

import torch

VOCAB_SIZE = 256
EOS_ID = 2  # "<|im_end|>", also LlamaConfig's default eos_token_id
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ROLE_WORDS = ["system", "user", "assistant"]
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + ' ' + m['content'] + ' <|im_end|> ' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant ' }}{% endif %}"
)

TINY_CONFIGS = {
    # name: (num_attention_heads, num_key_value_heads, num_hidden_layers)
    "gqa": (4, 2, 3),
    "mha": (4, 4, 2),
}


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = SPECIAL_TOKENS + ROLE_WORDS
    words += [f"w{i}" for i in range(len(words), VOCAB_SIZE)]
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    # Only EOS is special (skipped when decoding): any reply the random model produces, even one
    # with "<|im_start|>" or the pad word in it, then re-renders to the very same ids.
    tok.add_special_tokens(["<|im_end|>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
    fast.chat_template = CHATML
    return fast


def build_bpe_chat_tokenizer():
    """A small BPE tokenizer (about 120 ids: fits the tiny models) whose ChatML specials are
    real special tokens and whose alphabet spells them as plain text too: content with
    "<|im_start|>" tokenizes to one special id, or with `split_special_tokens` to ordinary ones."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.BPEDecoder()
    specials = ["[UNK]", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=specials, show_progress=False)
    corpus = ["system user assistant obey me hi there < | > _ im start end secret rules"] * 20
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", unk_token="[UNK]")
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return fast


def build_char_tokenizer():
    """A character-level BPE tokenizer (at most VOCAB_SIZE ids: fits the tiny models) whose
    alphabet is printable ASCII: it spells any JSON, regex or tool-call text made of those
    characters, for the structured-output tests. Same specials and EOS as `build_tokenizer`."""
    import string

    from tokenizers import Tokenizer, decoders, models, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<|endoftext|>"))
    tok.decoder = decoders.Fuse()  # tokens joined as they are: the text round-trips
    alphabet = [c for c in string.printable if c not in "\x0b\x0c\r"]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
        show_progress=False,
    )
    corpus = [
        '{"name": "value", "items": [1, 2, 3], "ok": true, "x": null, "n": -1.5e3}',
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
        "system user assistant tool: function arguments parameters",
    ]
    tok.train_from_iterator(corpus * 50, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", unk_token="<|endoftext|>"
    )
    fast.chat_template = CHATML
    return fast


def _tiny_sizes(heads: int, kv_heads: int, layers: int) -> dict:
    """The config fields every tiny test model shares, for `heads` / `kv_heads` / `layers`."""
    return dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        # Wider than the default 0.02 so greedy choices are not near-ties that float noise flips.
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=EOS_ID,
        pad_token_id=0,
        tie_word_embeddings=False,
    )


def build_model(kind: str, seed: int = 0, max_position_embeddings: int = 1024):
    from transformers import LlamaConfig, LlamaForCausalLM

    heads, kv_heads, layers = TINY_CONFIGS[kind]
    config = LlamaConfig(
        **_tiny_sizes(heads, kv_heads, layers), max_position_embeddings=max_position_embeddings
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def build_qwen2(seed: int = 0):
    """A tiny Qwen2 (biased q/k/v projections): a model class the runner does not fuse, which
    keeps transformers' modules and the generic attention hooks."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**_tiny_sizes(4, 2, 2), max_position_embeddings=1024)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).eval()


def random_prompts(
    seed: int, num: int, *, shared_prefix: int = 0, min_len: int = 3, max_len: int = 40
) -> list[list[int]]:
    """Seeded prompts of ordinary word tokens (ids >= 6: no specials, no role words)."""
    gen = torch.Generator().manual_seed(seed)
    low = len(SPECIAL_TOKENS) + len(ROLE_WORDS)
    prefix = torch.randint(low, VOCAB_SIZE, (shared_prefix,), generator=gen).tolist()
    prompts = []
    for _ in range(num):
        n = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
        prompts.append(prefix + torch.randint(low, VOCAB_SIZE, (n,), generator=gen).tolist())
    return prompts
