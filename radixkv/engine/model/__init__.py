"""The model and its tokenizer: loading, what its layers cache, text in and out.

model_loader.py      a model and tokenizer from a folder, a Hugging Face id or the embedded one
attention_layout.py  what each layer does in attention, read from the model at load, and the
                     layers by KV cache group (the one place above the cache naming group kinds)
chat_template.py     chat messages through the tokenizer's template
prompts.py           the door's checks of prompts, params and chat messages
detokenizer.py       incremental detokenization (text that never takes back what it emitted)
"""
