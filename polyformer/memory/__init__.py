"""Memories that keys come from: the decode state (KV cache); XL, compressive and kNN memories later."""
