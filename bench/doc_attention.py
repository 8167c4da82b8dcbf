"""Attention inside documents: the candidate kernels side by side, forward+backward.

    python bench/doc_attention.py            # a GPU: the 1B head shape at 32k, bf16
    python bench/doc_attention.py --quick    # CPU, small: the kernels that run there

One attention layer of the 1B recipes (32 query / 8 kv heads of 64, micro-batch 1) over
document mixes: one document filling the row (document masking's worst case: nothing to
skip), long documents, and many short ones. Kernels:
- `sdpa_causal`: today's path without document masking (SDPA, flash on GPU), the baseline;
- `varlen`: what `model/documents.attend` runs on CUDA (torch's flash-attention
  variable-length kernel over the document boundaries);
- `flex`: torch's FlexAttention, compiled, with a document BlockMask (its build time is
  printed apart: once per micro-batch, shared by every layer);
- `dense_mask`: SDPA with the [b, 1, s, s] boolean mask (the CPU path).
Before timing, each kernel's output and input gradients are compared with the dense
mask's on a short sequence, so the GPU path's correctness is checked on the GPU itself.
Prints ms per layer, the ratio to `sdpa_causal`, and peak memory. The kernel choice is
`documents.attend`; docs/design.md ("Document masking") says what to do with the result.
"""

from __future__ import annotations

import argparse
import inspect
import time
import warnings

import numpy as np
import torch
import torch.nn.functional as F

from megatron_stem.model import documents


