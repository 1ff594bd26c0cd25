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


def train_accumulating(module, reference, samples, make, steps=3, clip=0.5):
    """``steps`` optimizer steps of ``len(samples)`` micro-batches each, clipped by the
    global norm: the module (updates deferred to after the last backward) against the
    reference with ``make(reference.parameters())`` and clip_grad_norm_."""
    plain = make(reference.parameters())
    n = len(samples)
    for step in range(steps):
        for k, sample in enumerate(samples):
            torch.manual_seed(step * n + k)
            loss = module(**sample).loss
            (loss / n).backward()
            torch.manual_seed(step * n + k)
            expected = reference(**sample).loss
            (expected / n).backward()
            tolerance = {} if step == 0 else dict(rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(loss, expected, **tolerance,
                                       msg=lambda m, s=step, k=k: f"step {s}.{k}: {m}")
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
        plain.step()
        plain.zero_grad(set_to_none=True)
        torch.testing.assert_close(module.last_grad_norm, float(norm), rtol=1e-4, atol=0.0)


def gathered_parameters(module):
    """The fitted model's parameters by name, as ``module.state_dict()`` gives them (streamed
    ones read back from their tier into CPU tensors)."""
    names = {name for name, _ in module.model.named_parameters()}
    return {key: value for key, value in
            ((k.removeprefix("model."), v) for k, v in module.state_dict().items())
            if key in names}


def train_and_match(module, reference, samples, make, tolerance=1e-4):
    """3 steps of the module against its reference (one sample: updates inside backward;
    several: accumulated over them, clipped), then every parameter of the module, streamed
    ones read back, equal to the reference's within ``tolerance`` (absolute and relative)."""
    if len(samples) > 1:
        train_accumulating(module, reference, samples, make)
    else:
        train_side_by_side(module, reference, samples[0], make)
    gathered = gathered_parameters(module)
    for name, q in reference.named_parameters():
        torch.testing.assert_close(gathered[name].to(q.device), q, atol=tolerance,
                                   rtol=tolerance, msg=lambda m, n=name: f"{n}: {m}")


def load_states_and_match(first, second, states, sample, steps=2):
    """Load ``states`` (stage -> its optimizer's ``state_dict()``, from ``first``) into
    ``second``'s owned optimizer, then train both ``steps`` steps from the same seeds: the
    losses must be equal, bit for bit (a resumed run goes on as the uninterrupted one)."""
    for i, state in states.items():
        second.optimizer.load_stage_state(i, state)
    for _ in range(steps):
        torch.manual_seed(1)
        expected = first(**sample).loss
        expected.backward()
        torch.manual_seed(1)
        loss = second(**sample).loss
        loss.backward()
        torch.testing.assert_close(loss, expected, rtol=0.0, atol=0.0)
