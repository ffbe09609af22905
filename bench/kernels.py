"""Kernel benchmark: paged attention (Triton vs gather + SDPA vs the torch reference, and
the strongest fair baselines of bench/attention_baselines.py: SDPA on contiguous K/V,
flex_attention over the pool with a block mask), INT8 quantize/dequantize and
store_kvcache, each checked against the reference first; on CUDA also Triton decode
attention and store_kvcache on the mixed pool (bf16 K, INT8 V with fp16 row scales,
`attention/mixed-decode`, `store_kvcache/mixed`) beside the 16-bit pool.

    python bench/kernels.py [--quick] [--out bench/results]

On CUDA: bf16, 32 query heads / 8 KV heads, head_dim 128, block 16; decode (q_len 1)
and prefill over a cached prefix. Without CUDA, Triton cannot run (short of the slow
interpreter), so it times the reference, gather + SDPA and the baselines only, in fp32,
and says so. Every row's GB/s is also a fraction of the memory ceiling (bench/bandwidth.py:
the GPU's HBM spec peak, or on a CPU a copy measured in the same run). Prints a table,
writes <out>/kernels.json and <out>/kernels.png, and exits 1 if any implementation fails
or disagrees with the reference (after writing the results).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
# Run as a script, sys.path[0] is bench/, whose files would shadow the packages they are named after.
if not __package__:
    sys.path[0] = str(ROOT)

import torch  # noqa: E402

from bench import attention_baselines as baselines  # noqa: E402
from bench.bandwidth import Ceiling, ceiling  # noqa: E402
from kernels import gather_sdpa, reference  # noqa: E402
from kernels.contract import PagedBatch  # noqa: E402

HQ, HKV, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16  # a Llama-3-8B layer
ATTN_TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-4}  # max abs error vs the reference
HEADLINE = ("attention/decode", "B=64 q=1 ctx=4096")  # issue 15's figure: Triton at 68% of an H200's peak
TARGET_FRACTION_OF_PEAK = 0.8


@dataclass(frozen=True)
class Shape:
    kind: str  # "decode" or "prefill" (new tokens over a cached prefix)
    batch: int
    q_len: int  # new tokens per sequence
    context: int  # tokens per sequence in the cache, the new ones included


@dataclass
class Row:
    op: str
    shape: str
    impl: str
    ms: float | None = None
    gbps: float | None = None  # bytes the op must move / time
    max_err: float | None = None
    error: str | None = None
    fraction_of_peak: float | None = None  # gbps / the run's memory ceiling (bench/bandwidth.py)
    note: str | None = None  # what a baseline ran, which of its variants won, what it skipped


def shapes(cuda: bool, quick: bool) -> list[Shape]:
    if not cuda:
        decode = [Shape("decode", b, 1, c) for b in (1, 8) for c in (128, 512, 1024)]
        return decode + [Shape("prefill", 1, 128, 512), Shape("prefill", 2, 64, 1024)]
    batches, contexts = ((1, 16, 64), (512, 4096)) if quick else ((1, 8, 32, 64), (128, 512, 1024, 4096))
    prefill = [(1, 512, 2048), (4, 128, 1024), (4, 512, 4096)]
    if not quick:
        prefill += [(1, 128, 4096), (1, 2048, 4096), (8, 256, 2048), (16, 128, 1024)]
    return [Shape("decode", b, 1, c) for b in batches for c in contexts] + [
        Shape("prefill", b, q, c) for b, q, c in prefill
    ]


def make_inputs(s: Shape, dtype: torch.dtype, device: str) -> tuple:
    """A pool holding B contexts in shuffled blocks, and the new tokens' queries."""
    g = torch.Generator(device="cpu").manual_seed(0)
    per_seq = -(-s.context // BLOCK_SIZE)
    nb = s.batch * per_seq
    tables = torch.randperm(nb, generator=g).view(s.batch, per_seq).int()
    k_cache = torch.randn(nb, BLOCK_SIZE, HKV, HEAD_DIM, generator=g).to(device, dtype)
    v_cache = torch.randn(nb, BLOCK_SIZE, HKV, HEAD_DIM, generator=g).to(device, dtype)
    q = torch.randn(s.batch * s.q_len, HQ, HEAD_DIM, generator=g).to(device, dtype)
    cu = torch.arange(0, s.batch + 1, dtype=torch.int32) * s.q_len
    ctx = torch.full((s.batch,), s.context, dtype=torch.int32)
    return q, k_cache, v_cache, PagedBatch(cu.to(device), ctx.to(device), tables.to(device)), HEAD_DIM**-0.5


def timer(cuda: bool, quick: bool) -> Callable[[Callable[[], object]], float]:
    """Median milliseconds of fn."""
    if cuda:
        import triton.testing

        warmup, rep = (10, 40) if quick else (25, 100)
        return lambda fn: triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")

    def cpu_time(fn: Callable[[], object]) -> float:
        fn()
        runs = []
        for _ in range(3 if quick else 7):
            t0 = time.perf_counter()
            fn()
            runs.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(runs)

    return cpu_time


def run(row: Row, fn: Callable[[], object], check: Callable[[object], float], tol: float,
        time_ms: Callable, nbytes: int, *, measure: str = "max abs error") -> Row:
    """Check fn once against the reference, then time it; failures land in the row."""
    try:
        row.max_err = check(fn())
        if not row.max_err <= tol:  # also catches NaN
            row.error = f"{measure} {row.max_err:.3g} > {tol:g}"
        row.ms = time_ms(fn)
        row.gbps = nbytes / row.ms / 1e6
    except Exception as e:  # a compile or launch failure is a result, not a crash
        row.error = f"{type(e).__name__}: {e}"[:300]
    print_row(row)  # as it comes: a run cut short still shows what it measured
    return row


def run_baseline(row: Row, prepare: Callable[[], baselines.Prepared], check: Callable[[object], float],
                 tol: float, time_ms: Callable, nbytes: int) -> Row:
    """A baseline's set-up (outside the timing), then the fastest of its variants that agrees
    with the reference, through `run`; the others' times and skips go in the row's note."""
    try:
        prep = prepare()
        timed, notes = {}, []
        for name, c in prep.candidates.items():
            with c.scope():
                err = check(c.call())  # the first call also compiles
                if not err <= tol:
                    notes.append(f"{name} disagrees ({err:.3g})")
                else:
                    timed[name] = time_ms(c.call) if len(prep.candidates) > 1 else 0.0
        reasons: dict[str, list[str]] = {}  # one line for the backends skipped for one reason
        for name, why in prep.skipped.items():
            reasons.setdefault(why, []).append(name)
        notes += [f"{', '.join(names)} skipped: {why}" for why, names in reasons.items()]
        if not timed:
            row.error = "no variant runs and agrees: " + "; ".join(notes)
    except Exception as e:  # a set-up failure is a result, not a crash
        row.error = f"{type(e).__name__}: {e}"[:300]
    if row.error:
        print_row(row)
        return row
    best = min(timed, key=timed.get)
    others = [f"{n} {ms:.3f} ms" for n, ms in timed.items() if n != best]
    row.note = "; ".join([prep.note, f"ran: {best}", *others, *notes])
    with prep.candidates[best].scope():
        return run(row, prep.candidates[best].call, check, tol, time_ms, nbytes)


def bench_attention(cuda: bool, quick: bool, time_ms: Callable, *, shape_list: list[Shape] | None = None,
                    flex_compiled: bool = True) -> list[Row]:
    """Every implementation and baseline on `shape_list` (default: `shapes(cuda, quick)`).
    `flex_compiled=False` runs flex_attention eagerly (tests: no compile wait)."""
    impls = {"reference": reference.paged_attention, "gather+sdpa": gather_sdpa.paged_attention}
    if cuda:
        from kernels import paged_attention as triton_attention

        impls["triton"] = triton_attention.paged_attention
    no_flex = baselines.flex_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = []
    for s in shape_list or shapes(cuda, quick):
        args = make_inputs(s, dtype, "cuda" if cuda else "cpu")
        want = reference.paged_attention(*args).float()
        # The bytes attention cannot avoid: every context K and V once, q in, out.
        nbytes = (2 * s.batch * s.context * HKV + 2 * s.batch * s.q_len * HQ) * HEAD_DIM * dtype.itemsize
        label = f"B={s.batch} q={s.q_len} ctx={s.context}"
        check = lambda out: (out.float() - want).abs().max().item()  # noqa: E731
        for name, fn in impls.items():
            row = Row(f"attention/{s.kind}", label, name)
            rows.append(run(row, lambda fn=fn: fn(*args), check, ATTN_TOL[dtype], time_ms, nbytes))
        rows.append(run_baseline(Row(f"attention/{s.kind}", label, "sdpa-contig"),
                                 lambda: baselines.sdpa_contiguous(*args), check, ATTN_TOL[dtype], time_ms, nbytes))
        flex_row = Row(f"attention/{s.kind}", label, "flex-paged")
        if no_flex:
            flex_row.error = no_flex
            print_row(flex_row)
            rows.append(flex_row)
        else:
            rows.append(run_baseline(flex_row, lambda: baselines.flex_paged(*args, compiled=flex_compiled),
                                     check, ATTN_TOL[dtype], time_ms, nbytes))
        del args, want
    return rows


def bench_quant_and_store(cuda: bool, quick: bool, time_ms: Callable) -> list[Row]:
    from kernels import quant_int8, store_kvcache

    rows = []
    for tokens in (16384,) if quick else (4096, 65536):
        x = torch.randn(tokens, HKV, HEAD_DIM, device="cuda").bfloat16()
        q_ref, s_ref = reference.quantize_int8(x)
        label = f"{tokens} tokens x {HKV} heads"
        nbytes = x.numel() * (2 + 1) + s_ref.numel() * 4  # bf16 in, int8 + fp32 scale out
        for name, quant, dequant in (
            ("reference", reference.quantize_int8, reference.dequantize_int8),
            ("triton", quant_int8.quantize_int8, quant_int8.dequantize_int8),
        ):
            # Quantize must match bit for bit; the count of differing int8 values shows.
            def q_check(out: tuple) -> float:
                return float((out[0] != q_ref).sum() + (out[1] != s_ref).sum())

            rows.append(run(Row("quantize_int8", label, name), lambda f=quant: f(x), q_check, 0,
                            time_ms, nbytes, measure="values differing"))
            d_ref = reference.dequantize_int8(q_ref, s_ref, torch.bfloat16)
            rows.append(run(Row("dequantize_int8", label, name),
                            lambda f=dequant: f(q_ref, s_ref, torch.bfloat16),
                            lambda out: float((out != d_ref).sum()), 0, time_ms, nbytes,
                            measure="values differing"))

    for tokens in (64, 4096):  # a decode step of 64 sequences; a prefill chunk
        kv = torch.randn(2, tokens, HKV, HEAD_DIM, device="cuda").bfloat16()
        nb = 2 * tokens // BLOCK_SIZE + 1
        slots = torch.randperm(nb * BLOCK_SIZE, device="cuda")[:tokens]
        slots[::7] = -1  # padding rows
        want = [torch.zeros(nb, BLOCK_SIZE, HKV, HEAD_DIM, device="cuda").bfloat16() for _ in range(2)]
        reference.store_kvcache(kv[0], kv[1], *want, slots)
        nbytes = 2 * 2 * kv[0].numel() * 2  # read and write K and V, bf16
        for name, store in (("reference", reference.store_kvcache), ("triton", store_kvcache.store_kvcache)):
            caches = [torch.zeros_like(want[0]) for _ in range(2)]
            check = lambda _, c=caches: float((c[0] != want[0]).sum() + (c[1] != want[1]).sum())  # noqa: E731
            rows.append(run(Row("store_kvcache", f"{tokens} tokens", name),
                            lambda f=store, c=caches: f(kv[0], kv[1], *c, slots), check, 0, time_ms, nbytes,
                            measure="values differing"))
    return rows


def bench_mixed(quick: bool, time_ms: Callable, device: str = "cuda", contexts: tuple[int, ...] | None = None,
                dtype: torch.dtype = torch.bfloat16) -> list[Row]:
    """Triton on the mixed pool (`dtype` K, int8 V + fp16 scales) against the reference on
    the same pool, next to the "attention/decode" rows of the 16-bit pool. (`device`,
    `contexts` and `dtype` let it run small under the interpreter, fp16: the interpreter
    cannot run bf16 dots.)"""
    from kernels import paged_attention as triton_attention
    from kernels import store_kvcache
    from kernels.contract import V_SCALE_DTYPE

    rows = []
    batches = (1, 64) if quick else (1, 8, 32, 64)
    for b in batches:
        for c in contexts or ((512, 4096) if quick else (128, 512, 1024, 4096)):
            q, k_cache, v16, batch, scale = make_inputs(Shape("decode", b, 1, c), dtype, device)
            v8, vs = reference.quantize_v_row(v16)  # (NB, BS, Hkv, D) int8, (NB, BS, Hkv) fp16
            want = reference.paged_attention(q, k_cache, v8, batch, scale, v_scales=vs).float()
            # K at 2 bytes a value, V at 1 plus 2 bytes a row; q in, out.
            nbytes = b * c * HKV * (3 * HEAD_DIM + 2) + 2 * b * HQ * HEAD_DIM * 2
            check = lambda out, w=want: (out.float() - w).abs().max().item()  # noqa: E731
            rows.append(run(Row("attention/mixed-decode", f"B={b} q=1 ctx={c}", "triton"),
                            lambda a=(q, k_cache, v8, batch, scale), s=vs: triton_attention.paged_attention(
                                *a, v_scales=s), check, 2e-2, time_ms, nbytes))
            del q, k_cache, v16, v8, vs, want
    for tokens in (64, 4096):
        kv = torch.randn(2, tokens, HKV, HEAD_DIM, device=device).to(dtype)
        nb = 2 * tokens // BLOCK_SIZE + 1
        slots = torch.randperm(nb * BLOCK_SIZE, device=device)[:tokens]
        slots[::7] = -1  # padding rows
        shape = (nb, BLOCK_SIZE, HKV, HEAD_DIM)
        want = (torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=torch.int8),
                torch.zeros(shape[:3], device=device, dtype=V_SCALE_DTYPE))
        reference.store_kvcache(kv[0], kv[1], want[0], want[1], slots, v_scales=want[2])
        got = tuple(torch.zeros_like(w) for w in want)
        check = lambda _, g=got, w=want: float(sum((x != y).sum() for x, y in zip(g, w)))  # noqa: E731
        nbytes = 2 * kv[0].numel() * 2 + kv[0].numel() * (2 + 1) + tokens * HKV * 2  # read K, V; write K, V, scales
        rows.append(run(Row("store_kvcache/mixed", f"{tokens} tokens", "triton"),
                        lambda g=got: store_kvcache.store_kvcache(kv[0], kv[1], g[0], g[1], slots, v_scales=g[2]),
                        check, 0, time_ms, nbytes, measure="values differing"))
    return rows


