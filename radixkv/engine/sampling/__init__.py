"""From a step's logits to its tokens (`SamplingParams`, the user's settings, is one level up).

sampler.py       seeded draws: greedy, temperature, top-k, top-p, min-p
penalties.py     logit bias, min_tokens and the repetition / presence / frequency penalties
logprobs.py      the sampled token's logprob and the top alternatives, read back with the token
grammar.py       structured output: grammars compiled once, token masks per row
jump_forward.py  the text a grammar forces, appended and computed as one extend
"""
