"""One decoding step of a Llama-family decoder (Llama, Qwen2, Qwen3), written out from the
model's own modules with static shapes, for the native engine's CUDA-graph path
(:mod:`dapo.rollout.static_decode`).

transformers' forward builds its attention mask, checks its cache and reads shapes on the
host at every call; none of that can be captured in a CUDA graph. This step does the same
arithmetic on fixed buffers: every row writes its new key and value at the same column of a
``[rows, kv_heads, capacity, head_dim]`` buffer (the column comes from a device tensor, so one
captured graph serves every step), and attends to the first ``width`` columns through a mask
that the step computes on the device from the prompt's padding and that column.

The arithmetic is transformers' under autocast, step for step: the residual stream in the
embedding's dtype (float32 master weights keep it in float32), the RMSNorm modules called as
they are, projections in the compute dtype, rotary embeddings in the residual's dtype, keys and
values held in the compute dtype. The one change of order: grouped-query attention reads each
key-value head once for its G query heads (the queries of a head group become G query rows)
instead of copying keys and values to every query head. In float32 the logits equal
transformers' forward to rounding (tested); the weights of the projections and the output
head are cast once per rollout, as autocast's weight cache casts them once per call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.fx.experimental._config
import torch.nn.functional as F

from dapo.dist.fsdp import holds_dtensors, recomputed
from dapo.models import lora, rotary
from dapo.models.compiled_layers import layer_forward, unwrapped

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
"""Decoders whose layer is this step's: pre-norm attention with rotary embeddings, a gated
MLP, RMSNorm (Qwen3's per-head query and key norms included)."""

PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
"""A layer's linear maps, each a plain ``torch.nn.Linear`` (not an adapter or a quantized
layer, whose weights are not one matrix)."""

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", rotary.PINNED)
"""Rotary embeddings whose frequencies are fixed (``dynamic``, ``longrope``: by the length, a
read on the host, unless :mod:`dapo.models.rotary` pinned them as the policy loaded)."""
FOLD_ROWS = 8192
"""Rows of a fused matrix folded at a time, in float32 (48 MiB at H = 1536)."""


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why :class:`DecoderStep` cannot run ``model`` (None when it can): another architecture,
    an activation other than SiLU, a sliding window, length-dependent rotary embeddings,
    projections that are neither plain nor LoRA Linears (:func:`linear_reason`), or modules
    whose forward was replaced or whose weights are sharded (tensor-parallel copies, FSDP)."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED_MODEL_TYPES:
        return f"model type {kind!r} (the step is written for {', '.join(SUPPORTED_MODEL_TYPES)})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"the activation {config.hidden_act!r} (the step's MLP computes SiLU)"
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        return "a sliding attention window"
    decoder = getattr(model, "model", None)
    rope = getattr(decoder, "rotary_emb", None)
    if getattr(rope, "rope_type", "default") not in STATIC_ROPE_TYPES:
        return f"rotary embeddings of type {rope.rope_type!r}"
    for name, module in model.named_modules():
        if "forward" in vars(module) and not computes_as_before(module):
            return f"module {name or 'model'} has its forward replaced (a parallel copy)"
    for i, layer in enumerate(getattr(decoder, "layers", ())):
        for name in PROJECTIONS:
            part, _, proj = name.partition(".")
            reason = linear_reason(getattr(getattr(layer, part, None), proj, None))
            if reason is not None:
                return f"layer {i}'s {name} is {reason}"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear:
        return f"the output head is a {type(head).__name__}, not a plain Linear"
    if holds_dtensors(model):
        return "DTensor parameters (sharded: FSDP or tensor-parallel)"
    return None


def computes_as_before(module: torch.nn.Module) -> bool:
    """Whether ``module``'s replaced forward is dapo's own wrapping of its class's: activation
    checkpointing (``fsdp.recomputed``) or a compiled layer (``layer_forward``), nested in any
    order. Both compute what the layer computed, so the step may read its weights."""
    wrappers, forward = unwrapped(vars(module)["forward"])
    for wrapper in wrappers:
        if wrapper.func is layer_forward:
            return wrapper.args[1:2] == (module,)
        if wrapper.func is not recomputed:
            return False
    bound = getattr(forward, "__self__", None) is module
    return bound and getattr(forward, "__func__", None) is type(module).forward


def linear_reason(module: torch.nn.Module | None) -> str | None:
    """Why the step cannot take ``module``'s weight as one matrix (None when it can): a plain
    Linear, or peft's LoRA Linear with one active adapter, not merged, not DoRA or another
    variant, without a bias of its own, whose merged weight the step computes."""
    if type(module) is torch.nn.Linear:
        return None
    base = getattr(module, "base_layer", None)
    if type(base) is not torch.nn.Linear or not hasattr(module, "get_delta_weight"):
        return f"a {type(module).__name__}, not a plain Linear or a LoRA one"
    adapters = list(getattr(module, "active_adapters", ()))
    if len(adapters) != 1 or module.disable_adapters or module.merged:
        return "LoRA with other than one active, unmerged adapter"
    if getattr(module, "use_dora", {}).get(adapters[0], False):
        return "a DoRA adapter"
    if getattr(module, "lora_bias", {}).get(adapters[0], False):
        return "a LoRA adapter with a bias of its own (lora_bias)"
    if adapters[0] in getattr(module, "lora_variant", {}):
        return "a LoRA variant, not W + scaling x B A"
    return None


def linear_weight(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) that ``module`` applies: a plain Linear's own, or a LoRA Linear's base
    weight plus its adapter's ``scaling x B A`` (a new float32 tensor: the module is left as
    it is, so nothing is merged in place and nothing can drift across updates)."""
    if type(module) is torch.nn.Linear:
        return module.weight.detach(), None if module.bias is None else module.bias.detach()
    bias = module.base_layer.bias
    return lora.merged_weight(module), None if bias is None else bias.detach()


class DecoderStep:
    """The decoding step of ``model`` with its projection weights in ``compute_dtype``.

    ``__call__`` feeds one token per row and returns the next logits [A, V] in float32;
    ``cache`` holds the layers' key and value buffers, written at column ``column_1``.

    On a GPU a decoding step is a long chain of small kernels, and their number, not their
    arithmetic, sets its time once it is a CUDA graph. So the step launches few: the rotary
    embedding turns queries and keys at once, attention takes an additive mask made once per
    step, and, when the weights must be copied into the compute dtype anyway (float32 master
    weights, bf16 matmuls: the copy autocast would make), the query, key and value
    projections are one matrix, as are the MLP's gate and up projections, and each RMSNorm's
    weight is folded into the matrix that follows it (``W diag(g)``: the norm is then one
    ``rms_norm``). Weights already in the compute dtype are used as they are: no copy.

    ``compile`` (a ``torch.compile`` backend, e.g. ``"inductor"``) compiles the step's
    inputs and its layer (:func:`step_inputs`, :func:`layer_step`, each traced once for every
    layer, batch size and width): the norms, residual adds, rotary embedding, cache writes
    and activation between the matmuls become a few fused kernels instead of ~40 a layer.
    ``compile_mode`` is ``torch.compile``'s mode (None: the backend's default;
    ``"max-autotune-no-cudagraphs"`` has inductor time its own matmul kernels against
    cuBLAS's at the first call's sizes, minutes of compiling)."""

    def __init__(
        self,
        model: torch.nn.Module,
        compute_dtype: torch.dtype | None,
        *,
        fuse: bool | None = None,
        compile: str | None = None,
        compile_mode: str | None = None,
    ) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the static decoding step cannot run this model: {reason}")
        decoder = model.model
        config = model.config
        self.decoder = decoder
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.compute_dtype = compute_dtype or decoder.embed_tokens.weight.dtype
        head = model.get_output_embeddings()
        copied = (*decoder.layers.parameters(), head.weight)
        lora = any(hasattr(m, "base_layer") for m in decoder.layers.modules())
        if fuse is None:  # adapters are merged into a copy anyway
            fuse = lora or any(p.dtype != self.compute_dtype for p in copied)
        self.fuse = fuse
        """Whether the weights are copied (then fused and folded) or used as they are
        (default: copied when they are not all in the compute dtype)."""
        self.layers = [self._layer(layer) for layer in decoder.layers]
        self.final_norm = (decoder.norm.weight, norm_eps(decoder.norm))
        self.head = self.matrices([head], decoder.norm.weight)
        rope = decoder.rotary_emb
        self.inv_freq = rope.inv_freq.float()
        self.rope_scaling = float(getattr(rope, "attention_scaling", 1.0))
        self.shape = dict(heads=self.heads, kv=self.kv_heads, dim=self.head_dim)
        self.shape["compute"] = self.compute_dtype
        self.compiled = compile is not None
        self.inputs = compiled(step_inputs, compile, compile_mode) if compile else step_inputs
        self.layer = compiled(layer_step, compile, compile_mode) if compile else layer_step

    def _cast(self, weight: torch.Tensor | None) -> torch.Tensor | None:
        return None if weight is None else weight.detach().to(self.compute_dtype).contiguous()

    def matrices(self, modules: list[torch.nn.Module], norm_weight: torch.Tensor) -> list:
        """(weight, bias) pairs mapping a norm's output to the outputs of ``modules`` in
        order: one matrix, fused, cast and with ``norm_weight`` folded in, when the step
        copies its weights; else each module's own weight and bias."""
        pairs = [linear_weight(m) for m in modules]
        if not self.fuse:
            return pairs
        # Folded in float32, then cast once (bf16 weights and norms would round twice), a
        # block of rows at a time: the whole head in float32 was two V x H temporaries.
        norm = norm_weight.detach().float()
        rows = sum(w.shape[0] for w, _ in pairs)
        weight = torch.empty((rows, norm.shape[0]), dtype=self.compute_dtype, device=norm.device)
        at = 0
        for w, _ in pairs:
            for part in w.detach().split(FOLD_ROWS):
                weight[at : at + part.shape[0]] = part.float() * norm
                at += part.shape[0]
        if all(b is None for _, b in pairs):
            return [(weight, None)]
        biases = [w.new_zeros(w.shape[0]) if b is None else b for w, b in pairs]
        return [(weight, self._cast(torch.cat(biases)))]

    def _layer(self, layer: torch.nn.Module) -> dict:
        """One layer's tensors: its matrices (fused when copied), norms (their weight None when
        folded), Qwen3's per-head query and key norms (None for the others)."""
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        return {
            "norm1": (None if self.fuse else norms[0].weight, norm_eps(norms[0])),
            "norm2": (None if self.fuse else norms[1].weight, norm_eps(norms[1])),
            "q_norm": None if q_norm is None else (q_norm.weight, norm_eps(q_norm)),
            "k_norm": None if k_norm is None else (k_norm.weight, norm_eps(k_norm)),
            "qkv": self.matrices([attn.q_proj, attn.k_proj, attn.v_proj], norms[0].weight),
            "o": tuple(map(self._cast, linear_weight(attn.o_proj))),
            "gate_up": self.matrices([mlp.gate_proj, mlp.up_proj], norms[1].weight),
            "down": tuple(map(self._cast, linear_weight(mlp.down_proj))),
            "scaling": getattr(attn, "scaling", self.head_dim**-0.5),
        }

    def new_cache(self, rows: int, width: int, device: torch.device) -> list[torch.Tensor]:
        """Keys and values of every layer, ``[rows, kv_heads, width, head_dim]`` each, in the
        compute dtype, zeroed: attention weighs the columns not yet written by 0, and 0 x NaN
        (what an uninitialised buffer may hold) would be NaN."""
        shape = (rows, self.kv_heads, width, self.head_dim)
        return [
            torch.zeros(shape, dtype=self.compute_dtype, device=device)
            for _ in range(2 * len(self.layers))
        ]

    def __call__(
        self,
        token_A: torch.Tensor,
        position_A: torch.Tensor,
        column_1: torch.Tensor,
        valid_AW: torch.Tensor,
        cache: list[torch.Tensor],
    ) -> torch.Tensor:
        """Logits [A, V] (float32) after feeding ``token_A`` at ``position_A``; its keys and
        values go to column ``column_1`` of each layer's buffer, and attention reads the
        first W columns where ``valid_AW`` is True."""
        rows = valid_AW.shape[0]
        hidden = self.decoder.embed_tokens(token_A)
        if self.compiled:
            dynamic(position_A, valid_AW, dims=(0,))
            dynamic(valid_AW, dims=(1,))
        cos, sin, bias = self.inputs(
            position_A,
            valid_AW,
            self.inv_freq,
            scaling=self.rope_scaling,
            dtype=hidden.dtype,
            compute=self.compute_dtype,
        )
        for i, w in enumerate(self.layers):
            keys, values = cache[2 * i][:rows], cache[2 * i + 1][:rows]
            if self.compiled:
                dynamic(hidden, cos, sin, bias, keys, values, dims=(0,))
                dynamic(bias, dims=(3,))
                dynamic(keys, values, dims=(2,))
            hidden = self.layer(hidden, cos, sin, bias, keys, values, column_1, w, **self.shape)
        x = rms_norm(hidden, None if self.fuse else self.final_norm[0], self.final_norm[1])
        return project(x.to(self.compute_dtype), self.head).float()


