"""The native engine's GPU decoding loop: static buffers, no host read per token, and each
decoding step replayed as a CUDA graph.

:func:`dapo.rollout.native.decode` asks the host something at every token (is a logit NaN,
which rows finished, which rows to drop), so on a GPU each step waits for the last one and
the time goes to launching kernels. Here the host only counts steps:

- every buffer is allocated once: the KV cache ``[rows, kv_heads, P + T, head_dim]``
  (:class:`~dapo.rollout.decoder_step.DecoderStep`), each row's next token, position, output
  row and whether it finished, the step number and the cache column (device tensors that the
  step advances itself), the outputs ``[B + 1, T]`` (row B takes what padding slots write);
- a step samples, records and checks stop tokens on the device: a finished row keeps being
  computed (its outputs are not written) until the next read-back;
- every ``CHECK_EVERY`` steps one read-back asks which rows are still running (and whether any
  logit was NaN or +inf); the running rows then move to the front of the buffers and the
  batch shrinks to the smallest of a few sizes (``B`` and the powers of two below it) that
  holds them, and the loop ends when none runs;
- attention reads the first ``WIDTH_STEP``-multiple of columns that holds the filled ones;
- on CUDA each (batch size, width) step is captured once as a CUDA graph, right after the
  same step ran eagerly, and replayed from then on;
- with ``compile`` (``rollout.compile_step``) the step's layer is a compiled function
  (:class:`~dapo.rollout.decoder_step.DecoderStep`), as is the draw's pass over the logits
  (:func:`~dapo.rollout.block_draw.block_masses`), each traced once for all sizes: so that no
  size is traced as a constant, the batch never shrinks below 2 rows and the cache holds
  ``SPARE_COLUMNS`` beyond the widest attention.

What is drawn is the eager loop's: the same uniforms ``u[t, b]`` (:class:`Uniforms`, moved to
the device ``UNIFORM_BLOCK`` steps at a time), the same inverse-CDF sampling, the same log-probs
and stop rule; a row's token depends only on its logits and ``u``, so which rows share the batch
changes nothing beyond rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from dapo.models.logprobs import autocast, prompt_pass, returned_cache
from dapo.rollout.decoder_step import DecoderStep
from dapo.rollout.parking import Parking
from dapo.rollout.sampling import NONFINITE_LOGITS, Uniforms, draw_tokens

CHECK_EVERY = 16
"""Steps between read-backs of which rows still run: the only reads on the host."""

WIDTH_STEP = 256
"""Attention reads cache columns in multiples of this (one graph per multiple in use); a
multiple of 16."""

SPARE_COLUMNS = 16
"""Columns the KV cache holds beyond the widest attention when the step is compiled: a trace
whose attention width is the buffer's whole capacity takes that equality for a rule (and the
strides that follow from it), and the next width would compile the step again."""

UNIFORM_BLOCK = 256
"""Steps of uniforms moved to the device at once."""


def batch_sizes(rows: int, smallest: int = 1) -> list[int]:
    """The batch sizes the loop runs at: ``rows`` and the powers of two below it, from
    ``smallest`` on."""
    sizes, size = {rows}, smallest
    while size < rows:
        sizes.add(size)
        size *= 2
    return sorted(sizes)


def read_back(tensor: torch.Tensor) -> list:
    """The one way the loop reads the device: a copy to the host (a wait for the queue)."""
    return tensor.cpu().tolist()


class State:
    """The device buffers of one rollout (``S`` slots: the rows in the batch, running first)."""

    def __init__(
        self,
        step: DecoderStep,
        prompt_mask_nP,
        *,
        group_size: int,
        steps: int,
        pad: int,
        spare: int = 0,
        width_step: int = WIDTH_STEP,
    ) -> None:
        if width_step <= 0 or width_step % 16:
            raise ValueError(f"width_step={width_step}: give a positive multiple of 16")
        self.width_step = width_step
        """Attention reads the cache's columns in multiples of this (one graph each)."""
        device = prompt_mask_nP.device
        n, prompt = prompt_mask_nP.shape
        self.rows, self.prompt, self.steps = n * group_size, prompt, steps
        # A multiple of 16 columns: fused attention kernels pad a mask whose rows are not.
        self.width = width = -(-(prompt + steps) // 16) * 16
        mask_BP = prompt_mask_nP.bool().repeat_interleave(group_size, dim=0)
        self.prompt_valid_SW = torch.zeros((self.rows, width), dtype=torch.bool, device=device)
        self.prompt_valid_SW[:, :prompt] = mask_BP
        self.columns_W = torch.arange(width, device=device)
        self.position_S = mask_BP.long().sum(dim=1)
        self.row_S = torch.arange(self.rows, device=device)
        self.done_S = torch.zeros(self.rows, dtype=torch.bool, device=device)
        self.park_S = torch.zeros(self.rows, dtype=torch.bool, device=device)
        self.bad_1 = torch.zeros(1, dtype=torch.bool, device=device)
        # Steps drawn since the last that had a running row (the response length's slack).
        self.idle_1 = torch.zeros(1, dtype=torch.long, device=device)
        self.token_S = torch.zeros(self.rows, dtype=torch.long, device=device)
        self.t_1 = torch.zeros(1, dtype=torch.long, device=device)
        self.column_1 = torch.full((1,), prompt, dtype=torch.long, device=device)
        self.cache = step.new_cache(self.rows, width + spare, device)
        self.tokens_flat = torch.full(
            ((self.rows + 1) * steps,), pad, dtype=torch.long, device=device
        )
        self.logprobs_flat = torch.zeros((self.rows + 1) * steps, device=device)
        self.u_flat = torch.zeros(
            UNIFORM_BLOCK * (self.rows + 1), dtype=torch.float64, device=device
        )

    def compact(self, slots: list[int], size: int, filled: int) -> None:
        """Slots ``slots`` (running rows) move to the front; the batch is ``size`` slots, the
        ones after the running rows copies of the first, which write nowhere. Only the first
        ``filled`` cache columns are moved: the others hold nothing yet."""
        device = self.row_S.device
        order = torch.tensor(slots + [slots[0]] * (size - len(slots)), device=device)
        for buf in self.cache:
            buf[:size, :, :filled] = buf[order, :, :filled]
        for name in ("prompt_valid_SW", "position_S", "row_S", "done_S", "park_S", "token_S"):
            buf = getattr(self, name)
            buf[:size] = buf[order]
        self.row_S[len(slots) : size] = self.rows
        self.done_S[len(slots) : size] = True


def static_decode(
    model: torch.nn.Module,
    prompt_ids_nP: torch.Tensor,
    prompt_mask_nP: torch.Tensor,
    *,
    group_size: int,
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    pad_token_id: int,
    compute_dtype: torch.dtype | None = None,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int | Sequence[int] = 0,
    greedy: bool = False,
    ignore_eos: bool = False,
    graphs: bool | None = None,
    compile: str | None = None,
    compile_mode: str | None = None,
    width_step: int | None = None,
    parking: Parking | None = None,
    prefix=None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """:func:`dapo.rollout.native.decode`'s contract (same arguments and results, parking and
    prefix included) on static buffers; ``graphs`` (default: on CUDA) replays each step shape
    as a CUDA graph; ``compile`` (a ``torch.compile`` backend) compiles the step's layer and
    inputs, in ``torch.compile``'s ``compile_mode``; attention reads columns in multiples of
    ``width_step`` (default ``WIDTH_STEP``; a multiple of 16)."""
    device = prompt_ids_nP.device
    step = DecoderStep(model, compute_dtype, compile=compile, compile_mode=compile_mode)
    spare = 0 if compile is None else SPARE_COLUMNS
    state = State(
        step,
        prompt_mask_nP,
        group_size=group_size,
        steps=max_new_tokens,
        pad=pad_token_id,
        spare=spare,
        width_step=width_step or WIDTH_STEP,
    )
    logits_BV = _prefill(
        model, state, prompt_ids_nP, prompt_mask_nP, group_size, compute_dtype, prefix
    )
    stops = torch.tensor(list(stop_token_ids), dtype=torch.long, device=device)
    masked = stops if ignore_eos else None
    draw = dict(temperature=temperature, top_p=top_p, greedy=greedy, masked_tokens=masked)
    # The draw's pass over the logits is compiled as the step is: fused, traced once.
    draw.update(check=False, by_blocks=True, compile=compile, compile_mode=compile_mode)
    decoding = Decoding(step, state, draw, stops=None if ignore_eos else stops, pad=pad_token_id)
    decoding.park = None if parking is None or ignore_eos else parking.stops
    uniforms = Uniforms(seed, num_prompts=prompt_ids_nP.shape[0], group_size=group_size)
    _fill_uniforms(state, uniforms, 0)
    decoding.record(logits_BV, state.rows)
    runner = Runner(decoding.advance, device.type == "cuda" if graphs is None else graphs)
    # A compiled step is traced for a batch of any size but 1 (a size-1 dimension is traced
    # as a constant): the batch never shrinks below 2 rows, which would compile it again.
    steps, slots = _loop(
        state, runner, uniforms, smallest=1 if compile is None else 2, parking=parking
    )
    tokens = state.tokens_flat.view(state.rows + 1, state.steps)[: state.rows, :steps]
    logprobs = state.logprobs_flat.view(state.rows + 1, state.steps)[: state.rows, :steps]
    return tokens, logprobs, slots


class Decoding:
    """A step's work on the device: the forward pass, the draw, the record, the stop test."""

    def __init__(self, step: DecoderStep, state: State, draw: dict, *, stops, pad: int):
        self.step, self.state, self.draw, self.stops, self.pad = step, state, draw, stops, pad
        self.park: torch.Tensor | None = None
        """The tokens whose rows park (:mod:`dapo.rollout.parking`), marked in ``park_S``."""

    def record(self, logits_AV: torch.Tensor, size: int) -> None:
        """Sample step t for the first ``size`` slots and record it; t moves on."""
        state = self.state
        t = state.t_1
        running = ~state.done_S[:size]
        u_index = (t % UNIFORM_BLOCK) * (state.rows + 1) + state.row_S[:size]
        token, logp = draw_tokens(logits_AV, state.u_flat.index_select(0, u_index), **self.draw)
        finite = torch.isfinite(logits_AV.amax(dim=-1)) | ~running
        torch.logical_or(state.bad_1, ~finite.all(), out=state.bad_1)
        state.idle_1.copy_(torch.where(running.any(), 0, state.idle_1 + 1))
        out_index = state.row_S[:size] * state.steps + t
        state.tokens_flat.index_copy_(0, out_index, token.where(running, self.pad))
        state.logprobs_flat.index_copy_(0, out_index, logp.where(running, 0.0))
        if self.stops is not None:
            stopped = (token[:, None] == self.stops[None, :]).any(dim=1) & running
            state.done_S[:size] |= stopped
            if self.park is not None:
                parks = (token[:, None] == self.park[None, :]).any(dim=1)
                state.park_S[:size] |= stopped & parks
        state.token_S[:size] = token
        state.t_1 += 1

    def advance(self, size: int, width: int) -> None:
        """Step t: feed the last tokens (attention over ``width`` columns), then sample."""
        state = self.state
        columns = state.columns_W[:width]
        fresh = (columns >= state.prompt) & (columns <= state.column_1)
        valid = state.prompt_valid_SW[:size, :width] | fresh
        logits = self.step(
            state.token_S[:size], state.position_S[:size], state.column_1, valid, state.cache
        )
        self.record(logits, size)
        state.position_S[:size] += 1
        state.column_1 += 1


def _loop(
    state: State, runner: Runner, uniforms: Uniforms, smallest: int, parking: Parking | None
) -> tuple[int, int]:
    """Steps 1 .. T-1, reading back every ``CHECK_EVERY``, the batch never below ``smallest``
    rows (unless it starts below); (steps any row drew at, slots computed). The rows to park
    are handed to ``parking`` as they leave the batch, or at the end."""
    sizes = batch_sizes(state.rows, smallest)
    size = slots = state.rows  # step 0 (after the prefill) samples every row
    if state.steps == 1 and read_back(state.bad_1)[0]:  # the read-backs below never come
        raise FloatingPointError(NONFINITE_LOGITS)
    t, idle = 1, 0
    while t < state.steps:
        if t % UNIFORM_BLOCK == 0:
            _fill_uniforms(state, uniforms, t)
        width = min(state.width, -(-(state.prompt + t) // state.width_step) * state.width_step)
        runner.run(size, width)
        slots += size  # every slot of the bucket: finished rows and padding copies too
        t += 1
        if t % CHECK_EVERY and t < state.steps:
            continue
        finished = state.done_S[:size] | (state.row_S[:size] == state.rows)
        parks = state.park_S[:size] if parking is not None else finished[:0]
        idle, bad, *flags = read_back(torch.cat([state.idle_1, state.bad_1, finished, parks]))
        if bad:
            raise FloatingPointError(NONFINITE_LOGITS)
        running = [slot for slot, done in enumerate(flags[:size]) if not done]
        parked = [slot for slot, park in enumerate(flags[size:]) if park]
        if not running:
            break
        smaller = next(s for s in sizes if s >= len(running))
        if smaller < size:
            _park(state, parking, parked, state.prompt + t)  # before they are overwritten
            state.compact(running, smaller, filled=state.prompt + t)
            size = smaller
    if parking is not None:  # the rows to park that are still in the batch
        parked = [slot for slot, park in enumerate(read_back(state.park_S[:size])) if park]
        _park(state, parking, parked, state.prompt + t)
    # T is the longest response: the steps after every row finished drew nothing.
    return t - idle, slots


def _park(state: State, parking: Parking | None, slots: list[int], columns: int) -> None:
    """Hand ``parking`` the caches of the finished ``slots`` whose rows stopped at a turn end
    (a slot's columns past its stop hold what it computed after it, which is not used)."""
    if parking is None or not slots:
        return
    index = torch.tensor(slots, device=state.row_S.device)
    first = state.prompt - state.prompt_valid_SW[index, : state.prompt].sum(dim=1)
    rows = state.row_S[index].tolist()
    parking.take(index, rows, state.cache, min(columns, state.cache[0].shape[2]), first.tolist())


def _fill_uniforms(state: State, uniforms: Uniforms, start: int) -> None:
    """u[t, b] of steps ``start`` .. ``start + UNIFORM_BLOCK`` onto the device (row B: 0)."""
    block = torch.zeros((UNIFORM_BLOCK, state.rows + 1), dtype=torch.float64)
    for k in range(min(UNIFORM_BLOCK, state.steps - start)):
        block[k, : state.rows] = uniforms.step(start + k)
    if state.u_flat.is_cuda:
        block = block.pin_memory()
    state.u_flat.copy_(block.view(-1), non_blocking=True)


def _prefill(model, state, prompt_ids_nP, prompt_mask_nP, group_size, compute_dtype, prefix):
    """One forward pass per prompt through the model itself (after the ``prefix`` columns,
    when given); its keys and values copied into the static cache (each prompt's G times),
    its last logits [B, V] repeated G times."""
    with autocast(model, compute_dtype, prompt_ids_nP.device):
        out = prompt_pass(model, prompt_ids_nP, prompt_mask_nP, prefix)
    prompt = prompt_ids_nP.shape[1]
    for i, layer in enumerate(returned_cache(out).layers):
        for buf, src in ((state.cache[2 * i], layer.keys), (state.cache[2 * i + 1], layer.values)):
            buf[:, :, :prompt].unflatten(0, (-1, group_size)).copy_(src[:, None])
    return out.logits[:, -1].float().repeat_interleave(group_size, dim=0)


class Runner:
    """Runs ``advance(size, width)``: eagerly, or on CUDA as graphs captured on first use."""

    def __init__(self, advance: Callable[[int, int], None], graphs: bool) -> None:
        self.advance, self.graphs = advance, graphs
        self.captured: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle() if graphs else None

    def run(self, size: int, width: int) -> None:
        if not self.graphs:
            self.advance(size, width)
            return
        graph = self.captured.get((size, width))
        if graph is not None:
            graph.replay()
            return
        # This step runs eagerly (on a side stream, as capture needs its kernels warmed),
        # then the same step is recorded, not run, for the following ones.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.advance(size, width)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the trainer's thread may use the GPU meanwhile (generation ahead of
        # training runs this in a thread of its own).
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self.advance(size, width)
        self.captured[(size, width)] = graph
