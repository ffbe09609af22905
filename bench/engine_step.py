"""Where a decode step's time goes: the engine's model runner against HF generate(), per step.

    python -m bench.engine_step [--batches 1 8 32] [--reps 25] [--no-hf] [--kernels ...] [--attention ...]
    (from the repository root; about a minute on one core)

For each batch size B: one decode step of B sequences (one new token each, contexts
drawn like the static benchmark's mid-run: a 16-256 token prompt plus 0-256 generated
tokens), run through `ModelRunner.run` as the engine runs it, timed in CPU seconds
(the process's own, so other load on a shared machine inflates it less than wall
time), min and median of `--reps`, interleaved with the same step whose attention and
K/V store are replaced by no-ops, and with the model's linear layers alone on (B, in)
inputs. So: step = linear + attention (the step minus its stubbed twin) + the rest
(norms, rotary, sampling, building the batch, Python). Attention's K/V bytes (every
layer reads each sequence's whole context once) over its time give the rate it reads
them at, beside the memory ceiling: a 256 MiB copy measured in the same run
(bench/bandwidth.py). Then HF generate() at B = 32 on
the static benchmark's first batch of 32 left-padded prompts: its per-step time after
the prefill, in CPU seconds, ((1 + n tokens) - (1 token)) / n.

Prints a table; nothing is written to bench/results.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import time
from pathlib import Path

if not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.bandwidth import copy_gbps  # noqa: E402
from kernels import ops  # noqa: E402
from kvfleet.contracts import Sampling  # noqa: E402
from workers.engine.model_runner import ModelRunner  # noqa: E402
from workers.engine.scheduler import ScheduledBatch  # noqa: E402
from workers.engine.sequence import Sequence  # noqa: E402
from workers.model import LoadedModel, load_model  # noqa: E402

BLOCK_SIZE = 16


def decode_batch(b: int, seed: int = 1) -> ScheduledBatch:
    """B sequences, each with its context in its own blocks and one token to compute."""
    rng = random.Random(seed)
    seqs, next_block = [], 0
    for i in range(b):
        ctx = rng.randint(16, 256) + rng.randint(0, 256)
        seq = Sequence(f"s{i}", [rng.randrange(256) for _ in range(ctx)], 8, Sampling(), priority_rank=1, stop=(),
                       ignore_eos=True, arrival_order=i)
        n_blocks = ctx // BLOCK_SIZE + 1
        seq.block_table = list(range(next_block, next_block + n_blocks))
        next_block += n_blocks
        seq.num_computed_tokens = ctx - 1
        seqs.append(seq)
    return ScheduledBatch(seqs, [1] * b, [[] for _ in range(b)])


def cpu_ms(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        start = time.process_time()
        fn()
        out.append(1000 * (time.process_time() - start))
    return out


def engine_rows(loaded: LoadedModel, kernels: ops.Kernels, batches: list[int], reps: int) -> list[dict]:
    stubbed = dataclasses.replace(kernels, paged_attention=lambda q, *a, **k: q, store_kvcache=lambda *a, **k: None)
    num_blocks = max(batches) * (512 // BLOCK_SIZE + 1)
    real, stub = (ModelRunner(loaded, num_blocks, BLOCK_SIZE, k) for k in (kernels, stubbed))
    linears = [m.weight for m in loaded.model.modules() if isinstance(m, torch.nn.Linear)]
    rows = []
    for b in batches:
        batch = decode_batch(b)
        inputs = {w.shape[1]: torch.randn(b, w.shape[1]) for w in linears}
        fns = {"step": lambda: real.run(batch), "stubbed": lambda: stub.run(batch),
               "linear": lambda: [F.linear(inputs[w.shape[1]], w) for w in linears]}
        for fn in fns.values():
            fn()  # warm-up
        times: dict[str, list[float]] = {k: [] for k in fns}
        with torch.inference_mode():
            for _ in range(reps):  # interleaved, so that the machine's other load falls on all three
                for name, fn in fns.items():
                    times[name] += cpu_ms(fn, 1)
        best = {k: min(v) for k, v in times.items()}
        attention_ms = best["step"] - best["stubbed"]
        rows.append({"batch": b, "step_min_ms": best["step"], "step_median_ms": statistics.median(times["step"]),
                     "linear_ms": best["linear"], "attention_store_ms": attention_ms,
                     "rest_ms": best["stubbed"] - best["linear"],
                     "kv_read_gbps": kv_bytes(loaded, batch) / attention_ms / 1e6 if attention_ms > 0 else None})
    return rows


def kv_bytes(loaded: LoadedModel, batch: ScheduledBatch) -> int:
    """The K and V bytes a decode step's attention reads: every layer, each sequence's context."""
    c = loaded.model.config
    per_token = 2 * c.num_key_value_heads * c.head_dim * torch.finfo(loaded.dtype).bits // 8  # K and V, one layer
    return sum(seq.num_computed_tokens + 1 for seq in batch.seqs) * per_token * c.num_hidden_layers


def ceiling_gbps(reps: int = 5) -> float:
    """The CPU's memory ceiling, a large copy (read + write), best of `reps`."""
    def time_ms(fn) -> float:
        fn()
        return min(cpu_ms(fn, 1)[0] for _ in range(reps))
    return copy_gbps("cpu", time_ms)


