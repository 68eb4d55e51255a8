"""The tiers below the device pool, the engine's side: the cache plans the moves, these run them.

tier_io.py         `TierIO`: one mover per KV cache group (host copies, block files), measured;
                   `make_tier_ios` splits the host and disk budgets between the groups
tier_moves.py      a step's moves run group by group, and what a failed one means for its rows
host_kv.py         the host pool's storage and the batched device <-> host copies
disk_store.py      full blocks as content-addressed, fingerprinted, checked files
kv_fingerprint.py  what KV written by this engine depends on (model, dtype, layout, versions)
"""
