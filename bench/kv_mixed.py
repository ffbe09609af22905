"""The FP16-K / INT8-V hot tier (EngineConfig.kv_cache_dtype "int8-v") against the
all-16-bit pool: capacity, perplexity and throughput, on builtin:english in float16
(the checkpoint's own dtype, so "model" is the all-16-bit pool).

- Capacity: blocks, tokens and sequences per worker in the same KV memory
  (EngineConfig.kv_memory_bytes, the worker's default unless told), as the engines
  report them (`stats().capacity_tokens`). Sequences: how many of a given length
  (prompt + output) the pool holds at once, before max_num_seqs caps them.
- Perplexity: every held-out fortune (kvfleet/models/english/heldout.txt, what
  scripts/train_english.py held out and shipped) with its end-of-text token, through
  the model runner's own pool: K/V stored, then attention reads them back, so every
  logit past a sequence's first token saw the stored (for int8-v: quantized) V.
  Fortunes run in batches of flat prefills, as the engine runs them.
- Throughput: generated tokens/s of the engine, both pools, alternately, best of a
  few (other processes only ever slow a run).

Run it through bench/engine.py: `python -m bench.engine --kv-mixed-only`.
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch

from kernels.contract import PagedBatch
from kernels.ops import Kernels
from kvfleet.modelinfo import PACKAGED_DIR
from workers.engine import Engine, EngineConfig
from workers.engine.model_runner import ModelRunner, kv_bytes_per_block
from workers.model import LoadedModel
from workers.model.attention import AttentionMetadata

MODES = ("model", "int8-v")
MODEL = "builtin:english"
DTYPE = "float16"
SEQ_LENS = (256, 1024)  # sequences per worker at these lengths; 1024 is the model's context
PPL_BATCH_TOKENS = 4096  # tokens per flat prefill of the perplexity pass


def held_out(loaded: LoadedModel) -> list[list[int]]:
    """Each held-out fortune's tokens with the end-of-text token, at most the model's context."""
    text = (PACKAGED_DIR / "english" / "heldout.txt").read_text(encoding="utf-8")
    eos = loaded.tokenizer.eos_token_id
    fortunes = [t.strip() for t in text.split("\n%\n") if t.strip()]
    return [(loaded.tokenizer.encode(t) + [eos])[:loaded.max_context] for t in fortunes]


def capacity(loaded: LoadedModel, base: EngineConfig) -> dict:
    """Blocks, tokens and sequences per worker for each pool in `base.kv_memory_bytes`."""
    out: dict = {"kv_memory_bytes": base.kv_memory_bytes, "block_size": base.block_size}
    for mode in MODES:
        config = dataclasses.replace(base, num_blocks=None, kv_cache_dtype=mode)
        with Engine(loaded, config) as engine:
            tokens = engine.stats().capacity_tokens
            blocks = engine.block_manager.num_blocks
        out[mode] = {
            "bytes_per_block": kv_bytes_per_block(loaded, base.block_size, mode), "blocks": blocks,
            "tokens": tokens,
            **{f"sequences_of_{n}": blocks // math.ceil(n / base.block_size) for n in SEQ_LENS},
        }
    return out


def perplexity(loaded: LoadedModel, kernels: Kernels, mode: str, seqs: list[list[int]], block_size: int) -> float:
    """exp(mean NLL) of every next token of `seqs`, read through a `mode` pool."""
    per_batch: list[list[list[int]]] = [[]]
    for s in seqs:
        if per_batch[-1] and sum(map(len, per_batch[-1])) + len(s) > PPL_BATCH_TOKENS:
            per_batch.append([])
        per_batch[-1].append(s)
    most_blocks = max(sum(math.ceil(len(s) / block_size) for s in batch) for batch in per_batch)
    runner = ModelRunner(loaded, most_blocks, block_size, kernels, kv_cache_dtype=mode)
    dev = loaded.device
    nll, count = 0.0, 0
    for batch in per_batch:
        ids, positions, slots, starts, tables, targets, rows = [], [], [], [0], [], [], []
        next_block = 0
        for s in batch:
            n_blocks = math.ceil(len(s) / block_size)
            table = list(range(next_block, next_block + n_blocks))  # fresh blocks: nothing cached
            next_block += n_blocks
            ids += s
            positions += range(len(s))
            slots += [table[p // block_size] * block_size + p % block_size for p in range(len(s))]
            rows += range(starts[-1], starts[-1] + len(s) - 1)  # every row but the last predicts a token
            targets += s[1:]
            starts.append(starts[-1] + len(s))
            tables.append(table)
        width = max(map(len, tables))
        meta = AttentionMetadata(
            batch=PagedBatch(
                cu_seqlens_q=torch.tensor(starts, dtype=torch.int32, device=dev),  # (B+1,)
                context_lens=torch.tensor([len(s) for s in batch], dtype=torch.int32, device=dev),  # (B,)
                block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32,
                                          device=dev),  # (B, width)
            ),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),  # (T,)
            query_starts=tuple(starts), num_decode_seqs=0, kernels=kernels,
        )
        with torch.inference_mode():
            hidden = runner.model(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), meta,
                                  runner.kv_cache, runner.v_scales)  # (T, H)
            logits = runner.model.compute_logits(hidden[rows]).float()  # (R, V)
            nll += torch.nn.functional.cross_entropy(logits, torch.tensor(targets, device=dev),
                                                     reduction="sum").item()
        count += len(targets)
    return math.exp(nll / count)


def throughput(loaded: LoadedModel, base: EngineConfig, seqs: list[list[int]], *, concurrency: int,
               max_new: int, rounds: int) -> dict:
    """Generated tokens/s of the engine on each pool, alternately, best of `rounds`."""
    prompts = [s[:64] for s in seqs[:2 * concurrency]]
    best = {mode: 0.0 for mode in MODES}
    for _ in range(rounds):
        for mode in MODES:
            config = dataclasses.replace(base, num_blocks=512, max_num_seqs=concurrency, kv_cache_dtype=mode)
            with Engine(loaded, config) as engine:
                engine.generate("warm-up", prompts[0], 4)
                t0 = time.perf_counter()
                handles = [engine.submit(f"r{i}", p, max_new, ignore_eos=True) for i, p in enumerate(prompts)]
                tokens = sum(len(h.result(timeout=600).tokens) for h in handles)
                best[mode] = max(best[mode], tokens / (time.perf_counter() - t0))
    return {"concurrency": concurrency, "requests": len(prompts), "max_new_tokens": max_new, "rounds": rounds,
            "tokens_per_s": best}


def section(loaded: LoadedModel, kernels: Kernels, base: EngineConfig, quick: bool) -> dict:
    """The part's keys for engine.json."""
    seqs = held_out(loaded)
    cap = capacity(loaded, base)
    ppl = {mode: perplexity(loaded, kernels, mode, seqs, base.block_size) for mode in MODES}
    speed = throughput(loaded, base, seqs, concurrency=8 if quick else 16, max_new=32 if quick else 64,
                       rounds=1 if quick else 3)
    return {
        "kv_mixed_capacity_gain": cap["int8-v"]["tokens"] / cap["model"]["tokens"],
        "kv_mixed_ppl_increase": ppl["int8-v"] / ppl["model"] - 1,
        "kv_mixed_speed_ratio": speed["tokens_per_s"]["int8-v"] / speed["tokens_per_s"]["model"],
        "kv_mixed": {
            "model": MODEL, "dtype": str(loaded.dtype), "device": str(loaded.device),
            "heldout_fortunes": len(seqs), "heldout_tokens_scored": sum(len(s) - 1 for s in seqs),
            "perplexity": ppl, "capacity": cap, "throughput": speed,
        },
    }