def add_fractions(rows: list[Row], ceil: Ceiling) -> dict:
    """Fill each row's fraction_of_peak; the summary keys for kernels.json."""
    for r in rows:
        if r.gbps is not None:
            r.fraction_of_peak = r.gbps / ceil.peak_gbps
    headline = {r.impl: r.fraction_of_peak for r in rows if (r.op, r.shape) == HEADLINE and not r.error}
    return {"peak_gbps": ceil.peak_gbps, "peak_source": ceil.source, "copy_gbps": ceil.copy_gbps,
            "target_fraction_of_peak": TARGET_FRACTION_OF_PEAK,
            "triton_decode_b64_ctx4k_fraction_of_peak": headline.get("triton"),
            "decode_b64_ctx4k_fraction_of_peak": headline}


HEADER = f"{'op':<22} {'shape':<24} {'impl':<12} {'ms':>9} {'GB/s':>8} {'max err':>9}  status"


def print_row(r: Row) -> None:
    ms = f"{r.ms:9.3f}" if r.ms is not None else f"{'-':>9}"
    gbps = f"{r.gbps:8.1f}" if r.gbps is not None else f"{'-':>8}"
    err = f"{r.max_err:9.2g}" if r.max_err is not None else f"{'-':>9}"
    print(f"{r.op:<22} {r.shape:<24} {r.impl:<12} {ms} {gbps} {err}  {r.error or 'ok'}", flush=True)
    if r.note:
        print(f"{'':<22} {r.note}", flush=True)


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    for ax, kind in zip(axes, ("attention/decode", "attention/prefill")):
        picked = [r for r in rows if r.op == kind and r.ms is not None]
        labels = list(dict.fromkeys(r.shape for r in picked))
        impls = list(dict.fromkeys(r.impl for r in picked))
        width = 0.8 / max(1, len(impls))
        for i, impl in enumerate(impls):
            ms = {r.shape: r.ms for r in picked if r.impl == impl}
            xs = [j + i * width for j, lab in enumerate(labels) if lab in ms]
            ax.bar(xs, [ms[lab] for lab in labels if lab in ms], width, label=impl)
        ax.set_xticks([j + width * (len(impls) - 1) / 2 for j in range(len(labels))])
        ax.set_xticklabels(labels, rotation=45, ha="right", fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("ms (log)")
        ax.set_title(kind)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and shorter timing (~2 min)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if cuda else f"CPU ({platform.processor() or platform.machine()})"
    print(f"device: {device}; torch {torch.__version__}")
    if not cuda:
        print("no CUDA: timing the reference, gather+SDPA and the baselines only (fp32); Triton needs a GPU")
    time_ms = timer(cuda, args.quick)
    t0 = time.perf_counter()
    ceil = ceiling(device, cuda, time_ms)
    print(f"memory ceiling: {ceil.peak_gbps:.1f} GB/s, {ceil.source} (a copy: {ceil.copy_gbps:.1f} GB/s)")
    print(HEADER)
    rows = bench_attention(cuda, args.quick, time_ms)
    if cuda:
        rows += bench_quant_and_store(cuda, args.quick, time_ms)
        rows += bench_mixed(args.quick, time_ms)
    summary = add_fractions(rows, ceil)
    if summary["decode_b64_ctx4k_fraction_of_peak"]:
        print(f"{HEADLINE[0]} {HEADLINE[1]}, fraction of {ceil.peak_gbps:.0f} GB/s (target "
              f"{TARGET_FRACTION_OF_PEAK:.0%} for triton): " + ", ".join(
                  f"{impl} {f:.0%}" for impl, f in summary["decode_b64_ctx4k_fraction_of_peak"].items()))

    args.out.mkdir(parents=True, exist_ok=True)
    failed = [r for r in rows if r.error]
    meta = {"device": device, "torch": torch.__version__, "quick": args.quick,
            "seconds": round(time.perf_counter() - t0, 1), "failed": len(failed), **summary}
    if cuda:
        import triton

        meta["triton"] = triton.__version__
    (args.out / "kernels.json").write_text(json.dumps({**meta, "rows": [asdict(r) for r in rows]}, indent=1))
    try:
        plot(rows, args.out / "kernels.png")
    except ImportError as e:
        print(f"no plot ({e}); the numbers are in kernels.json")
    print(f"wrote {args.out / 'kernels.json'} and kernels.png in {meta['seconds']} s")
    if failed:
        print(f"FAILED: {len(failed)} result(s) failed or disagree with the reference", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
