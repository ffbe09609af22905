"""Engine throughput against the baseline a user would otherwise write, and prefix-cache TTFT.

    python -m bench.engine [--quick] [--spec-only | --static-only | --kv-mixed-only] [--threads N] [--device cpu|cuda]
                           [--kernels auto|triton|torch] [--attention paged|sdpa] [--results DIR]
    (from the repository root)

1. Throughput (generated tokens/s) of the engine on builtin:bench with 1, 8, 32 and 64
   requests in flight (max_num_seqs = concurrency, all submitted at once), against
   Hugging Face transformers' generate() called one request at a time on a
   LlamaForCausalLM holding the same weights. Same prompts and output lengths on both
   sides: the engine ignores EOS, generate() gets min_new_tokens = max_new_tokens.
   generate() is sequential, so its tokens/s is measured on the first requests of the list.
2. Shared prefix: requests made of a 1,024-token prefix and a short suffix, all in
   flight at once. Mean time to first token when the prefix is already in the pool
   (one warm-up request ran before) against requests whose prefixes are all distinct
   (same lengths, nothing to share).
3. Speculative decoding (workers/engine/spec.py) on builtin:english, whose text is real
   English: generated tokens/s with and without, at 1 and 8 requests in flight, and the
   drafts' acceptance rate. Repetitive: greedy continuations of prompts that repeat
   themselves (code with repeated lines, a text quoted to be quoted again), which this
   small model continues by repeating them and itself. Non-repetitive: ordinary prompts
   (the first line of held-out fortunes) sampled at temperature 1, whose text does not
   repeat, so drafts are mostly rejected: what speculation costs when it cannot help.
   Each pair runs alternately, best of a few (other processes only ever slow a run).
   `--spec-only` runs just this part and merges its keys into an existing engine.json.

4. Static batching, the strongest baseline a user has without a serving engine (issue
   15): the engine with 32 requests in flight against generate() on static batches of 32
   left-padded prompts, on the same 64 requests (prompts of 16-256 tokens, outputs of
   64-256, uniform), in interleaved rounds, medians: `speedup_vs_hf_static_batch_at_32`,
   in useful tokens/s (a static batch runs until its longest output ends; only each
   request's own tokens count). Then both sides' tokens/s against their time per output
   token as the concurrency (the batch) grows, 1, 8 and 32: the plot's third panel.
   `--static-only` runs just this part and merges its keys into an existing engine.json.

5. The FP16-K / INT8-V hot tier (issue 15, bench/kv_mixed.py): tokens and sequences
   per worker in the same KV memory (`kv_mixed_capacity_gain`), perplexity on the
   held-out English text (`kv_mixed_ppl_increase`) and throughput, against the
   all-16-bit pool, on builtin:english in float16 (about 15 s). `--kv-mixed-only` runs
   just this part and merges its keys into an existing engine.json.

Peak RSS is sampled every 10 ms during each run. Results: a table on stdout,
bench/results/engine.json and bench/results/engine.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

# Run as a script, sys.path[0] is bench/, whose files would shadow the packages they are named after.
if not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import matplotlib  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from msgspec.structs import replace  # noqa: E402

from bench import kv_mixed  # noqa: E402
from kernels import ops  # noqa: E402
from kvfleet.contracts import Sampling  # noqa: E402
from kvfleet.modelinfo import PACKAGED_DIR  # noqa: E402
from kvfleet.settings import Settings  # noqa: E402
from workers.engine import Engine, EngineConfig  # noqa: E402
from workers.model import LoadedModel, load_model  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

RESULTS = Path(__file__).resolve().parent / "results"
Request = tuple[list[int], int]  # prompt tokens, output length


class PeakRss:
    """Largest resident set size of this process while the block runs, MiB."""

    def __enter__(self) -> "PeakRss":
        self.peak = psutil.Process().memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        proc = psutil.Process()
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, proc.memory_info().rss)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.mib = self.peak / 2**20


def cpu_seconds() -> float:
    """User + system CPU time of this process so far: what a run cost, whatever else the
    machine ran meanwhile (the sessions sharing it make wall time noisy)."""
    t = psutil.Process().cpu_times()
    return t.user + t.system


def workload(n: int, seed: int, prompt_lens: tuple[int, int], output_lens: tuple[int, int]) -> list[Request]:
    rng = random.Random(seed)
    return [([rng.randrange(256) for _ in range(rng.randint(*prompt_lens))], rng.randint(*output_lens))
            for _ in range(n)]


def run_engine(loaded: LoadedModel, requests: list[Request], concurrency: int, base: EngineConfig) -> dict:
    config = dataclasses.replace(base, kv_memory_bytes=512 * 2**20, max_num_seqs=concurrency)
    with Engine(loaded, config) as engine:
        engine.generate("warm-up", requests[0][0][:8], 2)
        with PeakRss() as rss:
            start, cpu = time.perf_counter(), cpu_seconds()
            handles = [engine.submit(f"r{i}", p, n, ignore_eos=True) for i, (p, n) in enumerate(requests)]
            done = [h.result() for h in handles]
            wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu
        stats = engine.stats()
    tokens = sum(len(c.tokens) for c in done)
    # Time per output token after the first, each request's own: what its reader waits between tokens.
    tpot = [(c.finished_at - c.first_token_at) / (len(c.tokens) - 1) for c in done if len(c.tokens) > 1]
    return {"concurrency": concurrency, "requests": len(requests), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "cpu_s": cpu, "tokens_per_cpu_s": tokens / cpu, "peak_rss_mib": rss.mib, "max_batch_size": stats.max_batch_size,
            "preemptions": stats.preemptions, **_tpot_ms(tpot)}


def _tpot_ms(tpot: list[float]) -> dict:
    ordered = sorted(tpot)
    return {"tpot_p50_ms": 1000 * statistics.median(ordered),
            "tpot_p99_ms": 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]}


def to_transformers(loaded: LoadedModel) -> transformers.LlamaForCausalLM:
    c = loaded.config
    hf_config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings, bos_token_id=c.bos_token_id,
        eos_token_id=list(c.eos_token_id), pad_token_id=c.eos_token_id[0],
    )
    model = transformers.LlamaForCausalLM(hf_config).eval()
    model.load_state_dict(loaded.model.state_dict(), strict=True)  # same parameter names
    return model.to(loaded.device, loaded.dtype)


def run_hf(model: transformers.LlamaForCausalLM, requests: list[Request]) -> dict:
    with PeakRss() as rss, torch.no_grad():
        model.generate(torch.tensor([requests[0][0][:8]], device=model.device), max_new_tokens=2)  # warm-up
        start = time.perf_counter()
        tokens = 0
        for prompt, n in requests:
            ids = torch.tensor([prompt], device=model.device)
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            tokens += out.shape[1] - len(prompt)
        wall = time.perf_counter() - start
    return {"requests": len(requests), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "peak_rss_mib": rss.mib}


def run_hf_static(model: transformers.LlamaForCausalLM, requests: list[Request], batch: int) -> dict:
    """generate() on static batches of `batch` left-padded prompts, in order: what a user
    without a serving engine would write. Each batch runs until its longest output is
    done (min_new_tokens = max_new_tokens = the longest), so only each request's own
    output counts: tokens/s is useful tokens. Every request of a batch gets a token per
    (batch time / its longest output): that is its TPOT here (the prefill included)."""
    pad = model.config.pad_token_id
    with PeakRss() as rss, torch.no_grad():
        model.generate(torch.tensor([requests[0][0][:8]], device=model.device), max_new_tokens=2)  # warm-up
        start, cpu = time.perf_counter(), cpu_seconds()
        useful, tpot = 0, []
        for i in range(0, len(requests), batch):
            chunk = requests[i:i + batch]
            width, new = max(len(p) for p, _ in chunk), max(n for _, n in chunk)
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, (prompt, _) in enumerate(chunk):
                ids[row, width - len(prompt):] = torch.tensor(prompt)
                mask[row, width - len(prompt):] = 1
            began = time.perf_counter()
            model.generate(ids.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, pad_token_id=pad)
            tpot += [(time.perf_counter() - began) / new] * len(chunk)
            useful += sum(n for _, n in chunk)
        wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu
    return {"batch": batch, "requests": len(requests), "useful_tokens": useful, "wall_s": wall,
            "tokens_per_s": useful / wall, "cpu_s": cpu, "tokens_per_cpu_s": useful / cpu, "peak_rss_mib": rss.mib,
            **_tpot_ms(tpot)}


def static_section(loaded: LoadedModel, quick: bool, base: EngineConfig) -> dict:
    """The engine at 32 in flight against generate() on static batches of 32, on the same
    64 requests (prompts 16-256, outputs 64-256 tokens; 32 requests of 32-128 quick),
    interleaved repetitions, medians; and both sides' tokens/s against TPOT as the
    concurrency (the batch) grows."""
    hf_model = to_transformers(loaded)
    n, outputs, reps = (32, (32, 128), 2) if quick else (64, (64, 256), 3)
    requests = workload(n, 64, (16, 256), outputs)
    engine_runs, hf_runs = [], []
    for rep in range(reps):  # interleaved, so that the machine's other load falls on both
        engine_runs.append(run_engine(loaded, requests, 32, base))
        hf_runs.append(run_hf_static(hf_model, requests, 32))
        print(f"[bench] static batching, round {rep + 1}/{reps}: engine {engine_runs[-1]['tokens_per_s']:.0f}, "
              f"generate() x32 {hf_runs[-1]['tokens_per_s']:.0f} useful tokens/s (per CPU second: "
              f"{engine_runs[-1]['tokens_per_cpu_s']:.0f}, {hf_runs[-1]['tokens_per_cpu_s']:.0f}); "
              f"load {os.getloadavg()[0]:.1f}", flush=True)
    engine_tps = statistics.median(r["tokens_per_s"] for r in engine_runs)
    hf_tps = statistics.median(r["tokens_per_s"] for r in hf_runs)
    # The same ratio in CPU time: a cross-check when other processes share the cores.
    cpu_ratio = (statistics.median(r["tokens_per_cpu_s"] for r in engine_runs)
                 / statistics.median(r["tokens_per_cpu_s"] for r in hf_runs))
    curve_requests = workload(32 if quick else 64, 65, (16, 256), outputs)
    curve = {"engine": [run_engine(loaded, curve_requests, c, base) for c in (1, 8, 32)],
             "hf_static": [run_hf_static(hf_model, curve_requests[:8] if b == 1 else curve_requests, b)
                           for b in (1, 8, 32)]}
    return {"speedup_vs_hf_static_batch_at_32": engine_tps / hf_tps,
            "static": {"requests": n, "prompt_lens": (16, 256), "output_lens": outputs, "repetitions": reps,
                       "engine_tokens_per_s_median": engine_tps, "hf_static_tokens_per_s_median": hf_tps,
                       "speedup_cpu_time": cpu_ratio,
                       "per_round_speedups": [e["tokens_per_s"] / h["tokens_per_s"]
                                              for e, h in zip(engine_runs, hf_runs)],
                       "engine": engine_runs, "hf_static": hf_runs, "curve": curve}}


def print_static(static: dict) -> None:
    st = static["static"]
    print(f"\nengine at 32 vs generate() on static batches of 32 ({st['requests']} requests, outputs "
          f"{st['output_lens'][0]}-{st['output_lens'][1]}, median of {st['repetitions']}): "
          f"{st['engine_tokens_per_s_median']:.0f} vs {st['hf_static_tokens_per_s_median']:.0f} useful tokens/s = "
          f"{static['speedup_vs_hf_static_batch_at_32']:.2f}x (target >= 2.0); in CPU time {st['speedup_cpu_time']:.2f}x")
    print(f"{'side':<22}{'in flight':>10}{'tokens/s':>10}{'TPOT p50 ms':>13}{'TPOT p99 ms':>13}")
    for side, key in (("engine", "concurrency"), ("hf_static", "batch")):
        for r in st["curve"][side]:
            print(f"{side:<22}{r[key]:>10}{r['tokens_per_s']:>10.0f}{r['tpot_p50_ms']:>13.1f}{r['tpot_p99_ms']:>13.1f}")


def run_prefix(loaded: LoadedModel, n: int, prefix_len: int, cached: bool, base: EngineConfig) -> dict:
    rng = random.Random(7)
    shared = [rng.randrange(256) for _ in range(prefix_len)]
    prefixes = [shared if cached else [rng.randrange(256) for _ in range(prefix_len)] for _ in range(n)]
    prompts = [p + [rng.randrange(256) for _ in range(32)] for p in prefixes]
    with Engine(loaded, dataclasses.replace(base, kv_memory_bytes=1024 * 2**20, max_num_seqs=64)) as engine:
        if cached:
            engine.generate("warm-prefix", shared + [1, 2, 3], 1)
        with PeakRss() as rss:
            submitted = time.time()
            handles = [engine.submit(f"p{i}", p, 8, ignore_eos=True) for i, p in enumerate(prompts)]
            done = [h.result() for h in handles]
    ttft = [c.first_token_at - submitted for c in done]
    return {"cached": cached, "requests": n, "mean_ttft_s": sum(ttft) / n, "max_ttft_s": max(ttft),
            "cached_tokens_per_request": sum(c.cached_tokens for c in done) / n, "peak_rss_mib": rss.mib}


def spec_workloads(loaded: LoadedModel, n: int) -> dict[str, tuple[list[list[int]], Sampling]]:
    """name -> (prompts, sampling); see the module docstring, part 3."""
    text = (PACKAGED_DIR / "english" / "heldout.txt").read_text(encoding="utf-8")
    fortunes = [f.strip() for f in text.split("\n%\n") if len(f.strip()) > 40]
    ops_ = [("add", "+"), ("sub", "-"), ("mul", "*"), ("div", "/"), ("mod", "%"), ("pow", "**")]
    repetitive = []
    for i in range(n):
        if i % 2:  # code with repeated lines, one more function begun
            defs = "".join(f"def {name}(a, b):\n    return a {op} b\n\n" for name, op in ops_[:3 + i % 3])
            repetitive.append(f"{defs}def {ops_[3 + i % 3][0]}(a, b):\n")
        else:  # a text, and the start of quoting it again
            f = fortunes[i % len(fortunes)][:240]
            repetitive.append(f"{f}\n\nThe same text again, word for word:\n\n{' '.join(f.split()[:3])}")
    ordinary = [fortunes[(7 * i + 3) % len(fortunes)].split("\n")[0][:80] for i in range(n)]
    enc = loaded.tokenizer.encode
    return {"repetitive": ([enc(p) for p in repetitive], Sampling()),
            "nonrepetitive": ([enc(p) for p in ordinary], Sampling(temperature=1.0))}


def run_spec_once(loaded: LoadedModel, prompts: list[list[int]], sampling: Sampling, speculative: bool,
                  concurrency: int, max_new: int, base: EngineConfig) -> dict:
    config = dataclasses.replace(base, kv_memory_bytes=128 * 2**20, max_num_seqs=concurrency)
    with Engine(loaded, config) as engine:
        engine.generate("warm-up", prompts[0][:8], 2)
        before = engine.stats()
        cpu = psutil.Process().cpu_times()
        start = time.perf_counter()
        # Seeded per request, so the sampled workload's requests are the same on both sides.
        handles = [engine.submit(f"s{i}", p, max_new, replace(sampling, seed=i, speculative=speculative),
                                 ignore_eos=True) for i, p in enumerate(prompts)]
        outputs = [h.result().tokens for h in handles]
        wall = time.perf_counter() - start
        cpu_after = psutil.Process().cpu_times()
        stats = engine.stats()
    tokens = sum(map(len, outputs))
    # CPU seconds of this process: what the run cost, whatever else the machine ran meanwhile.
    cpu_s = (cpu_after.user - cpu.user) + (cpu_after.system - cpu.system)
    drafted = stats.spec_draft_tokens - before.spec_draft_tokens
    accepted = stats.spec_accepted_tokens - before.spec_accepted_tokens
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "tokens_per_cpu_s": tokens / cpu_s,
            # Each step a sequence samples in gives it its accepted drafts + 1 tokens.
            "steps": stats.steps - before.steps, "seq_steps": tokens - accepted,
            "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None, "outputs": outputs}


def run_spec(loaded: LoadedModel, workload: tuple[list[list[int]], Sampling], concurrency: int, max_new: int,
             repeats: int, base: EngineConfig) -> dict:
    """Tokens/s without and with speculation, run alternately `repeats` times; the best of each."""
    prompts, sampling = workload
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for _ in range(repeats):
        for speculative in (False, True):
            runs[speculative].append(run_spec_once(loaded, prompts, sampling, speculative, concurrency, max_new, base))
    plain, spec = (max(runs[k], key=lambda r: r["tokens_per_s"]) for k in (False, True))
    cpu = {k: max(r["tokens_per_cpu_s"] for r in runs[k]) for k in (False, True)}
    same = plain["outputs"] == spec["outputs"]
    if sampling.temperature == 0 and not same:
        raise AssertionError("greedy speculative decoding changed the output")
    return {"concurrency": concurrency, "requests": len(prompts), "max_new_tokens": max_new,
            "temperature": sampling.temperature, "plain_tokens_per_s": plain["tokens_per_s"],
            "spec_tokens_per_s": spec["tokens_per_s"], "speedup": spec["tokens_per_s"] / plain["tokens_per_s"],
            "speedup_cpu_time": cpu[True] / cpu[False],
            "acceptance_rate": spec["acceptance_rate"], "draft_tokens": spec["draft_tokens"],
            "accepted_tokens": spec["accepted_tokens"],
            # Tokens a sequence gets per step it is in: 1 without speculation.
            "tokens_per_seq_step": spec["tokens"] / spec["seq_steps"], "same_tokens": same,
            "all_tokens_per_s": {"plain": [r["tokens_per_s"] for r in runs[False]],
                                 "spec": [r["tokens_per_s"] for r in runs[True]]}}


def spec_section(quick: bool, device: str, base: EngineConfig) -> dict:
    loaded = load_model("builtin:english", device=device)
    max_new, repeats = (96, 3) if quick else (192, 5)
    runs = []
    for name, (prompts, sampling) in spec_workloads(loaded, 8 if quick else 16).items():
        for concurrency in (1, 8):
            # Alone, a few requests one after another: the latency-bound case speculation is for.
            chosen = prompts[:4 if quick else 8] if concurrency == 1 else prompts
            r = run_spec(loaded, (chosen, sampling), concurrency, max_new, repeats, base)
            runs.append({"workload": name, **r})
    at_1 = {r["workload"]: r for r in runs if r["concurrency"] == 1}
    return {"spec_speedup_repetitive": at_1["repetitive"]["speedup"],
            "spec_speedup_nonrepetitive": at_1["nonrepetitive"]["speedup"],
            "spec_acceptance_repetitive": at_1["repetitive"]["acceptance_rate"],
            "spec_acceptance_nonrepetitive": at_1["nonrepetitive"]["acceptance_rate"],
            "spec": {"model": "builtin:english", "spec_tokens": base.spec_tokens, "runs": runs}}


def print_spec(spec: dict) -> None:
    print(f"{'speculative decoding':<28}{'conc.':>6}{'plain tok/s':>13}{'spec tok/s':>12}{'speedup':>9}"
          f"{'(CPU time)':>11}{'accepted':>10}{'tok/seq-step':>14}")
    for r in spec["spec"]["runs"]:
        rate = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.0%}"
        print(f"{r['workload'] + (' (greedy)' if r['temperature'] == 0 else ' (T=1)'):<28}{r['concurrency']:>6}"
              f"{r['plain_tokens_per_s']:>13.0f}{r['spec_tokens_per_s']:>12.0f}{r['speedup']:>8.2f}x"
              f"{r['speedup_cpu_time']:>10.2f}x{rate:>10}{r['tokens_per_seq_step']:>14.2f}")


def plot(engine_runs: list[dict], hf: dict, prefix: list[dict], path: Path, *, static: dict | None = None) -> None:
    curve = (static or {}).get("static", {}).get("curve")
    fig, axes = plt.subplots(1, 3 if curve else 2, figsize=(16.5 if curve else 11, 4))
    left, right = axes[0], axes[1]
    if curve:
        for side, label, key in (("engine", "kvfleet engine", "concurrency"),
                                 ("hf_static", "generate(), static batches", "batch")):
            runs = curve[side]
            axes[2].plot([r["tpot_p50_ms"] for r in runs], [r["tokens_per_s"] for r in runs], "o-", label=f"{label} p50")
            axes[2].plot([r["tpot_p99_ms"] for r in runs], [r["tokens_per_s"] for r in runs], "x--",
                         label=f"{label} p99")
            for r in runs:
                axes[2].annotate(str(r[key]), (r["tpot_p50_ms"], r["tokens_per_s"]), fontsize=8)
        axes[2].set(xscale="log", xlabel="time per output token (ms)", ylabel="useful tokens/s",
                    title=f"vs static batches of 32: {static['speedup_vs_hf_static_batch_at_32']:.2f}x")
        axes[2].legend(fontsize=8)
    xs = [r["concurrency"] for r in engine_runs]
    left.plot(xs, [r["tokens_per_s"] for r in engine_runs], "o-", label="kvfleet engine")
    left.axhline(hf["tokens_per_s"], color="gray", linestyle="--", label="transformers generate(), one at a time")
    left.set(xscale="log", xticks=xs, xticklabels=[str(x) for x in xs], xlabel="concurrent requests",
             ylabel="generated tokens/s", title="builtin:bench throughput")
    left.legend()
    right.bar(["prefix not cached", "prefix cached"], [p["mean_ttft_s"] for p in prefix], color=["gray", "C0"])
    right.set(ylabel="mean time to first token (s)", title=f"{prefix[0]['requests']} requests, 1,024-token prefix")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests, shorter outputs (about two minutes)")
    parser.add_argument("--spec-only", action="store_true",
                        help="only the speculative-decoding part; its keys are merged into engine.json")
    parser.add_argument("--static-only", action="store_true",
                        help="only the static-batching comparison; its keys are merged into engine.json")
    parser.add_argument("--kv-mixed-only", action="store_true",
                        help="only the FP16-K / INT8-V pool against the 16-bit one; its keys are merged into engine.json")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads, for both sides")
    parser.add_argument("--device", default="cpu", help="cpu (float32) or cuda (bfloat16)")
    env = Settings.from_env().engine  # KVFLEET_KERNELS / KVFLEET_ATTENTION, as a worker reads them
    parser.add_argument("--kernels", choices=ops.BACKENDS, default=env.kernels,
                        help="the engine's kernel backend (default: KVFLEET_KERNELS, else auto)")
    parser.add_argument("--attention", choices=ops.ATTENTIONS, default=env.attention,
                        help="the engine's attention path (default: KVFLEET_ATTENTION, else paged)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where engine.json and engine.png go")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()

    base = EngineConfig(kernels=args.kernels, attention=args.attention)
    kernels = ops.select(base.kernels, base.attention)  # what the engines below run
    def merge(part: dict, setup_key: str) -> dict:
        """One part's keys merged into the existing engine.json, with that run's setup."""
        path = args.results / "engine.json"
        results = json.loads(path.read_text()) if path.exists() else {}
        results.update(part)
        results.setdefault("setup", {})[setup_key] = {
            "quick": args.quick, "threads": args.threads, "load_avg_before": load_before,
            "load_avg_after": os.getloadavg(), "kernels": kernels.backend, "attention": kernels.attention}
        args.results.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2) + "\n")
        return results

    if args.spec_only:
        spec = spec_section(args.quick, args.device, base)
        print_spec(spec)
        merge(spec, "spec_setup")
        return

    if args.kv_mixed_only:
        mixed = kv_mixed.section(load_model(kv_mixed.MODEL, device=args.device, dtype=kv_mixed.DTYPE), kernels,
                                 base, args.quick)
        kv_mixed.print_section(mixed)
        merge(mixed, "kv_mixed_setup")
        return

    loaded = load_model("builtin:bench", device=args.device)
    if args.static_only:
        static = static_section(loaded, args.quick, base)
        print_static(static)
        results = merge(static, "static_setup")
        if all(k in results for k in ("engine", "hf_generate", "prefix")):  # the other panels come from a full run
            plot(results["engine"], results["hf_generate"], results["prefix"], args.results / "engine.png",
                 static=results)
        else:
            print(f"[bench] no full run in {args.results / 'engine.json'}: plot skipped")
        return
    prompt_lens, output_lens = (16, 256), ((32, 128) if args.quick else (64, 256))
    # Twice as many requests as slots (one at concurrency 1 aside): finished requests are
    # replaced mid-run, as in a steady stream, instead of the batch draining in one wave.
    sizes = {1: 4, 8: 16, 32: 64, 64: 128} if args.quick else {1: 8, 8: 32, 32: 128, 64: 256}
    engine_runs = [run_engine(loaded, workload(n, c, prompt_lens, output_lens), c, base) for c, n in sizes.items()]
    hf = run_hf(to_transformers(loaded), workload(6 if args.quick else 16, 32, prompt_lens, output_lens))
    n_prefix = 16 if args.quick else 64
    prefix = [run_prefix(loaded, n_prefix, 1024, cached=False, base=base),
              run_prefix(loaded, n_prefix, 1024, cached=True, base=base)]
    spec = spec_section(args.quick, args.device, base)
    static = static_section(loaded, args.quick, base)
    mixed = kv_mixed.section(load_model(kv_mixed.MODEL, device=args.device, dtype=kv_mixed.DTYPE), kernels, base,
                             args.quick)

    at_32 = next(r for r in engine_runs if r["concurrency"] == 32)
    results = {
        "speedup_vs_hf_at_32": at_32["tokens_per_s"] / hf["tokens_per_s"],
        "ttft_prefix_cached_over_uncached": prefix[1]["mean_ttft_s"] / prefix[0]["mean_ttft_s"],
        **{k: v for k, v in spec.items() if k != "spec"},
        **static,
        **mixed,
        "engine": engine_runs, "hf_generate": hf, "prefix": prefix, "spec": spec["spec"],
        "setup": {"quick": args.quick, "threads": args.threads, "cpus": os.cpu_count(),
                  "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
                  "prompt_lens": prompt_lens, "output_lens": output_lens,
                  "device": str(loaded.device), "dtype": str(loaded.dtype), "kernels": kernels.backend,
                  "attention": kernels.attention, "torch": torch.__version__},
    }
    print(f"{'run':<28}{'requests':>9}{'tokens/s':>11}{'vs HF':>8}{'peak RSS MiB':>14}")
    for r in engine_runs:
        print(f"{'engine, ' + str(r['concurrency']) + ' concurrent':<28}{r['requests']:>9}"
              f"{r['tokens_per_s']:>11.0f}{r['tokens_per_s'] / hf['tokens_per_s']:>7.1f}x{r['peak_rss_mib']:>14.0f}")
    print(f"{'HF generate(), sequential':<28}{hf['requests']:>9}{hf['tokens_per_s']:>11.0f}{1:>7.1f}x"
          f"{hf['peak_rss_mib']:>14.0f}")
    for p in prefix:
        print(f"prefix {'cached' if p['cached'] else 'not cached':<11} {p['requests']} requests: mean TTFT "
              f"{p['mean_ttft_s']:.3f} s, max {p['max_ttft_s']:.3f} s, peak RSS {p['peak_rss_mib']:.0f} MiB")
    print(f"speedup vs HF at 32: {results['speedup_vs_hf_at_32']:.1f}x; "
          f"cached/uncached TTFT: {results['ttft_prefix_cached_over_uncached']:.3f}; "
          f"load average {load_before[0]:.1f} -> {results['setup']['load_avg_after'][0]:.1f} on {os.cpu_count()} CPUs")
    print_spec(spec)
    print_static(static)
    kv_mixed.print_section(mixed)

    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "engine.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(engine_runs, hf, prefix, args.results / "engine.png", static=results)


if __name__ == "__main__":
    main()
