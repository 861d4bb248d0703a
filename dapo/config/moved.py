"""Config keys that moved: an old name in a file or an override is read at its new place,
with a one-line notice (:func:`dapo.config.loading.load_config`)."""

MOVED_KEYS = {
    "data.num_train": "arith.num_train",
    "data.num_val": "arith.num_val",
    "data.num_warmup": "arith.num_warmup",
    "data.min_terms": "arith.min_terms",
    "data.max_terms": "arith.max_terms",
    "data.operators": "arith.operators",
    "data.solution": "arith.solution",
    "data.seed": "arith.seed",
    "model.cache_dir": "embedded.cache_dir",
    "model.sft_steps": "embedded.sft_steps",
    "model.embedded_hidden": "embedded.hidden",
    "model.embedded_layers": "embedded.layers",
    # dtype cast the whole model, so AdamW stepped bf16 weights; compute_dtype keeps float32
    # weights and optimizer state and computes in it.
    "model.dtype": "model.compute_dtype",
    # The logging settings are the run section's; an early issue named them logging.*.
    "logging.wandb": "run.wandb",
    "logging.wandb_project": "run.wandb_project",
    "logging.tensorboard": "run.tensorboard",
}
"""Old key -> its place now (configs saved by dapo 0.1, and names given before the keys
settled)."""
