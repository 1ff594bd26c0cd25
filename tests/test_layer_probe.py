"""The calibration's layer probe: the fractions it derives price the probe layer at the
seconds it took (stages.py's model run backwards), and on this machine they are sane; the
machine's peak matmul rate behind them (profile/machine.py)."""
import pytest

from tierflow.profile import machine
from tierflow.profile.layer_probe import PROBE_CONFIG, LayerSplit
from tierflow.sim.layer_rates import PROBE_STEPS, measure_layer_rates, rates_of
from tierflow.sim.shapes import shape_from_config
from tierflow.sim.stages import attention_flops, dense_flops, layer_traffic

PEAK, MEMCPY = 4e11, 2e10


@pytest.mark.parametrize("matmuls, regime", [("bf16", "autocast"), ("fp32", "fp32")])
def test_rates_price_the_probe_at_its_measured_time(matmuls, regime):
    shape = shape_from_config(PROBE_CONFIG, "probe")
    step = PROBE_STEPS[matmuls]
    matmul, attention, elementwise = 0.5, 0.2, 0.3
    rates = rates_of(shape, step, regime, PEAK, MEMCPY,
                     LayerSplit(1.0, matmul, attention, elementwise))
    traffic = sum(layer_traffic(shape, step, regime))
    # forward + backward = 3 x the forward's FLOPs, as stages.chain_costs charges them
    assert 3 * dense_flops(shape, step) / (PEAK * rates.matmul_efficiency) == \
        pytest.approx(matmul)
    assert 3 * attention_flops(shape, step) / (PEAK * rates.attention_efficiency) == \
        pytest.approx(attention)
    assert traffic / (MEMCPY * rates.memory_efficiency) == pytest.approx(elementwise)


@pytest.mark.exclusive  # measures the machine
def test_measured_rates_are_fractions_of_the_peaks(monkeypatch, tmp_path):
    """In the trainer's default regime here (bf16 only where the CPU computes it natively:
    elsewhere a bf16 probe layer would take an hour). The peak is measured here too, alone
    on the machine as the rates are, before and after the probe, and the better of the two
    taken (in one clean-clone run the probe's matmuls ran at 1.58 of a single timing). The
    bounds catch a rate off by a factor (the forward + backward's
    3x, a unit), not the few tens of percent a VM's neighbours move a timing by."""
    matmuls = machine.default_matmul_dtype()

    def fresh_peak(name: str) -> float:
        monkeypatch.setenv("TIERFLOW_CACHE", str(tmp_path / name))  # not a cached figure
        return machine.peak_matmul_flops(matmuls)

    before = fresh_peak("before")
    rates = measure_layer_rates(matmuls, before, MEMCPY, repeats=2)
    peak = max(before, fresh_peak("after"))
    assert 0.05 < rates.matmul_efficiency * before / peak < 2.0
    assert 0.01 < rates.attention_efficiency * before / peak < 2.0
    assert rates.memory_efficiency > 0 and rates.layer_seconds > 0


def test_the_peak_is_timed_on_matmuls_that_take_long_enough(monkeypatch):
    """A 2048 matmul where it is fast; a smaller one where it is slow (bf16 without native
    support: a 2048 matmul took 52 s on an AVX2 machine)."""
    import torch

    monkeypatch.setattr(machine, "_LONG_ENOUGH", 0.0)  # every size is long enough: the first
    a, _, seconds = machine._timed_operands(torch.float32)
    assert a.shape[0] == machine._SIZES[0] and seconds > 0
    monkeypatch.setattr(machine, "_LONG_ENOUGH", float("inf"))  # none is: the reference size
    assert machine._timed_operands(torch.float32)[0].shape[0] == machine._SIZES[-1] == 2048


def test_measured_figures_are_keyed_by_native_bf16(monkeypatch):
    keys = set()
    for native in (True, False):
        monkeypatch.setattr(machine, "fast_bf16", lambda native=native: native)
        keys.add(machine.cpu_identity())
    assert len(keys) == 2


def test_only_other_processes_keep_the_peak_from_being_cached():
    """The peak is cached unless other processes took the CPUs while it was timed: this
    process's own work (a training run's) does not count, other processes' work does. The
    decision is checked on made-up samples, since a shared or virtual machine (CI's) has other
    processes and hypervisor steal of its own."""
    import os

    cpus = os.cpu_count() or 1
    start = (100.0, 50.0, 5.0)  # wall seconds, all CPUs' busy seconds, this process's seconds

    def busy_after(wall: float, own: float, others: float) -> bool:
        after = (start[0] + wall, start[1] + own + others, start[2] + own)
        return machine._others_were_busy(start, after)

    assert not busy_after(wall=1.0, own=cpus * 1.0, others=0.0)  # this process took every CPU
    assert not busy_after(wall=1.0, own=0.1, others=0.2 * cpus)
    assert busy_after(wall=1.0, own=0.1, others=0.3 * cpus)
    assert busy_after(wall=1.0, own=cpus * 0.7, others=0.3 * cpus)


def test_cpu_seconds_count_this_process_apart():
    """_cpu_seconds's third figure is this process's CPU time, and the machine's busy time
    includes it: spinning until this process has used 0.3 s more CPU adds about that much."""
    import os

    def own_cpu() -> float:
        times = os.times()
        return times.user + times.system

    before = machine._cpu_seconds()
    end = own_cpu() + 0.3
    while own_cpu() < end:
        pass
    after = machine._cpu_seconds()
    _wall, busy, own = (a - b for a, b in zip(after, before))
    assert 0.29 <= own < 0.4  # os.times counts in clock ticks too
    assert busy >= own - 0.05  # /proc/stat counts in clock ticks (10 ms)