def document_lengths(kind: str, seq: int, rng: np.random.Generator) -> list[int]:
    if kind == "one":
        return [seq]
    median = {"long": seq // 4, "short": 512}[kind] if seq >= 4096 else seq // 8
    lengths = []
    while sum(lengths) < seq:
        lengths.append(max(1, int(rng.lognormal(np.log(median), 0.8))))
    lengths[-1] -= sum(lengths) - seq
    return [n for n in lengths if n > 0]


def boundaries(lengths: list[int], device):
    eod = 1
    tokens = np.zeros((1, sum(lengths)), dtype=np.int64)
    tokens[0, np.cumsum(lengths)[:-1] - 1] = eod
    return documents.document_boundaries(tokens, eod, device)


def _varlen_kernel():
    """`documents.attend`'s CUDA path, or the same call in an older torch's varlen API
    (the lent GPU machine may lag the pinned torch)."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    if "enable_gqa" in params:
        return documents._varlen, "documents._varlen"

    def older(q, k, v, docs, scale, gqa):
        s, b = q.shape[:2]
        groups = q.shape[2] // k.shape[2]
        q, k, v = (t.transpose(0, 1).reshape(b * s, *t.shape[2:]) for t in (q, k, v))
        k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
        cu, n = docs.cu_seqlens_q, docs.max_seqlen_q
        causal = dict(window_size=(-1, 0)) if "window_size" in params else dict(is_causal=True)
        extra = dict(scale=scale) if "scale" in params else {}
        out = varlen_attn(q, k, v, cu, cu, n, n, **causal, **extra)
        return out.view(b, s, *out.shape[1:]).transpose(0, 1)

    return older, f"varlen_attn{tuple(params)} (torch {torch.__version__}, kv heads repeated)"


def _flex_kernel():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    last = {"docs": None, "mask": None}  # the layers of one micro-batch share its mask

    def block_mask(docs, b, s, device):
        if last["docs"] is not docs:
            ids = documents.document_ids(docs, b, s)

            def same_document_causal(batch, head, q_idx, kv_idx):
                return (q_idx >= kv_idx) & (ids[batch, q_idx] == ids[batch, kv_idx])

            last["mask"] = create_block_mask(same_document_causal, b, None, s, s,
                                             device=device, _compile=True)
            last["docs"] = docs
        return last["mask"]

    def flex(q, k, v, docs, scale, gqa):
        s, b = q.shape[:2]
        mask = block_mask(docs, b, s, q.device)
        out = compiled(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), block_mask=mask,
                       scale=scale, enable_gqa=gqa)
        return out.permute(2, 0, 1, 3)

    return flex, block_mask


def sdpa_causal(q, k, v, docs, scale, gqa):
    out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)),
                                         is_causal=True, scale=scale, enable_gqa=gqa)
    return out.permute(2, 0, 1, 3)


def inputs(seq, heads, kv_heads, dim, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(seq, 1, n, dim, generator=g).to(device, dtype).requires_grad_()
            for n in (heads, kv_heads, kv_heads)]


def run(kernel, qkv, docs, scale):
    for t in qkv:
        t.grad = None
    out = kernel(*qkv, docs, scale, True)
    out.backward(torch.ones_like(out))
    return out


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_kernel(kernel, qkv, docs, scale, iters, device):
    run(kernel, qkv, docs, scale)  # warm-up (and compile)
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(iters):
        run(kernel, qkv, docs, scale)
    sync(device)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return (time.perf_counter() - start) / iters * 1e3, peak


def check(kernels, args, device, dtype):
    """Each kernel against the dense mask in fp32 on a short mixed sequence: output and
    input gradients (dense_mask's own line, in `dtype`, is the rounding to expect)."""
    seq = min(args.seq, 2048)
    docs = boundaries(document_lengths("short", seq, np.random.default_rng(1)), device)
    scale = args.dim ** -0.5
    reference = inputs(seq, args.heads, args.kv_heads, args.dim, torch.float32, device)
    expected = run(documents._dense_mask, reference, docs, scale)
    for name, kernel in kernels.items():
        if name == "sdpa_causal":
            continue
        qkv = inputs(seq, args.heads, args.kv_heads, args.dim, dtype, device)
        got = run(kernel, qkv, docs, scale)
        worst = max((a.float() - b).abs().max().item() for a, b in
                    zip([got] + [t.grad for t in qkv], [expected] + [t.grad for t in reference]))
        print(f"check {name:<12} max |diff| vs fp32 dense_mask (output, dq, dk, dv): "
              f"{worst:.2e}")


def cpu_flex_forward(args, docs, scale) -> None:
    """FlexAttention on CPU: eager (no compile), forward only (it has no CPU backward)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v = (t.detach() for t in inputs(args.seq, args.heads, args.kv_heads, args.dim,
                                          torch.float32, "cpu"))
    ids = documents.document_ids(docs, 1, args.seq)
    mask = create_block_mask(lambda b, h, qi, ki: (qi >= ki) & (ids[b, qi] == ids[b, ki]),
                             1, None, args.seq, args.seq, device="cpu")

    def forward(kernel):
        start = time.perf_counter()
        for _ in range(args.iters):
            kernel()
        return (time.perf_counter() - start) / args.iters * 1e3

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "use torch.compile": the point here is eager
        flex = forward(lambda: flex_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)),
                                              block_mask=mask, scale=scale, enable_gqa=True))
        dense = forward(lambda: documents._dense_mask(q, k, v, docs, scale, True))
        causal = forward(lambda: sdpa_causal(q, k, v, docs, scale, True))
    print(f"\nCPU forward only: sdpa_causal {causal:.2f} ms, dense_mask {dense:.2f} ms "
          f"({dense / causal:.2f}x), flex eager {flex:.2f} ms ({flex / causal:.2f}x)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="CPU sizes, a few seconds")
    ap.add_argument("--no-dense", action="store_true", help="skip dense_mask at full length")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.quick or device.type == "cpu":
        args.seq, args.heads, args.kv_heads, args.dim, args.iters = 512, 4, 2, 32, 3
        torch.set_num_threads(1)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    kernels = {"sdpa_causal": sdpa_causal, "dense_mask": documents._dense_mask}
    notes = []
    build_mask = None
    if device.type == "cuda":
        kernels["varlen"], how = _varlen_kernel()
        kernels["flex"], build_mask = _flex_kernel()
        notes.append(f"varlen: {how}")
    else:
        notes.append("varlen and flex need CUDA (flex has no CPU backward): not timed here")
    print(f"device {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'})"
          f", torch {torch.__version__}, {dtype}, seq {args.seq}, heads {args.heads}/"
          f"{args.kv_heads} x {args.dim}; " + "; ".join(notes))
    check(kernels, args, device, dtype)

    scale = args.dim ** -0.5
    rng = np.random.default_rng(0)
    print("\n| documents | kernel | ms fwd+bwd | vs sdpa_causal | peak GiB |\n|---|---|---|---|---|")
    for kind in ("one", "long", "short"):
        lengths = document_lengths(kind, args.seq, rng)
        docs = boundaries(lengths, device)
        label = f"{kind}: {len(lengths)} docs, longest {max(lengths)}"
        qkv = inputs(args.seq, args.heads, args.kv_heads, args.dim, dtype, device)
        base = None
        for name, kernel in kernels.items():
            if name == "dense_mask" and args.no_dense:
                continue
            ms, peak = time_kernel(kernel, qkv, docs, scale, args.iters, device)
            base = base or ms
            memory = "-" if peak is None else f"{peak:.2f}"
            print(f"| {label} | {name} | {ms:.2f} | {ms / base:.2f} | {memory} |")
        if build_mask is not None:
            b, s = 1, args.seq
            sync(device)
            start = time.perf_counter()
            for _ in range(args.iters):
                build_mask(boundaries(lengths, device), b, s, device)
            sync(device)
            ms = (time.perf_counter() - start) / args.iters * 1e3
            print(f"| {label} | flex BlockMask build (per micro-batch) | {ms:.2f} | | |")
    if device.type == "cpu":
        cpu_flex_forward(args, docs, scale)


if __name__ == "__main__":
    main()
