"""Models: loading a policy and its tokenizer, log-prob and entropy passes, GGUF import, the
embedded demo model."""
