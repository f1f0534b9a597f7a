"""Positional schemes: rotary (on q/k), sinusoids (absolute, position-infused), score biases."""
