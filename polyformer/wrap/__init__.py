"""The sequence wrappers, one file each, and the pieces they share (`polyformer.wrappers` re-exports them)."""
