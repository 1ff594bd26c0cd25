#!/usr/bin/env python3
"""Issue 44's LoRA acceptance: a LoRA fine-tune of tinyllama-1.1b by `tierflow train --lora 16
--ram 1GiB --disk DIR`, its tok/s beside Hugging Face + peft with gradient checkpointing in the
same run, and its saved adapter loaded by peft giving tierflow's logits.

    ./run python benchmarks/lora_tinyllama.py --disk /scratch            # the acceptance run
    ./run python benchmarks/lora_tinyllama.py --disk /tmp --arch llama-20m --seq 256 \\
        --batch 2 --steps 2 --tag smoke                                  # a smoke test

Each part runs in a fresh process (forked by /bin/sh, so that each RSS peak is its own):
1. the base model: ``--arch`` (a Llama preset of ``models/presets.py``, tinyllama-1.1b's
   config) at random init, written by ``save_pretrained`` (bf16: 2.2 GB for 1.1B) with a
   word-level tokenizer of its vocabulary, into a scratch directory under ``--disk``;
2. ``tierflow train --model BASE --lora R --lora-alpha 2R --lora-dropout 0 --ram RAM --disk
   SCRATCH`` on random tokens (token-file version 1, ``random_tokens.py``), ``--seq`` x
   ``--batch``, ``--dtype`` (bf16 autocast by default), AdamW lr 1e-4, weight decay 0.01,
   no clipping or warm-up, ``--steps`` + 1 steps; its peak RSS above its post-import baseline
   is the trainer's own figure (``ram_bytes`` of the ``[T]`` records: the whole process's
   ``ru_maxrss`` up to the last step, model loading included) and, for the whole process
   with its final checkpoint, ``wait4``'s ``ru_maxrss`` less the logged baseline;
3. the peer, ``../shared/peers/peers.py train --mode hf-ckpt --lora R --arch ARCH`` with the
   same ``--seq``, ``--batch``, ``--steps`` and ``--dtype`` (peft LoRA of rank R, alpha 2R, on
   the 7 projections of every decoder layer, as tierflow's ``all-linear``; Hugging Face
   gradient checkpointing; AdamW lr 1e-4), at whatever memory it needs;
4. the logits (fp32, one row of ``--logits-tokens`` random ids): the base loaded by
   ``AutoModelForCausalLM.from_pretrained`` with the saved adapter by
   ``peft.PeftModel.from_pretrained``, against tierflow's own forward of the trained model
   as a resumed run builds it (the base loaded onto a disk tier by ``tierflow.load_model``,
   the adapters injected by ``models/lora.py`` and read from the step directory by
   ``train/adapter_files.py``, every stage streamed from disk by ``tierflow.fit``); also
   how far the adapters move peft's logits from the base's (with them disabled), which says
   whether the match could have caught a lost adapter.
Both trainers' tok/s are ``batch x seq`` over the median step after the first. Writes
benchmarks/results/lora-tinyllama-DATE[-TAG].{md,json}, the machine named; the scratch
directory is removed at the end (``--keep`` keeps it). Run the acceptance on a quiet machine:
the 1.1B run needs about 7 GB free under ``--disk`` and some 5 GB of RAM for the peer and the
logits check.
"""
from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import predicted_ram_peak, source_commit, write_results
from random_tokens import random_token_files

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from tierflow.cli.measure import last_json  # noqa: E402

PEERS = ROOT.parent / "shared" / "peers" / "peers.py"
RESULTS = ROOT / "benchmarks" / "results"
GIB = 2 ** 30
LOGITS_TOLERANCE = 1e-4  # the acceptance: max abs diff of the fp32 logits


