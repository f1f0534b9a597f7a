"""Generation: sampling filters and the autoregressive wrapper."""
