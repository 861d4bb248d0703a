"""The GPU path of packed attention (``varlen_packed``: one variable-length flash-attention
call) checked on the CPU: PyTorch's ``varlen_attn`` runs on CUDA only, so a stand-in with its
signature and its documented semantics (segments given by int32 offsets, causal aligned at each
segment's last key, GQA) computes each segment with SDPA. The layout the project builds (the
offsets, the gathered prompt keys of later responses) must then give the per-response loop's
outputs and gradients, which tests/test_packing.py ties to the padded forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dapo.models import packing
from dapo.models.packing import looped_packed, varlen_dtype, varlen_layout, varlen_packed

GROUPS = (
    (3, (4, 0, 2)),  # a shared prompt, an empty response between two
    (2, ()),  # a prompt alone
    (5, (1,)),
    (1, (0, 6, 3)),  # the first response empty
)


def stand_in(gqa_argument: bool):
    """A CPU ``varlen_attn`` (PyTorch 2.13's signature, or 2.11's without ``enable_gqa``)."""

    def attend(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), **kw):
        assert cu_q.dtype == cu_k.dtype == torch.int32 and window_size == (-1, 0)
        assert set(kw) == ({"enable_gqa"} if gqa_argument else set())
        q_lens, k_lens = cu_q.diff().tolist(), cu_k.diff().tolist()
        assert max(q_lens) == max_q and max(k_lens) == max_k
        out = []
        for qs, ks, nq, nk in zip(
            cu_q[:-1].tolist(), cu_k[:-1].tolist(), q_lens, k_lens, strict=True
        ):
            # Causal aligned at the end: query i sees keys j <= i + nk - nq.
            allowed = torch.ones(nq, nk, dtype=torch.bool).tril(diagonal=nk - nq)
            out.append(
                F.scaled_dot_product_attention(
                    *(
                        x[s : s + n].transpose(0, 1)
                        for x, s, n in ((q, qs, nq), (k, ks, nk), (v, ks, nk))
                    ),
                    attn_mask=allowed,
                    scale=scale,
                    enable_gqa=True,
                ).transpose(0, 1)
            )
        return torch.cat(out)

    return attend


def qkv(seed: int, heads: int = 4, kv_heads: int = 2, d: int = 8):
    n = sum(p + sum(rs) for p, rs in GROUPS)
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(1, h, n, d, generator=g, dtype=torch.float64, requires_grad=True)
        for h in (heads, kv_heads, kv_heads)
    ]


def test_layout_offsets_by_hand():
    layout = varlen_layout(GROUPS, torch.device("cpu"))
    # Segments: [prompt 3 + 4], [2 after the prompt], [prompt 2], [5 + 1], [1 + 6], [3].
    assert layout.cu_q.tolist() == [0, 7, 9, 11, 17, 24, 27]
    assert layout.cu_k.tolist() == [0, 7, 12, 14, 20, 27, 31]
    assert (layout.max_q, layout.max_k) == (7, 7)
    later = [0, 1, 2, 7, 8]  # the first group's prompt, then its third response's two tokens
    last = [17, 24, 25, 26]  # the fourth group's prompt, then its third response
    assert layout.key_index.tolist() == [
        *range(7),
        *later,
        9,
        10,
        *range(11, 17),
        *range(17, 24),
        *last,
    ]
    alone = varlen_layout(((3, (4,)), (2, (5,))), torch.device("cpu"))
    assert alone.key_index is None and alone.cu_k.tolist() == alone.cu_q.tolist() == [0, 7, 14]


@pytest.mark.parametrize("gqa_argument", [True, False])
def test_one_varlen_call_gives_the_loop(monkeypatch, gqa_argument):
    monkeypatch.setattr(packing, "varlen_kernel", lambda: (stand_in(gqa_argument), gqa_argument))
    q, k, v = qkv(0)
    looped = looped_packed(q, k, v, GROUPS, scale=0.3)
    g = torch.Generator().manual_seed(1)
    upstream = torch.randn(looped.shape, generator=g, dtype=torch.float64)
    want = torch.autograd.grad((looped * upstream).sum(), (q, k, v))
    one_call = varlen_packed(q, k, v, GROUPS, scale=0.3)
    got = torch.autograd.grad((one_call * upstream).sum(), (q, k, v))
    assert one_call.shape == looped.shape == (1, q.shape[2], 4, 8)
    torch.testing.assert_close(one_call, looped, rtol=1e-12, atol=1e-12)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_the_attention_function_takes_the_varlen_path_where_it_applies(monkeypatch):
    """One call for the whole micro-batch, in the dtype ``varlen_dtype`` names: under autocast
    the rotary embedding hands over float32 queries, cast to bf16 as SDPA would cast them."""
    calls = []

    def counted(q, k, v, cu_q, *args, **kwargs):
        calls.append((cu_q.tolist(), q.dtype, k.dtype, v.dtype))
        return stand_in(True)(q, k, v, cu_q, *args, **kwargs)

    monkeypatch.setattr(packing, "varlen_kernel", lambda: (counted, True))
    monkeypatch.setattr(packing, "varlen_dtype", lambda query: torch.bfloat16)
    q, k, v = (x.detach().float() for x in qkv(2))
    module = torch.nn.Module().eval()
    out, _ = packing.packed_attention(module, q, k, v, None, packed_groups=GROUPS)
    assert calls == [([0, 7, 9, 11, 17, 24, 27], *[torch.bfloat16] * 3)]
    want = looped_packed(*(x.bfloat16() for x in (q, k, v)), GROUPS)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, want, rtol=0, atol=1e-2)


def test_varlen_runs_on_half_precision_cuda_tensors_only():
    assert varlen_dtype(torch.zeros(1, 2, 3, 8)) is None
    assert varlen_dtype(torch.zeros(1, 2, 3, 8, dtype=torch.bfloat16)) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert varlen_dtype(torch.zeros(1, 2, 3, 8)) is None
    assert varlen_dtype(torch.zeros(1, 2, 3, 8, device="meta")) is None  # not CUDA: the loop
