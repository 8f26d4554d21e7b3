"""Decoding: the engine (one generator of StepEvents), a slot (one sequence's state), the batch of
slots stepped together, grammar-constrained decoding, and tokens to text."""
