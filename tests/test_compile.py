"""fit(config=FitConfig(compile=True)): decoder layers share one compiled kernel, and the
result matches eager within fp32 rounding (fusion reorders float operations)."""
import copy

import torch

import tierflow
from tierflow import FitConfig

from models import hf_sample, tiny_hf


def test_compiled_layers_match_eager_and_share_one_graph():
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    model = tiny_hf("llama", layers=3)
    reference = copy.deepcopy(model)
    sample = hf_sample()
    module = tierflow.fit(model, sample, config=FitConfig(planner="checkpoint-all", compile=True))
    loss = module(**sample).loss
    loss.backward()
    expected = reference(**sample).loss
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, n=name: f"{n}: {m}")
    # three layers, two graphs (with and without grad, for the forwards with and without a
    # tape), not six: the layers' parameters are graph inputs
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
