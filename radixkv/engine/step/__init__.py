"""One engine step on the device: the model runner and what it runs.

launch.py        `Steps`: launch a scheduled batch (forward, grammar masks, penalties, draw),
                 finish it (read the tokens back); overlapped steps keep one in flight
model_runner.py  `ModelRunner`: the KV tensors, the packed forward, copy-on-write, warm-up
kv_tensors.py    one pair of KV tensors per KV cache group, each pool sized by its group's kind
step_inputs.py   a step's integer inputs in one buffer (one block table and slot mapping per
                 group), one host->device copy, the attention metadata over it
cuda_graphs.py   the decode forward captured per batch-size bucket
attention.py     how a transformers model reads and writes the paged cache (the attention hook)
fused_llama.py   Llama's modules with their elementwise work fused (on Triton)
latent_attention.py  multi-head latent attention modules over the latent cache (by class)
"""
