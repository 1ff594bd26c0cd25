"""The report of ``generate_stream.py``: the markdown of one run's results (its JSON), with
what bounds the streamed generation and the runs under a memory cgroup."""
from __future__ import annotations

import os
import re


def above(r: dict) -> float:
    """Peak RSS above the post-import baseline, GiB."""
    return round(r["peak_rss_gib"] - r["baseline_rss_gib"], 3)


def speed(r: dict) -> str:
    """tok/s, as the median of the runs when there were several."""
    runs = r.get("tok_s_runs", [])
    if len(runs) < 2:
        return f"{r['tok_s']:.3f}"
    return f"{r['tok_s']:.3f} (median of {', '.join(f'{t:.3f}' for t in runs)})"


def disk_bound(printed: list[str]) -> dict:
    """Bytes read per token and the read bandwidth streaming measured, from what it printed."""
    from tierflow.core.units import parse_bytes
    text = "\n".join(printed)
    per_token = re.search(r"([\d.]+) (\w?i?B) read per token", text)
    read = re.search(r"read \d+ layers \(([\d.]+) (\w?i?B)\) in ([\d.]+) s \(([\d.]+) GB/s\)"
                     r"; the compute waited ([\d.]+) s", text)
    per_token_bytes = parse_bytes(per_token.group(1) + per_token.group(2))
    gb_s = float(read.group(4))
    return {"bytes_per_token": per_token_bytes, "read_gb_s": gb_s,
            "read_s": float(read.group(3)), "compute_waited_s": float(read.group(5)),
            "disk_bound_tok_s": round(gb_s * 1e9 / per_token_bytes, 3)}


def cgroup_report(contained: dict) -> list[str]:
    """The section on the runs under a memory cgroup."""
    if "skipped" in contained:
        return [f"Not run under a memory cgroup: {contained['skipped']}.", ""]
    rows = []
    for name, label in (("peer", "peer"), ("tierflow", "tierflow generate"),
                        ("tierflow_int8", "tierflow generate, int8 copy")):
        run = contained[name]
        speed = (f"{run['tok_s']:.3f} | {above(run):.3f}" if "tok_s" in run
                 else f"failed: {run['failed']} | -")
        rows.append(f"| {label} | {speed} | {run['cgroup_peak_gib']:.3f} | "
                    f"{run['limit_hits']} |")
    peer, ours = contained["peer"], contained["tierflow"]
    ratios = [f"{label} / peer under the cgroup: **{run['tok_s'] / peer['tok_s']:.2f}x**."
              for label, run in (("tierflow", ours), ("tierflow int8", contained["tierflow_int8"]))
              if "tok_s" in peer and "tok_s" in run]
    ratio = " ".join(ratios) or "No ratio: a run failed."
    return [
        f"## Under a memory cgroup of {contained['limit']} (the page cache counted for both)",
        "",
        "Each side again in a fresh process inside a cgroup v1 memory limit of "
        f"{contained['limit']}, which counts RSS and page cache together, as a container's "
        "limit does: the RSS after imports (0.36 GiB), the 1 GiB budget and some slack. The "
        "peer's checkpoint is the one saved above, hard-linked (its own `save` child builds "
        "the model whole and does not fit the limit); the checkpoint is out of the page "
        "cache before each run.", "",
        "| run | tok/s | peak RSS above baseline (GiB) | cgroup peak: RSS + page cache (GiB) "
        "| times the limit was reached |", "|---|---|---|---|---|", *rows, "", ratio, ""]


