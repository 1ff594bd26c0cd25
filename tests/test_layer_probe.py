"""The calibration's layer probe: the fractions it derives price the probe layer at the
seconds it took (stages.py's model run backwards), and on this machine they are sane."""
import pytest

from tierflow.sim.layer_probe import PROBE_CONFIG, PROBE_STEP, _rates, measure_layer_rates
from tierflow.sim.precision import RunPrecision
from tierflow.sim.shapes import shape_from_config
from tierflow.sim.stages import attention_flops, dense_flops, layer_traffic

PEAK, MEMCPY = 4e11, 2e10


def test_rates_price_the_probe_at_its_measured_time():
    shape = shape_from_config(PROBE_CONFIG, "probe")
    matmul, attention, elementwise = 0.5, 0.2, 0.3
    rates = _rates(shape, PROBE_STEP, PEAK, MEMCPY, 1.0, matmul, attention, elementwise)
    regime = RunPrecision("fp32", "none", "fp32", "bf16").regime
    traffic = sum(layer_traffic(shape, PROBE_STEP, regime))
    # forward + backward = 3 x the forward's FLOPs, as stages.chain_costs charges them
    assert 3 * dense_flops(shape, PROBE_STEP) / (PEAK * rates.matmul_efficiency) == \
        pytest.approx(matmul)
    assert 3 * attention_flops(shape, PROBE_STEP) / (PEAK * rates.attention_efficiency) == \
        pytest.approx(attention)
    assert traffic / (MEMCPY * rates.memory_efficiency) == pytest.approx(elementwise)


def test_measured_rates_are_fractions_of_the_peaks():
    from tierflow.train.sol import peak_matmul_flops
    rates = measure_layer_rates(peak_matmul_flops("bf16"), MEMCPY, repeats=2)
    assert 0.05 < rates.matmul_efficiency < 1.5
    assert 0.01 < rates.attention_efficiency < 1.5
    assert rates.memory_efficiency > 0 and rates.layer_seconds > 0
