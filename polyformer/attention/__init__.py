"""Attention, as stages: projection, position, key source, pattern, bias, kernel, output."""
