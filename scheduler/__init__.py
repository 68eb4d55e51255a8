"""Continuous-batching scheduler over the prefix cache. Imported as `radixkv.scheduler`."""
