"""Training a fitted module next to its plain-PyTorch reference, step by step."""
import torch


def train_side_by_side(module, reference, sample, make, steps=3, rtol_after_update=None):
    """Steps of the module (its owned optimizer updates inside backward) and of the reference
    with ``make(reference.parameters())`` stepped after backward, from the same seeds.

    The first loss must be equal (default tolerances). After an update, Adam's division by
    sqrt(v) can turn rounding-level gradient differences (the fused LM head sums in another
    order) into lr-sized steps of near-zero-gradient weights: ``rtol_after_update`` then
    bounds the later losses.
    """
    plain = make(reference.parameters())
    for step in range(steps):
        torch.manual_seed(step)
        loss = module(**sample).loss
        loss.backward()
        torch.manual_seed(step)
        expected = reference(**sample).loss
        expected.backward()
        plain.step()
        plain.zero_grad(set_to_none=True)
        tolerance = {} if step == 0 or rtol_after_update is None else dict(
            rtol=rtol_after_update, atol=0.0)
        torch.testing.assert_close(loss, expected, msg=lambda m, s=step: f"step {s}: {m}",
                                   **tolerance)
