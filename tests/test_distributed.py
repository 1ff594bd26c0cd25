"""tierflow train on 2 ranks (gloo, processes launched as torchrun would: RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT): the same losses as one process with the same global batch, half
the optimizer states per rank, checkpoints that resume on either world size, replicas on
disk tiers of their own with --disk, and a killed rank that makes the other stop with one
clear line."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_support import STDLIB_FILES, assert_error_line, make_train_env, records, run_main

SRC = str(Path(__file__).resolve().parents[1] / "src")
REL = 1e-5  # fp32: the two runs differ only in the order of additions


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The tiny corpus (vocab 300) and tiny Llama of tests/test_train.py."""
    return make_train_env(tmp_path_factory.mktemp("dist"), STDLIB_FILES[:4])


def _args(env, out, *extra):
    return ["train", "--model", env["model"], "--data", env["data"], "--seq-len", "32",
            "--batch-size", "4", "--grad-accum", "2", "--dtype", "fp32", "--lr", "1e-2",
            "--warmup", "1", "--out", str(out), *extra]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, ranks: int) -> list[subprocess.Popen]:
    """``python -m tierflow ARGS`` as ``ranks`` processes of one gloo world (1: no world),
    each in a session of its own (kill one with ``os.killpg``) and forked by /bin/sh, so that
    its peak RSS starts from its own, not from this test process's (see tierflow.cli.measure)."""
    base = dict(os.environ, PYTHONPATH=SRC, OMP_NUM_THREADS="1")
    for key in ("TIERFLOW_TRACEBACK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        base.pop(key, None)
    port = _free_port()
    procs = []
    for rank in range(ranks):
        child = dict(base) if ranks == 1 else dict(
            base, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        cmd = ["/bin/sh", "-c", '"$@"; exit $?', "sh", sys.executable, "-m", "tierflow", *args]
        procs.append(subprocess.Popen(cmd, env=child, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, start_new_session=True))
    return procs


def finish(procs, timeout: float = 120) -> list[tuple[str, str]]:
    outputs = [p.communicate(timeout=timeout) for p in procs]
    for rank, (p, (_, err)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank}: {err}"
    return outputs



def assert_close(a: float, b: float, what: str) -> None:
    assert abs(a - b) <= REL * abs(b), f"{what}: {a} vs {b} (relative {abs(a - b) / abs(b):.2e})"


@pytest.fixture(scope="module")
def runs(env):
    """5 steps on 1 process and on 2 ranks, side by side, each saving step 3 and step 5."""
    root = env["root"]
    extra = ("--steps", "5", "--save-every", "3", "--eval-every", "5", "--eval-steps", "3")
    procs = launch(_args(env, root / "one", *extra), 1) + launch(
        _args(env, root / "two", *extra, "--trace", str(root / "two.json")), 2)
    outputs = finish(procs)
    return {"one": root / "one", "two": root / "two", "stdout": [o for o, _ in outputs],
            "trace": root / "two.json"}


def test_two_ranks_match_one_process(runs):
    one = records(runs["one"] / "log.jsonl", "train")
    two = records(runs["two"] / "log.jsonl", "train")
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2, 3, 4, 5]
    for a, b in zip(two, one):
        assert_close(a["loss"], b["loss"], f"loss at step {a['step']}")
        assert abs(a["norm"] - b["norm"]) <= 1e-4 * b["norm"], (a["norm"], b["norm"])
    assert len({r["loss"] for r in one}) == 5  # the loss moves: the comparison can fail
    assert_close(records(runs["two"] / "log.jsonl", "eval")[0]["loss"],
                 records(runs["one"] / "log.jsonl", "eval")[0]["loss"], "eval loss")
    # rank 0 alone prints and logs; every rank's memory is in each train record
    rank0, rank1 = runs["stdout"][1:]
    assert rank0.count("[T] step") == 5 and rank1 == ""
    assert all(len(r["ram_bytes_per_rank"]) == 2 and min(r["ram_bytes_per_rank"]) > 0
               for r in two)
    plan = records(runs["two"] / "log.jsonl", "plan")[0]
    assert plan["world_size"] == 2 and plan["predicted_comm_s"] > 0
    assert "optimizer states (reserved, 1/2 shard)" in rank0 and "communication" in rank0
    # the values the ranks exchange each step are the plan's ops, measured on the network
    # row: under ZeRO-2 the clipping norm's too
    events = json.loads(runs["trace"].read_text())["traceEvents"]
    exchanged = [e["name"] for e in events if e.get("name", "").startswith("exchange(")
                 and e["ph"] == "X" and e["pid"] == next(
                     p["pid"] for p in events if p.get("name") == "process_name"
                     and p["args"]["name"] == "measured")]
    assert {name: exchanged.count(name) for name in set(exchanged)} == {
        "exchange(loss)": 5, "exchange(gradient norm)": 5, "exchange(memory report)": 5}


def test_each_rank_holds_half_the_optimizer_states(runs):
    single = records(runs["one"] / "log.jsonl", "train")[-1]["optimizer_state_bytes_per_rank"]
    ranks = records(runs["two"] / "log.jsonl", "train")[-1]["optimizer_state_bytes_per_rank"]
    assert len(single) == 1 and len(ranks) == 2
    for rank_bytes in ranks:  # the moments split evenly; step counters per piece are 4 bytes
        assert abs(rank_bytes - single[0] / 2) <= 0.01 * single[0] / 2, (ranks, single)
    one_plan = records(runs["one"] / "log.jsonl", "plan")[0]
    two_plan = records(runs["two"] / "log.jsonl", "plan")[0]
    key = "optimizer states (reserved)"
    assert two_plan[key] * 2 == one_plan[key]


def test_checkpoints_resume_on_the_other_world_size(runs, tmp_path):
    """step 3 of the 2-rank run on 1 process and step 3 of the 1-process run on 2 ranks, side
    by side: both give the uninterrupted runs' losses at steps 4 and 5."""
    logs = {name: tmp_path / f"{name}.jsonl" for name in ("two", "one")}
    procs = []
    for source, ranks in (("two", 1), ("one", 2)):
        procs += launch(["train", "--resume", str(runs[source] / "step_3"), "--out",
                         str(tmp_path / source), "--log", str(logs[source]), "--save-every",
                         "0"], ranks)
    finish(procs)
    for source, log in logs.items():
        resumed = records(log, "train")
        assert [r["step"] for r in resumed] == [4, 5]
        for name in ("one", "two"):
            want = {r["step"]: r["loss"] for r in records(runs[name] / "log.jsonl", "train")}
            for r in resumed:
                assert_close(r["loss"], want[r["step"]], f"from {source}, vs {name}, "
                                                         f"step {r['step']}")


def test_checkpoint_has_the_single_process_format(runs):
    from safetensors import safe_open
    names = {}
    for name in ("one", "two"):
        with safe_open(str(runs[name] / "step_5" / "optimizer.safetensors"), "pt") as f:
            names[name] = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    assert names["one"] == names["two"] and any(k.endswith("exp_avg") for k in names["one"])


def test_two_ranks_train_the_same_frozen_selection(env, tmp_path):
    """--train-only on 2 ranks: the one-process run's losses, and the frozen layers' weights
    as they were (only trainable parameters are sharded, reduced and gathered)."""
    from safetensors.torch import load_file
    extra = ("--steps", "3", "--eval-every", "0", "--train-only",
             "model.layers.1.*,lm_head.*")
    finish(launch(_args(env, tmp_path / "one", *extra), 1)
           + launch(_args(env, tmp_path / "two", *extra), 2))
    one, two = (records(tmp_path / name / "log.jsonl", "train") for name in ("one", "two"))
    for a, b in zip(two, one, strict=True):
        assert_close(a["loss"], b["loss"], f"loss at step {a['step']}")
    initial = load_file(f"{env['model']}/model.safetensors")
    final = load_file(str(tmp_path / "two" / "step_3" / "model.safetensors"))
    for name, value in final.items():
        assert torch.equal(value, initial[name]) != name.startswith(("model.layers.1.",
                                                                      "lm_head.")), name


@pytest.mark.parametrize("flags, rel", [
    # updates after the backward (clipping, 2 micro-batches), fp32
    ((), REL),
    # updates inside the backward, bf16 weights with stochastic rounding and int8 moments,
    # which ZeRO's shards cannot run: each replica rounds from the same seeded stream
    (("--grad-accum", "1", "--clip", "0", "--dtype", "bf16", "--model-dtype", "bf16",
      "--master", "none", "--optim-dtype", "int8"), 3e-3),
])
def test_two_ranks_with_disk_tiers_match_one_process(env, tmp_path, flags, rel):
    """--disk on 2 ranks: every rank streams the whole model from a disk tier of its own and
    averages each stage's gradients before its update; the losses are the one-process
    --disk run's with the same global batch (bf16 and int8: to their rounding, 1.1e-3 at
    step 3 here; without the averaging 1.2e-2 already at step 2), and rank 0's checkpoint
    holds the one process's weights."""
    from safetensors.torch import load_file
    disk = tmp_path / "tier"
    disk.mkdir()
    extra = ("--steps", "3", "--eval-every", "3", "--eval-steps", "2", "--save-every", "2",
             "--disk", str(disk), "--stream", "all", *flags)
    # the two runs go on at once: a trace each
    outputs = finish(launch(_args(env, tmp_path / "one", *extra, "--trace",
                                  str(tmp_path / "one.json")), 1)
                     + launch(_args(env, tmp_path / "two", *extra, "--trace",
                                    str(tmp_path / "two.json")), 2))
    one, two = (records(tmp_path / name / "log.jsonl", "train") for name in ("one", "two"))
    assert len(one) == len(two) == 3 and len({r["loss"] for r in one}) == 3
    for a, b in zip(two, one, strict=True):
        assert abs(a["loss"] - b["loss"]) <= rel * abs(b["loss"]), (a, b)
    evals = [records(tmp_path / name / "log.jsonl", "eval")[0]["loss"] for name in ("one", "two")]
    assert abs(evals[1] - evals[0]) <= rel * evals[0], evals  # each rank evaluates its share
    assert "replicas: each rank holds the whole model" in outputs[1][0]
    assert records(tmp_path / "two" / "log.jsonl", "plan")[0]["replicas"] is True
    weights = [load_file(str(tmp_path / name / "step_3" / "model.safetensors"))
               for name in ("one", "two")]
    for name, value in weights[0].items():
        torch.testing.assert_close(weights[1][name], value, rtol=100 * rel, atol=100 * rel,
                                   msg=name)
    assert list(disk.iterdir()) == []  # each rank's scratch directory removed
    for trace in ("two.json", "two.rank1.json"):  # one per rank, the reductions in each
        events = json.loads((tmp_path / trace).read_text())["traceEvents"]
        network = next(e["tid"] for e in events if e.get("name") == "thread_name"
                       and e["args"]["name"] == "network")
        reduces = {}  # per process (measured, predicted): the reduce ops on the network row
        for e in events:
            if e.get("name", "").startswith("reduce(") and e["tid"] == network:
                reduces.setdefault(e["pid"], set()).add(e["name"])
        # the plan's reduce ops, measured and predicted, one per trained stage
        assert len(reduces) == 2 and len(set(map(frozenset, reduces.values()))) == 1, reduces
        # each step's values exchanged as the plan's ops, on the network row: the loss and
        # the memory report (replicas measure the clipping norm alone)
        exchanged = [e["name"] for e in events if e.get("name", "").startswith("exchange(")
                     and e["tid"] == network and e["ph"] == "X"]
        assert {name: exchanged.count(name) for name in set(exchanged)} == {
            "exchange(loss)": 3, "exchange(memory report)": 3}, exchanged
    if flags:
        return
    # resumed on 2 ranks, each reading the checkpoint's states onto its own disk tier
    log = tmp_path / "resumed.jsonl"
    finish(launch(["train", "--resume", str(tmp_path / "two" / "step_2"), "--out",
                   str(tmp_path / "resumed"), "--log", str(log), "--save-every", "0"], 2))
    resumed = records(log, "train")
    assert [r["step"] for r in resumed] == [3]
    assert_close(resumed[0]["loss"], two[2]["loss"], "resumed step 3")


def test_a_killed_rank_stops_the_other_with_one_line(env, tmp_path):
    timeout = 20
    procs = launch(_args(env, tmp_path / "run", "--steps", "1000", "--eval-every", "0",
                         "--dist-timeout", str(timeout)), 2)
    log = tmp_path / "run" / "log.jsonl"
    deadline = time.monotonic() + 90
    while len(records(log, "train")) < 2:
        assert all(p.poll() is None for p in procs), procs[0].stderr.read()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    os.killpg(procs[1].pid, signal.SIGKILL)
    killed = time.monotonic()
    _, err = procs[0].communicate(timeout=timeout + 30)
    assert time.monotonic() - killed < timeout
    assert procs[0].returncode == 2
    assert_error_line(err, ["rank 0: rank 1 stopped", "of step", "nothing was saved",
                            "--resume OUT"])
    procs[1].wait()


def test_batch_not_divisible_by_the_ranks_is_one_line(env, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    code, _, err = run_main(*_args(env, tmp_path / "run", "--steps", "1"), capsys=capsys)
    assert code == 2
    assert_error_line(err, ["--batch-size 4 is not divisible by the 3 ranks",
                            "give a multiple of 3"])


@pytest.fixture
def world_of_one():
    """A gloo process group of this process alone."""
    import torch.distributed as dist

    from tierflow.distributed import World
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield World(0, 1, "gloo", 30.0, store)
    dist.destroy_process_group()


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: the head is tied
def test_stages_are_reduced_during_backward_and_zero_matches_adamw(world_of_one, family):
    """Each stage's reduction starts inside backward, at the plan's Reduce op, last stage
    first, before the stages below it have run their backward; none during a no-sync
    micro-batch; the plan's gathers after the step, first stage first. One rank's ZeRO
    update equals torch's AdamW on the same two micro-batches (fitted the same way, so the
    gradients are bit for bit the same; torch sums the clipping norm in fp32, so the clip
    factors differ in the 7th digit: 1e-7 on updates of 1e-2)."""
    import copy

    from models import hf_sample, tiny_hf

    import tierflow
    from tierflow.distributed import ShardedOptimizer
    from tierflow.plan.ops import Reduce
    from tierflow.plan.reductions import Reductions, step_values

    def adamw(groups):
        return torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)

    model = tiny_hf(family).train()
    reference = copy.deepcopy(model)
    batches = [hf_sample(seed=k) for k in range(2)]
    module = tierflow.fit(model, batches[0])
    stages = [list(stage.parameters()) for stage in module.chain.stages]
    zero = ShardedOptimizer(world_of_one, stages, [{"params": list(model.parameters())}], adamw,
                            module.exchange)
    module.run_collectives_with(zero, Reductions(1, all_reduce=False, bus=1e9,
                                                 exchanged=step_values(all_reduce=False)))
    reduces = [op.stage for op in module.plan.ops if isinstance(op, Reduce)]
    assert reduces == list(range(len(stages)))[::-1]  # one per stage, each after its backward
    launched = []
    arrived = [0]  # stage 1's first parameter's gradient, this micro-batch
    stages[1][0].register_post_accumulate_grad_hook(lambda p: arrived.__setitem__(0, 1))
    launch = zero.reducer._launch
    zero.reducer._launch = lambda s: (launched.append((s, arrived[0])), launch(s))
    for k, batch in enumerate(batches):
        zero.micro_batch(last=k == 1)
        arrived[0] = 0
        (module(**batch).loss / 2).backward()
        assert len(launched) == (0 if k == 0 else len(stages))
    assert [s for s, _ in launched] == list(range(len(stages)))[::-1]
    assert launched[0][1] == 0  # the head's reduction started before layer 1's backward
    assert all(p.grad is None for p in model.parameters())  # packed and freed
    norm = zero.clip_grad_norm(0.5)
    zero.step()
    gathers = [op.stage for op in module.plan.routines.gathers]
    assert gathers == list(range(len(stages)))  # after the step, in stage order
    module.gather_parameters()

    optimizer = adamw(reference.parameters())
    plain = tierflow.fit(reference, batches[0])  # the same gradients, bit for bit
    for batch in batches:
        (plain(**batch).loss / 2).backward()
    want = float(torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 0.5))
    optimizer.step()
    assert abs(norm - want) <= 1e-6 * want
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)
