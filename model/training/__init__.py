"""Training-side code: corpus preparation, tokenizer, training loop and held-out evaluation."""