def hf_step_ms(loaded: LoadedModel, reps: int) -> dict:
    from bench.engine import to_transformers, workload  # transformers is imported only here

    model = to_transformers(loaded)
    chunk = workload(64, 64, (16, 256), (64, 256))[:32]  # the static benchmark's first batch
    pad = model.config.pad_token_id
    width = max(len(p) for p, _ in chunk)
    ids = torch.full((len(chunk), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (prompt, _) in enumerate(chunk):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1

    def generate(n: int) -> None:
        model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=pad)

    with torch.no_grad():
        generate(2)  # warm-up
        n = max(8, reps)
        first, longer = min(cpu_ms(lambda: generate(1), 2)), min(cpu_ms(lambda: generate(1 + n), 2))
    return {"batch": len(chunk), "prompt_width": width, "prefill_ms": first, "step_ms": (longer - first) / n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--reps", type=int, default=25)
    parser.add_argument("--no-hf", action="store_true", help="skip generate()")
    parser.add_argument("--kernels", choices=ops.BACKENDS, default="auto")
    parser.add_argument("--attention", choices=ops.ATTENTIONS, default="paged")
    args = parser.parse_args()
    torch.set_num_threads(1)
    loaded = load_model("builtin:bench", device="cpu")
    kernels = ops.select(args.kernels, args.attention)
    print(f"decode step, builtin:bench float32, 1 thread, {kernels.backend}/{kernels.attention}; CPU ms, "
          f"min of {args.reps} (step also median)")
    print(f"{'B':>4}{'step min':>10}{'median':>9}{'linear':>9}{'attn+store':>12}{'rest':>8}{'K/V GB/s':>10}")
    for r in engine_rows(loaded, kernels, args.batches, args.reps):
        gbps = f"{r['kv_read_gbps']:.1f}" if r["kv_read_gbps"] is not None else "-"
        print(f"{r['batch']:>4}{r['step_min_ms']:>10.2f}{r['step_median_ms']:>9.2f}{r['linear_ms']:>9.2f}"
              f"{r['attention_store_ms']:>12.2f}{r['rest_ms']:>8.2f}{gbps:>10}")
    print(f"memory ceiling: a 256 MiB copy reads + writes {ceiling_gbps():.1f} GB/s on this CPU")
    if not args.no_hf:
        hf = hf_step_ms(loaded, args.reps)
        print(f"HF generate(), B={hf['batch']}, prompts padded to {hf['prompt_width']}: prefill + 1 token "
              f"{hf['prefill_ms']:.0f} ms, then {hf['step_ms']:.2f} ms a step")


if __name__ == "__main__":
    main()