def machine() -> dict[str, Any]:
    """The machine the figures belong to: CPU model, cores, memory, the libraries."""
    info: dict[str, str] = {}
    cpuinfo = Path("/proc/cpuinfo")
    for line in (cpuinfo.read_text().splitlines() if cpuinfo.exists() else []):
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    meminfo = Path("/proc/meminfo")
    mem = next((int(line.split()[1]) * 1024 for line in meminfo.read_text().splitlines()
                if line.startswith("MemTotal")), None) if meminfo.exists() else None
    flags = set(info.get("flags", "").split())
    cpu = (f"{info.get('model name', platform.processor() or platform.machine())} (family "
           f"{info.get('cpu family', '?')}, model {info.get('model', '?')})")
    return {"cpu": cpu,
            "cores": os.cpu_count(), "memory_bytes": mem, "host": platform.node(),
            "avx512_bf16": "avx512_bf16" in flags, "amx_bf16": "amx_bf16" in flags,
            "python": platform.python_version(),
            **{name: _version(name) for name in ("torch", "transformers", "peft")}}


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT / "src"))


def fresh(cmd: list[str], log: Path, timeout: float | None = None) -> dict[str, Any]:
    """Run ``cmd`` in a fresh process forked by /bin/sh (a child exec'd by this process
    would start its ``ru_maxrss`` at this one's), its output to ``log``: its exit code, wall
    seconds, peak RSS (``wait4``), the last JSON line it printed and the tail of its output."""
    full = ["/bin/sh", "-c", '"$@"; exit $?', "sh", *cmd]
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(full, stdout=out, stderr=subprocess.STDOUT, env=_env(),
                                start_new_session=True)
        try:
            _, status, usage = _wait4(proc.pid, timeout)
        except BaseException:  # a timeout or Ctrl-C: take the child down with us
            os.killpg(proc.pid, 9)
            os.waitpid(proc.pid, 0)
            raise
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped by wait4, not by Popen
    text = log.read_text()
    result = last_json(text)
    return {"code": proc.returncode, "seconds": round(time.perf_counter() - start, 1),
            "maxrss_bytes": usage.ru_maxrss * 1024, "result": result,
            "tail": "\n".join(text.strip().splitlines()[-15:])}


def _wait4(pid: int, timeout: float | None):
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            return done, status, usage
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"the child {pid} ran past {timeout:.0f} s")
        time.sleep(0.2)


def _size(text: str) -> int:
    from tierflow.core.units import parse_bytes, size_with_unit
    return parse_bytes(size_with_unit(text, "--ram"), what="--ram")


# ---------------------------------------------------------------- the parent

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--disk", required=True, type=Path,
                        help="an existing directory: the scratch directory (the base model, "
                             "the data, the disk tier, the run) is made there")
    parser.add_argument("--ram", default="1GiB", help="tierflow's --ram (default 1GiB)")
    parser.add_argument("--arch", default="tinyllama-1.1b",
                        help="a Llama preset that peers.py knows too (llama-20m to smoke-test)")
    parser.add_argument("--seq", type=int, default=1024, help="tokens a row (peers.py's 1024)")
    parser.add_argument("--batch", type=int, default=2,
                        help="rows a step (2: at 4 tierflow names 1.11 GiB as its smallest "
                             "--ram for the 1.1B and refuses 1 GiB)")
    parser.add_argument("--steps", type=int, default=3,
                        help="timed steps after one warm-up step, for both (peers.py's 3)")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                        help="matmuls: bf16 autocast (peers.py's default) or fp32")
    parser.add_argument("--rank", type=int, default=16, help="the LoRA rank (alpha 2x)")
    parser.add_argument("--logits-tokens", type=int, default=128)
    parser.add_argument("--peers", type=Path, default=PEERS)
    parser.add_argument("--tag", default="")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    if not args.disk.is_dir():
        parser.error(f"--disk {args.disk} is not an existing directory")
    ram = _size(args.ram)
    stamp = dt.date.today().isoformat() + (f"-{args.tag}" if args.tag else "")
    work = Path(tempfile.mkdtemp(prefix="lora-tinyllama-", dir=args.disk))
    me = [sys.executable, str(Path(__file__).resolve())]
    try:
        built = fresh([*me, "build", "--arch", args.arch, "--out", str(work / "base")],
                      work / "build.log")
        _check(built, "building the base model")
        vocab = built["result"]["vocab_size"]
        tokens = (args.steps + 2) * args.batch * (args.seq + 1) * 2
        data = random_token_files(work / "data", vocab, train_tokens=max(tokens, 1 << 16),
                                  eval_tokens=1 << 12)
        ours = train_tierflow(args, work, data)
        print(f"tierflow: {_brief(ours)}", flush=True)
        peer = train_peer(args)
        print(f"peer: {_brief(peer)}", flush=True)
        logits = {"error": "no adapter: the tierflow run failed"}
        if "adapter" in ours:
            checked = fresh([*me, "logits", "--base", str(work / "base"), "--adapter",
                             ours["adapter"], "--disk", str(work / "compare-tier"),
                             "--tokens", str(args.logits_tokens)], work / "logits.log")
            logits = checked["result"] if checked["code"] == 0 and checked["result"] else {
                "error": checked["tail"].splitlines()[-1] if checked["tail"] else "?"}
            print(f"logits: {logits}", flush=True)
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    verdict = {
        "peak_within_ram": ours.get("peak_bytes") is not None and ours["peak_bytes"] <= ram,
        "whole_process_within_ram": ours.get("process_peak_bytes") is not None
        and ours["process_peak_bytes"] <= ram,
        "logits_match": logits.get("peft_vs_tierflow") is not None
        and logits["peft_vs_tierflow"] <= LOGITS_TOLERANCE}
    if ours.get("tok_s") and peer.get("tok_s"):
        verdict["tok_s_ratio"] = round(ours["tok_s"] / peer["tok_s"], 3)
    result = {"date": stamp, "machine": machine(), "commit": source_commit(ROOT),
              "arch": args.arch, "seq": args.seq, "batch": args.batch, "steps": args.steps,
              "dtype": args.dtype, "rank": args.rank, "ram": args.ram, "ram_bytes": ram,
              "logits_tolerance": LOGITS_TOLERANCE, "base_build": _drop(built, "tail"),
              "tierflow": ours, "peer": peer, "logits": logits, "verdict": verdict}
    md, js = write_results(args.results, f"lora-tinyllama-{stamp}", report(result), result)
    print(report(result))
    print(f"wrote {md} and {js}")