def step_inputs(
    position_A: torch.Tensor,
    valid_AW: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    scaling: float,
    dtype: torch.dtype,
    compute: torch.dtype,
):
    """(cos, signed sin [A, 1, head_dim] in ``dtype``, additive mask [A, 1, 1, W] in
    ``compute``) of a step: transformers' rotary values of each row's position, the sine's
    first half negated so that ``x cos + roll(x) sin`` is the rotation; the mask 0 where a row
    attends, -inf elsewhere."""
    freqs_AF = position_A[:, None].float() * inv_freq[None, :]
    emb_AD = torch.cat((freqs_AF, freqs_AF), dim=-1)
    cos = (emb_AD.cos() * scaling).to(dtype)
    sin = (emb_AD.sin() * scaling).to(dtype)
    half = sin.shape[-1] // 2
    signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    bias = torch.zeros(valid_AW.shape, dtype=compute, device=valid_AW.device)
    bias = bias.masked_fill(~valid_AW, float("-inf"))[:, None, None, :]
    return cos[:, None], signed[:, None], bias


def layer_step(
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    bias: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    column_1: torch.Tensor,
    w: dict,
    *,
    heads: int,
    kv: int,
    dim: int,
    compute: torch.dtype,
) -> torch.Tensor:
    """One decoder layer on the residual stream ``hidden`` [A, H]: its key and value go to
    column ``column_1`` of ``keys`` / ``values`` [A, kv, capacity, dim], and attention reads
    their first W columns through ``bias`` [A, 1, 1, W]. ``w`` holds the layer's tensors
    (:meth:`DecoderStep._layer`); everything else is a plain number, so one compiled function
    serves every layer."""
    rows, width = hidden.shape[0], bias.shape[-1]
    x = rms_norm(hidden, *w["norm1"]).to(compute)
    qkv = project(x, w["qkv"]).view(rows, heads + 2 * kv, dim)
    qk, v = qkv[:, : heads + kv], qkv[:, heads + kv :]
    if w["q_norm"] is not None:  # Qwen3: per-head norms, as transformers computes them
        qk = torch.cat(
            (head_norm(qk[:, :heads], *w["q_norm"]), head_norm(qk[:, heads:], *w["k_norm"])), 1
        )
    qk = torch.addcmul(qk * cos, qk.roll(dim // 2, dims=-1), sin).to(compute)
    keys.index_copy_(2, column_1, qk[:, heads:, None])
    values.index_copy_(2, column_1, v[:, :, None])
    q = qk[:, :heads].view(rows, kv, heads // kv, dim)
    attended = F.scaled_dot_product_attention(
        q, keys[:, :, :width], values[:, :, :width], attn_mask=bias, scale=w["scaling"]
    )
    hidden = hidden + F.linear(attended.reshape(rows, -1), *w["o"])
    x = rms_norm(hidden, *w["norm2"]).to(compute)
    gate, up = project(x, w["gate_up"]).chunk(2, dim=-1)
    return hidden + F.linear(F.silu(gate) * up, *w["down"])


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm of the residual stream (times ``weight`` unless it was folded)."""
    return F.rms_norm(hidden, hidden.shape[-1:], weight=weight, eps=eps)


def head_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3's per-head RMSNorm, transformers' arithmetic: in float32, cast back, then times
    the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@functools.cache
def compiled(fn: Callable, backend: str, mode: str | None = None) -> Callable:
    """``fn`` compiled whole by ``backend`` in ``mode`` (one wrapper per function, backend and
    mode: the traces are cached on ``fn``'s code, so a new rollout's step reuses them).

    Traced without duck sizing: by default two varying sizes that happen to be equal at the
    first call (a width and a buffer's capacity, a batch of 512 rows and a width of 512) get
    one symbol, and the first call where they differ compiles again."""
    compiled_fn = torch.compile(fn, fullgraph=True, backend=backend, mode=mode)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with torch.fx.experimental._config.patch(use_duck_shape=False):
            return compiled_fn(*args, **kwargs)

    return call


def dynamic(*tensors: torch.Tensor, dims: tuple[int, ...]) -> None:
    """Marks ``dims`` of ``tensors`` as sizes that vary between calls (batch size, attention
    width, buffer capacity), so the compiled step is traced once for all of them."""
    for tensor in tensors:
        for d in dims:
            torch._dynamo.maybe_mark_dynamic(tensor, d)


def project(x: torch.Tensor, matrices: list) -> torch.Tensor:
    """``x`` through (weight, bias) pairs, their outputs side by side."""
    if len(matrices) == 1:
        return F.linear(x, *matrices[0])
    return torch.cat([F.linear(x, *pair) for pair in matrices], dim=-1)


def norm_eps(norm: torch.nn.Module) -> float:
    """An RMSNorm module's epsilon (transformers names it ``variance_epsilon``)."""
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
