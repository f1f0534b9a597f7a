"""Training: the built-in corpus and the demo loop (the full command line comes with its own issue)."""