def _check(run: dict[str, Any], what: str) -> None:
    if run["code"] != 0 or run["result"] is None:
        raise SystemExit(f"{what} failed (exit code {run['code']}):\n{run['tail']}")


def _drop(row: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k not in keys}


def _brief(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"error: {row['error']}"
    return ", ".join(f"{k} {row[k]}" for k in ("tok_s", "step_s", "peak_gib") if k in row)


def train_tierflow(args: argparse.Namespace, work: Path, data: Path) -> dict[str, Any]:
    """``tierflow train --lora`` of the base in a fresh process: its figures, or its error."""
    tier = work / "tier"
    tier.mkdir()
    log = work / "train.jsonl"
    steps = args.steps + 1  # the first is the warm-up, as the peer's
    cmd = [sys.executable, "-m", "tierflow", "train", "--model", str(work / "base"),
           "--data", str(data), "--seq-len", str(args.seq), "--batch-size", str(args.batch),
           "--steps", str(steps), "--dtype", args.dtype, "--lr", "1e-4", "--warmup", "0",
           "--clip", "0", "--weight-decay", "0.01", "--eval-every", "0", "--save-every", "0",
           "--lora", str(args.rank), "--lora-alpha", str(2 * args.rank), "--lora-dropout", "0",
           "--ram", args.ram, "--disk", str(tier), "--out", str(work / "run"),
           "--log", str(log)]
    run = fresh(cmd, work / "train.log")
    row: dict[str, Any] = {"command": " ".join(["tierflow", *cmd[3:]]),
                           "seconds": run["seconds"]}
    if run["code"] != 0:
        return {**row, "error": run["tail"].splitlines()[-1] if run["tail"] else "?",
                "code": run["code"]}
    records: dict[str, list[dict]] = {}
    for line in log.read_text().splitlines():
        record = json.loads(line)
        records.setdefault(record["kind"], []).append(record)
    trains = records["train"]
    step_s = statistics.median(r["ms"] / 1e3 for r in trains[1:])
    peak = max(r["ram_bytes"] for r in trains)
    baseline = records["system"][0]["rss_baseline_bytes"]
    plan = records["plan"][0]
    adapter = work / "run" / f"step_{steps}"
    return {**row, "step_s": round(step_s, 3), "steps_s": [round(r["ms"] / 1e3, 3)
                                                           for r in trains],
            "tok_s": round(args.batch * args.seq / step_s, 1),
            "peak_bytes": peak, "peak_gib": round(peak / GIB, 3),
            "process_peak_bytes": run["maxrss_bytes"] - baseline,
            "process_peak_gib": round((run["maxrss_bytes"] - baseline) / GIB, 3),
            "baseline_gib": round(baseline / GIB, 3),
            "losses": [round(r["loss"], 4) for r in trains],
            "predicted_step_s": round(plan["predicted_step_s"], 3),
            "predicted_peak_gib": round(predicted_ram_peak(plan) / GIB, 3),
            "decisions": plan.get("decisions"),
            **({"adapter": str(adapter)} if (adapter / "adapter_config.json").is_file()
               else {"error": f"no adapter directory {adapter}"})}


def train_peer(args: argparse.Namespace) -> dict[str, Any]:
    """peers.py's Hugging Face + peft LoRA with gradient checkpointing, in a fresh process."""
    cmd = [sys.executable, str(args.peers), "train", "--mode", "hf-ckpt", "--lora",
           str(args.rank), "--arch", args.arch, "--seq", str(args.seq), "--batch",
           str(args.batch), "--steps", str(args.steps), "--dtype", args.dtype]
    with tempfile.TemporaryDirectory() as tmp:
        run = fresh(cmd, Path(tmp) / "peer.log")
    row = {"command": " ".join(["python", *cmd[1:]]), "seconds": run["seconds"]}
    if run["code"] != 0 or run["result"] is None:
        return {**row, "error": run["tail"].splitlines()[-1] if run["tail"] else "?"}
    peer = run["result"]
    peak = peer["peak_rss_gib"] - peer["baseline_rss_gib"]
    return {**row, **peer, "peak_gib": round(peak, 3)}


def report(r: dict[str, Any]) -> str:
    m, ours, peer, logits, v = r["machine"], r["tierflow"], r["peer"], r["logits"], r["verdict"]
    memory = f"{m['memory_bytes'] / GIB:.0f} GiB" if m.get("memory_bytes") else "?"
    lines = [f"# LoRA fine-tune of {r['arch']}: tierflow under --ram {r['ram']} against "
             f"Hugging Face + peft ({r['date']})", "",
             f"{m['cpu']}, {m['cores']} cores, {memory} RAM (host {m['host']}); torch "
             f"{m['torch']}, transformers {m['transformers']}, peft {m['peft']}; tierflow "
             f"{r['commit']}. Rank {r['rank']} (alpha {2 * r['rank']}) on every attention and "
             f"MLP projection, seq {r['seq']} x batch {r['batch']}, {r['dtype']} matmuls, "
             f"random tokens; {r['steps']} timed steps after one warm-up, the median. "
             "`benchmarks/lora_tinyllama.py`.", "",
             "| trainer | step s | tok/s | peak RSS above the post-import baseline, GiB | "
             "process wall s |",
             "|---|---|---|---|---|"]
    if "error" in ours:
        lines.append(f"| tierflow --ram {r['ram']} --disk | failed: {ours['error']} | | | |")
    else:
        lines.append(f"| tierflow --ram {r['ram']} --disk | {ours['step_s']} | {ours['tok_s']} "
                     f"| {ours['peak_gib']} (steps; whole process with its checkpoint: "
                     f"{ours['process_peak_gib']}); predicted {ours['predicted_peak_gib']} | "
                     f"{ours['seconds']} |")
    if "error" in peer:
        lines.append(f"| HF + peft, gradient checkpointing | failed: {peer['error']} | | | |")
    else:
        lines.append(f"| HF + peft, gradient checkpointing | {peer['step_s_median']} | "
                     f"{peer['tok_s']} | {peer['peak_gib']} | {peer['seconds']} |")
    lines += ["", f"- peak within --ram {r['ram']}: {_yes(v['peak_within_ram'])} (the whole "
              f"process: {_yes(v['whole_process_within_ram'])})"]
    if ours.get("decisions"):
        d = ours["decisions"]
        lines.append(f"- tierflow's plan: {d.get('strategy')}, {len(d.get('recomputed') or [])} "
                     f"stages recomputed, {len(d.get('streamed') or [])} streamed from "
                     f"{d.get('weights_home') or '-'}; predicted step {ours['predicted_step_s']} s")
    if "tok_s_ratio" in v:
        lines.append(f"- tierflow's tok/s over the peer's: {v['tok_s_ratio']}")
    if "error" in logits:
        lines.append(f"- logits: not compared ({logits['error']})")
    else:
        lines.append(f"- fp32 logits of {logits['tokens']} tokens, the saved adapter loaded by "
                     f"peft against tierflow's forward: max abs diff "
                     f"{logits['peft_vs_tierflow']:.3g} (at most {r['logits_tolerance']:g}: "
                     f"{_yes(v['logits_match'])}); the adapters move peft's logits by up to "
                     f"{logits['adapter_effect']:.3g} from the base's (the logits reach "
                     f"{logits['max_abs_logit']:.3g})")
    lines += ["", f"tierflow: `{ours['command']}`", "", f"peer: `{peer['command']}`"]
    return "\n".join(lines)


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


# ---------------------------------------------------------------- the children

def build(argv: list[str]) -> None:
    """The base model: ``--arch`` at random init, saved in bf16 with a tokenizer."""
    parser = argparse.ArgumentParser(prog="lora_tinyllama.py build")
    parser.add_argument("--arch", required=True)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from tierflow.models.presets import PRESETS, preset_config
    if args.arch not in PRESETS or PRESETS[args.arch].family != "llama":
        raise SystemExit(f"--arch {args.arch}: give a Llama preset of tierflow's presets")
    start = time.perf_counter()
    config = preset_config(args.arch)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(args.out)
    vocab = int(config.vocab_size)
    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(args.out)
    print(json.dumps({"vocab_size": vocab, "parameters": sum(p.numel()
                                                             for p in model.parameters()),
                      "seconds": round(time.perf_counter() - start, 1)}))


def logits(argv: list[str]) -> None:
    """fp32 logits of one row: the saved adapter in peft against tierflow's own forward."""
    parser = argparse.ArgumentParser(prog="lora_tinyllama.py logits")
    parser.add_argument("--base", required=True, type=Path)
    parser.add_argument("--adapter", required=True, type=Path)
    parser.add_argument("--disk", required=True, type=Path)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args(argv)
    import gc

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    import tierflow
    from tierflow.models.lora import LoraSpec, add_adapters
    from tierflow.train.adapter_files import load_adapter_weights
    config = json.loads((args.adapter / "adapter_config.json").read_text())
    vocab = json.loads((args.base / "config.json").read_text())["vocab_size"]
    ids = torch.randint(0, vocab, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    # tierflow's: the trained model as a resumed run builds it, streamed from disk
    args.disk.mkdir(parents=True, exist_ok=True)
    model = tierflow.load_model(args.base, disk=args.disk, dtype=torch.float32)
    spec = LoraSpec(int(config["r"]), float(config["lora_alpha"]), 0.0,
                    tuple(sorted(config["target_modules"])))
    load_adapter_weights(add_adapters(model, spec, seed=0), args.adapter)
    module = tierflow.fit(model, {"input_ids": ids, "labels": ids}, disk=args.disk,
                          optimizer=lambda ps: torch.optim.AdamW(ps, lr=0.0),
                          config=tierflow.FitConfig(planner="checkpoint-all", stream="all"))
    module.eval()
    with torch.no_grad():
        ours = module(input_ids=ids).logits.float()
    module.settle()
    del module, model
    gc.collect()
    # peft's: the base from its directory, the adapter from the step directory
    base = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, args.adapter).eval()
    with torch.no_grad():
        theirs = peft(input_ids=ids).logits.float()
        with peft.disable_adapter():
            plain = peft(input_ids=ids).logits.float()
    print(json.dumps({"tokens": args.tokens,
                      "peft_vs_tierflow": float((theirs - ours).abs().max()),
                      "adapter_effect": float((theirs - plain).abs().max()),
                      "max_abs_logit": float(theirs.abs().max())}))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("build", "logits"):
        {"build": build, "logits": logits}[sys.argv[1]](sys.argv[2:])
    else:
        main()
