"""Rewards: the task registry (tasks/), the verifier worker pool and its worker.

Nothing here imports torch, numpy or transformers: verifier worker processes import this
package, and each would pay seconds and hundreds of MB for them."""
