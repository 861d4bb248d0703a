"""Training: the state (state), the step (step) and the sources of its rollouts (sources: in turn;
generator_thread; generator_ranks), the rounds they draw (rounds) with dynamic sampling
(sampling), the update (update) over the one micro-batch loop (microbatches) after pi_old
(old_logprobs), who trains what under ranks (exchange), the loop around the step (loop) and what
a resume checks and how it ends a run with no step left (resume), the run's inputs and their
checks (inputs), the memory each GPU holds (gpu_memory, laid out by memory_table) and the bench
of a few steps (bench).
"""
