"""Attention kernels: each takes queries, keys / values, a keep-mask and a bias, and returns AttnOut."""