def report(result: dict) -> str:
    peer, peer1, ours, bound = (result["peer"], result["peer_1_thread"], result["tierflow"],
                                result["bound"])
    in_ram, ours8, close = result["tierflow_in_ram"], result["tierflow_int8"], result["fidelity"]
    lines = [
        f"# tierflow generate with streamed weights ({result['date']})", "",
        f"{result['arch']}, `--ram {result['ram']}`, {result['tokens']} new tokens, greedy, bf16, "
        "random weights; each side in a fresh process; tok/s counts the prefill and the decode; "
        "RSS is the peak above the RSS after importing torch and transformers' Llama classes.",
        f"Machine: {os.cpu_count()} cores, shared with other engineers: load average "
        f"{result['load_before'][0]:.1f} before, {result['load_after'][0]:.1f} after.", "",
        "| run | tok/s | peak RSS above baseline (GiB) | checkpoint in page cache, peak |",
        "|---|---|---|---|",
        f"| peer: HF generate + accelerate disk offload | {speed(peer)} | {above(peer):.3f} "
        "| not measured (reads its offload files through the page cache) |",
        f"| peer, OMP_NUM_THREADS=1 (orientation) | {peer1['tok_s']:.3f} | {above(peer1):.3f} "
        "| not measured |",
        f"| tierflow generate | {speed(ours)} | {above(ours):.3f} | "
        f"{ours['page_cache_peak_mib']:.0f} MiB (a second run, {ours['tok_s_while_sampling']:.3f} "
        "tok/s while sampled) |",
        f"| tierflow generate, no `--ram` (every weight in RAM; orientation) | "
        f"{in_ram['tok_s']:.3f} | {above(in_ram):.3f} | - |",
        f"| tierflow generate on the int8 copy (`tierflow quantize`) | {speed(ours8)} | "
        f"{above(ours8):.3f} | not measured |", "",
        f"tierflow / peer (medians): **{result['ratio']:.2f}x** (target 2x). tierflow: prompt "
        f"{ours['prompt_tokens']} tokens, prefill {ours['prefill_s']} s, decode "
        f"{ours['decode_s']} s for {ours['new_tokens']} tokens. Against the one-thread peer: "
        f"{result['ratio_1_thread']:.2f}x.", "",
        "What tierflow printed:", "", "```", *result["printed"], "```", "",
        "## The int8 copy", "",
        f"`tierflow quantize` wrote the copy: `{result['quantized']}`. On it, under the same "
        f"`--ram {result['ram']}`, tierflow makes {ours8['tok_s']:.3f} tok/s: "
        f"**{result['ratio_int8']:.2f}x** the peer (target 2x), reading "
        f"{result['bound_int8']['bytes_per_token'] / 2**20:.0f} MiB per token. This is not the "
        "same model: int8 weights with one scale per output channel round each weight to "
        "within half a step of 1/127 of its row's largest. Teacher-forced on the prompt and "
        f"the bf16 model's greedy continuation ({close['positions']} positions), the int8 "
        "copy's logits differ from the bf16 model's by a median relative L2 error of "
        f"{close['logits_relative_error_median']:.4f}, and its most likely next token is the "
        f"bf16 model's at {close['top1_agreement'] * 100:.1f}% of the positions. These are "
        "random weights, whose nearly flat distributions make the top-1 agreement a severe "
        "test; `benchmarks/int8_quality.py` measures the eval loss of a trained model.", "",
        "What tierflow printed on the int8 copy:", "", "```", *result["printed_int8"], "```",
        "",
        "## What bounds it", "",
        f"Streaming reads {bound['bytes_per_token'] / 2**30:.2f} GiB per token. The reads ran at "
        f"{bound['read_gb_s']:.2f} GB/s here (busy {bound['read_s']:.1f} s; the compute waited "
        f"{bound['compute_waited_s']:.1f} s for them), so the disk allows at most "
        f"{bound['disk_bound_tok_s']:.2f} tok/s. The peer reads its offloaded weights "
        "through the page cache (safetensors' memory-mapped `safe_open` on the checkpoint, or "
        "memory-mapped offload files), so after the first token it hardly reads the disk, and "
        "page cache that no RSS counts holds its offloaded weights.", "",
        f"With OMP_NUM_THREADS=1 the peer makes {peer1['tok_s']:.3f} tok/s, "
        f"{peer1['tok_s'] / peer['tok_s']:.1f}x its default: two compute threads on a busy "
        "2-core machine lose more to descheduling than they gain (tierflow computes with one "
        "thread while it streams, leaving the other core to the reads). Against that peer "
        f"tierflow is at {result['ratio_1_thread']:.2f}x: the peer's whole checkpoint sits in "
        "the page cache, while tierflow, which counts the page cache in the budget, reads "
        f"{bound['bytes_per_token'] / 2**30:.2f} GiB per token from the disk.", "",
        f"With every weight in RAM and no budget, tierflow makes {in_ram['tok_s']:.3f} tok/s "
        f"on this CPU ({in_ram['tok_s'] / peer['tok_s']:.2f}x the peer): what the compute "
        f"allows with no reads at all. The 2x asked is {2 * peer['tok_s']:.3f} tok/s: under "
        f"--ram {result['ram']}, with the page cache counted, the disk allows "
        f"{bound['disk_bound_tok_s'] / peer['tok_s']:.2f}x.", "",
        *cgroup_report(result["cgroup"])]
    return "\n".join(lines)