def print_section(part: dict) -> None:
    m = part["kv_mixed"]
    cap, ppl, speed = m["capacity"], m["perplexity"], m["throughput"]["tokens_per_s"]
    print(f"KV pool on {m['model']} ({m['dtype']}, {m['device']}), {cap['kv_memory_bytes'] / 2**20:.0f} MiB; "
          f"perplexity over {m['heldout_tokens_scored']} held-out tokens ({m['heldout_fortunes']} fortunes)")
    cols = "".join(f"{'seqs of ' + str(n):>13}" for n in SEQ_LENS)
    print(f"{'pool':<10}{'B/block':>9}{'blocks':>9}{'tokens':>10}{cols}{'perplexity':>12}{'tokens/s':>10}")
    for mode in MODES:
        c = cap[mode]
        seqs = "".join(f"{c['sequences_of_' + str(n)]:>13}" for n in SEQ_LENS)
        print(f"{mode:<10}{c['bytes_per_block']:>9}{c['blocks']:>9}{c['tokens']:>10}{seqs}{ppl[mode]:>12.4f}"
              f"{speed[mode]:>10.0f}")
    print(f"capacity gain {part['kv_mixed_capacity_gain']:.3f}x (target >= 1.3); perplexity increase "
          f"{part['kv_mixed_ppl_increase'] * 100:+.3f}% (target <= 2%); speed int8-v / model "
          f"{part['kv_mixed_speed_ratio']:.2f}")
