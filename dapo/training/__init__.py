"""Training: the step (step), its update phase (update), dynamic sampling (sampling), the loop
around them (loop), the run's inputs and their checks (inputs), the memory plan of a run on
GPUs (memory_plan, laid out by memory_table) and the bench of a few steps (bench).
"""
