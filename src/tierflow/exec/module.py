"""The drop-in that ``tierflow.fit`` returns: called like the model, it runs the plan's forward
operations; ``backward()`` on its loss runs the rest (and the owned optimizer's updates)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch import nn

from ..chain.base import Chain
from ..core.errors import TierflowError
from ..plan.measured import Measured
from ..plan.ops import TRANSFERS, Collective, Load, Reduce, Stash
from ..plan.plan import Plan
from ..plan.reductions import Reductions
from ..plan.tape_schedule import TAPE
from ..plan.tier_costs import UpdatePass, with_update_pass
from ..plan.transfers import Transfers
from .boundaries import BoundaryStash
from .collectives import Collectives
from .context import AutocastMode
from .deferred import DeferredUpdates
from .function import RunPlan
from .memory import HostRoom
from .optimizer import OwnedOptimizer
from .runner import Ledger, StepHooks, StepRun
from .stage_call import context_tensors, forward_plain, storage_key
from .tapes import TapeOffload
from .trace import span
from .transfers import transfer_to
from .weights import WeightStreamer


@dataclass(frozen=True)
class Executors:
    """What runs a plan besides its chain: the caller's autocast mode and the compute
    device, what ``fit`` said (``log``), and, each optional, the optimizer tierflow owns,
    the streamer of the weights that live below, the updates deferred to a pass after the
    backward (and that pass's prediction), the tapes offloaded below, the guard of the host
    RAM budget and the checkpoints stashed below."""

    autocast: AutocastMode
    device: torch.device
    log: list[str]
    optimizer: OwnedOptimizer | None = None
    streamer: WeightStreamer | None = None
    deferred: DeferredUpdates | None = None
    update_pass: UpdatePass | None = None
    tapes: TapeOffload | None = None
    host_room: HostRoom | None = None
    boundaries: BoundaryStash | None = None


class TierflowModule(nn.Module):
    """A drop-in for the fitted model: call it like the model, call ``backward()`` on its loss.

    ``parameters()`` are the original model's. With ``optimizer=`` given to ``fit``, each
    stage's parameters are updated inside ``backward()`` as soon as their gradients are
    complete, and the gradients are freed (there is then nothing left to step).
    """

    # what fit measured before it planned, when it owns the optimizer (plan/measured.py):
    # planned again under the same budgets, it makes this plan
    measured: Measured | None = None

    def __init__(self, model: nn.Module, chain: Chain, plan: Plan, executors: Executors):
        super().__init__()
        self.model = model
        self._chain = chain
        self._plan = plan
        self._executors = executors
        self._autocast = executors.autocast
        self._device = executors.device
        self._optimizer = optimizer = executors.optimizer
        self._streamer = streamer = executors.streamer
        self._deferred = executors.deferred
        self._tapes = executors.tapes
        self._host_room = executors.host_room
        self._boundaries = executors.boundaries
        self._update_pass = executors.update_pass
        self._adopt(plan)
        # per stage, the blocks malloc's scattered free pieces cannot serve: its largest
        # parameter's gradient and the largest tensor it allocates (the LM head's chunk of
        # logits), each one block
        self._largest_blocks = [max((p.nbytes for p in stage.parameters()), default=0)
                                + cost.largest_block
                                for stage, cost in zip(chain.stages, plan.costs.stages)]
        self._cold = True  # nothing read yet: the next step first runs the plan's cold routine
        self._transfer = transfer_to(streamer, optimizer, self._tapes,  # starts a transfer op
                                     self._boundaries,
                                     self._deferred.stash if self._deferred else None,
                                     self._run_collective)
        self._anchor = torch.empty(0, requires_grad=True)  # makes the output require grad
        self.ledger = Ledger({storage_key(p) for p in model.parameters()})
        self.fit_log = executors.log
        # data parallelism: what runs the plan's Reduce and Gather ops (run_collectives_with)
        self._collectives: Collectives | None = None

    def _adopt(self, plan: Plan) -> None:
        """Run ``plan`` from now on: what the module reads from its op positions."""
        self._plan = plan
        host_room = self._host_room
        self._growth = plan.simulation.growth() if host_room is not None else []
        self._largest_growth = max(self._growth, default=0)  # no stage adds more in eval
        # per op, the tapes read back right before it (see tape_reads), once per plan
        self._tape_reads = [tape_reads(plan.ops, position) for position in
                            range(len(plan.ops))] if host_room is not None else []
        self._forward_count = len(plan.forward_ops)

    @property
    def plan(self) -> Plan:
        """The plan this module runs: its ops, predicted peak and time (``explain()``)."""
        return self._plan

    @property
    def chain(self) -> Chain:
        """The model cut into stages, as the plan runs them."""
        return self._chain

    @property
    def optimizer(self) -> OwnedOptimizer | None:
        """The per-stage optimizers tierflow owns (None when the caller steps its own)."""
        return self._optimizer

    def with_plan(self, plan: Plan) -> "TierflowModule":
        """The same model run by another plan (e.g. one loaded with ``Plan.from_json``)."""
        if plan.costs.length != len(self._chain):
            raise TierflowError(f"the plan has {plan.costs.length} stages but the model's chain "
                                f"has {len(self._chain)}: make the plan for this model")
        if plan.costs.optimizer_owned != (self._optimizer is not None):
            raise TierflowError("the plan and this module disagree on who owns the optimizer: "
                                "fit with the same optimizer= the plan was made with")
        if plan.costs.extra.get("streamed stages", []) != self._plan.costs.extra.get(
                "streamed stages", []):
            raise TierflowError("the plan streams other stages' weights than this module: fit "
                                "with the same budgets and disk= the plan was made with")
        if self._boundaries is None and any(isinstance(op, Stash) for op in plan.ops):
            raise TierflowError("the plan stashes checkpoints on a lower tier but this module "
                                "has none: fit with the same budgets and disk= the plan was "
                                "made with")
        host_room = None
        if self._host_room is not None:  # the RSS the new plan predicts, the same guard
            old, new = (with_update_pass(p.predicted_peak, self._update_pass)
                        for p in (self._plan, plan))
            host_room = self._host_room.moved(new - old)
        if plan.transfers is None and self._plan.transfers is not None:
            # a plan of compute ops alone (e.g. rotor's): this module's weights and states
            # move as its own plan's do, placed among the new ops
            plan = plan.with_transfers(self._plan.transfers)
        ours = self._plan.transfers.reductions if self._plan.transfers else None
        if ours is not None and (plan.transfers is None or plan.transfers.reductions is None):
            plan = plan.with_transfers(replace(plan.transfers or Transfers(), reductions=ours))
        if self._streamer is not None:  # the new plan's transfers start from nothing read
            self._streamer.drop_fetched()
        if self._deferred is not None:
            self._deferred.routines = plan.routines
        module = TierflowModule(self.model, self._chain, plan,
                                replace(self._executors, host_room=host_room))
        module._collectives = self._collectives
        return module

    def run_collectives_with(self, collectives: Collectives, reductions: Reductions) -> None:
        """Data parallelism over ``reductions.ranks`` workers: the plan gains a ``Reduce`` op
        right after each backward of a stage with trainable parameters and, when each rank
        steps only its shard (not ``reductions.all_reduce``), a ``Gather`` of each such stage
        for after the optimizer's step (``plan/reductions.py``), all priced on the network;
        running them calls ``collectives``. The stages come in the same order on every
        worker, last stage first, whatever each worker's plan."""
        moves = self._plan.transfers or Transfers()
        self._adopt(self._plan.with_transfers(replace(moves, reductions=reductions)))
        if self._deferred is not None:
            self._deferred.routines = self._plan.routines
        self._collectives = collectives

    def reduce_gradients_with(self, reduce: Callable[[list[torch.Tensor]], None],
                              reductions: Reductions,
                              exchange: Callable[[list[float], str], list[list[float]]]
                              | None = None) -> None:
        """Data parallelism with an optimizer tierflow owns (``fit(optimizer=...)``): once a
        stage's gradients are complete for the step (its ``Reduce`` op in the last
        micro-batch, right after its backward, before the clipping norm, the disk tier or
        the update see them), ``reduce`` gets them and must replace each in place by its
        mean over the workers, as DDP's all-reduce does
        (``tierflow.distributed.World.average``; ``reductions`` says over how many and at
        what bandwidth, for the plan's price). Every worker then updates its own copy of
        the weights and states the same way. ``exchange(values, what)`` runs the plan's
        Exchange ops (``World.all_gather``): needed when ``reductions.exchanged`` names
        any."""
        if self._optimizer is None:
            raise TierflowError("reduce_gradients_with is for an optimizer tierflow owns "
                                "(fit(optimizer=...)): with your own, average the gradients "
                                "after backward() as DDP does")
        if not reductions.all_reduce:
            raise TierflowError("reduce_gradients_with averages whole gradients on every "
                                "worker: give it Reductions(..., all_reduce=True)")
        if reductions.exchanged and exchange is None:
            raise TierflowError(f"the plan exchanges {', '.join(reductions.exchanged)} between "
                                "the workers: give reduce_gradients_with an exchange "
                                "(tierflow.distributed.World.all_gather)")
        self.run_collectives_with(_Averaging(self, reduce, exchange), reductions)

    def gather_parameters(self) -> None:
        """After the optimizer's step under ZeRO-2: the plan's gathers, each all-gathering a
        stage's updated shards onto every worker, in stage order; returns once all
        arrived. Nothing for a plan without them."""
        for op in self._plan.routines.gathers:
            self._transfer(op)
        if self._plan.routines.gathers:
            with span("wait for gathers", "compute"):
                self._collectives.wait_gathered()

    def exchange(self, what: str, values: list[float]) -> list[list[float]]:
        """Run the plan's Exchange of ``what`` (``plan/reductions.py``): every rank's
        ``values``, by rank. Each rank calls it at the same point of its step."""
        op = next((op for op in self._plan.routines.exchanges if op.what == what), None)
        if op is None:
            planned = [op.what for op in self._plan.routines.exchanges]
            raise TierflowError(f"the plan exchanges no {what!r} between the ranks (it "
                                f"exchanges: {', '.join(planned) or 'nothing'}): name it in "
                                "the Reductions' exchanged values")
        with span(str(op), op.resource):
            return self._collectives.exchange(values, what)

    def _run_collective(self, op: Collective) -> None:
        """The plan's Reduce(i) or Gather(i), handed to the collectives."""
        if self._collectives is None:
            raise TierflowError(f"the plan has a collective between ranks ({op}) but nothing "
                                "runs them: call run_collectives_with first")
        with span(str(op), op.resource):
            if isinstance(op, Reduce):
                self._collectives.reduce_stage(op.stage)
            else:
                self._collectives.gather_stage(op.stage)

    @property
    def update_pass(self) -> UpdatePass | None:
        """The predicted update pass after the backward (None: updates run inside it)."""
        return self._update_pass

    def explain(self) -> str:
        """The plan in words: what is kept, recomputed, streamed or offloaded, and why."""
        return self._plan.explain()

    def make_room(self, nbytes: int) -> None:
        """Call before work outside the plan that allocates up to ``nbytes`` on the host (the
        step of an optimizer you run yourself, whose bytes you gave ``fit`` as ``reserve``):
        malloc's cached free memory goes back to the system if the RSS plus ``nbytes`` would
        pass the plan's predicted peak. Large temporaries do not reuse that cache, so it
        would stay resident beside them. A no-op without a RAM budget."""
        if self._host_room is not None:
            self._host_room.make_room(nbytes, fresh=True)

    def abandon_step(self) -> None:
        """Forget a step that raised (a GPU out-of-memory error) before any stage was
        updated, so that it can run again from its first micro-batch: no gradient, no tape or
        weight fetched ahead, no micro-batch counted. A step in which some stage was updated
        (``optimizer.updates`` grew) cannot run again: its weights changed."""
        for p in self.model.parameters():
            p.grad = None
        if self._deferred is not None:
            self._deferred.forget_step()
        if self._tapes is not None:
            self._tapes.forget_all()
        if self._boundaries is not None:
            self._boundaries.reset()
        if self._streamer is not None:
            self._streamer.drop_fetched()
        self._cold = True

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm (before clipping) of the last step's updates, when
        tierflow owns the optimizer (None before the first update or without one)."""
        if self._deferred is not None:
            return self._deferred.last_norm
        return self._optimizer.last_norm if self._optimizer is not None else None

    @property
    def boundaries(self) -> BoundaryStash | None:
        """The checkpoints that wait on a lower tier between uses (None: the plan has none)."""
        return self._boundaries

    @property
    def streamer(self) -> WeightStreamer | None:
        """The stage weights living on a lower tier (None when every weight is resident)."""
        return self._streamer

    def settle(self) -> None:
        """Wait until no transfer is in flight: the weights read ahead for the next step and
        written back after their update, the optimizer states written back. A step returns
        with some of them still running; call this before removing or copying the disk
        directory."""
        if self._streamer is not None:
            self._streamer.settle()
        if self._optimizer is not None:
            self._optimizer.wait()

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """``nn.Module.state_dict`` (the model's entries under ``model.``), with the current
        values of streamed weights: between uses their parameters are empty, so each is read
        back from its tier (after the writes in flight) into a fresh CPU tensor. All of them
        are then in memory at once. Save a trained model with
        ``model.save_pretrained(dir, state_dict={k.removeprefix("model."): v for k, v in
        module.state_dict().items()})``, not from the model's own (empty) parameters."""
        state = super().state_dict(*args, **kwargs)
        if self._streamer is None:
            return state
        self._streamer.settle()
        offloaded = self._streamer.offloaded
        for name, value in state.items():
            if isinstance(value, torch.Tensor) and value in offloaded:
                state[name] = offloaded.current_copy(value)
        return state

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        streamer = self._streamer
        if self._cold:
            for op in self._plan.routines.cold:
                self._transfer(op)
            self._cold = False
        if not torch.is_grad_enabled():
            return self._evaluate(args, kwargs)
        update = self._optimizer.step_update if self._optimizer is not None else None
        deferred = self._deferred
        if deferred is not None:
            update = deferred.gradients_complete
        hooks = StepHooks(update, self.ledger, streamer,
                          before_backward=deferred.before_backward if deferred else None,
                          backward_done=deferred.backward_done if deferred
                          else self._backward_done,
                          tapes=self._tapes,
                          before_op=self._make_room if self._host_room else None,
                          boundaries=self._boundaries, transfer=self._transfer)
        run = StepRun(self._chain, self._plan.ops, self._forward_count, self._device, hooks)
        run.begin()
        x0, ctx, autocast = self._split_inputs(args, kwargs)
        run.inputs(ctx, autocast)
        if self._tapes is not None:
            self._tapes.context = {storage_key(t) for t in context_tensors(ctx)}
        y = RunPlan.apply(run, x0, self._anchor)
        return self._chain.wrap_output(y, ctx)

    def _split_inputs(self, args: tuple, kwargs: dict) -> tuple[Any, dict, AutocastMode]:
        """The chain's input and its step context, under the caller's autocast mode. Splitting
        may run the first stage's modules (the HF adapter's embedding): its weights first."""
        if self._streamer is not None and 0 in self._streamer.stage_params:
            self._streamer.wait_loaded(0)
        autocast = AutocastMode.capture(self._device.type)
        with autocast():  # without the weight-cast cache, as every stage runs
            x0, ctx = self._chain.split_inputs(*args, **kwargs)
        return x0, ctx, autocast

    def _backward_done(self) -> None:
        """After a step's backward (updates inside it): the host's updates finished, then
        the reads the next step starts with."""
        if self._optimizer is not None:
            self._optimizer.wait_host_updates()
            self._optimizer.release_buffers()
        for op in self._plan.routines.between:
            self._transfer(op)

    def _make_room(self, position: int) -> None:
        op = self._plan.ops[position]
        streamed = self._streamer.stage_params if self._streamer is not None else {}
        # a streamed stage's weights and gradients come as large fresh allocations
        stage = getattr(op, "stage", None)
        fresh = stage in streamed
        largest = self._largest_blocks[stage] if stage is not None else 0
        largest += self._tape_reads[position]
        self._host_room.make_room(self._growth[position], fresh=fresh, largest=largest)

    def _evaluate(self, args: tuple, kwargs: dict) -> Any:
        """Evaluation: the plan's evaluation ops, every stage once in order, streamed weights
        moved where the plan says."""
        ops = self._plan.evaluation_ops
        streamer = self._streamer
        position = 0
        while position < len(ops) and isinstance(ops[position], TRANSFERS):
            self._transfer(ops[position])  # what the first stage needs, for the inputs
            position += 1
        x, ctx, autocast = self._split_inputs(args, kwargs)
        for op in ops[position:]:
            if isinstance(op, TRANSFERS):
                self._transfer(op)
                continue
            streamed = streamer is not None and op.stage in streamer.stage_params
            if self._host_room is not None:
                self._host_room.make_room(self._largest_growth, fresh=streamed)
            if streamed:
                streamer.wait_loaded(op.stage)
            x = forward_plain(self._chain.stages[op.stage], x, ctx, autocast)
        return self._chain.wrap_output(x, ctx)


def tape_reads(ops: tuple, position: int) -> int:
    """Bytes of the tapes read back by the transfers placed right before the compute op at
    ``position`` (room is made for it before they start). The tape reader thread allocates
    their buffers in its own malloc arena, where the free blocks the compute thread left (the
    LM head's logits) cannot serve them: as ``HostRoom.make_room``'s ``largest`` blocks they
    count as growth the caches do not absorb. Counted as cache, they let llama-20m LoRA bf16
    (--ram 240MiB, tapes on disk) skip the trim before its last layer's backward in step 1 and
    peak 6 MiB past the plan's prediction (242.6 MiB against 236.3)."""
    nbytes = 0
    for op in reversed(ops[:position]):
        if not isinstance(op, TRANSFERS):
            break
        if isinstance(op, Load) and op.what == TAPE:
            nbytes += op.nbytes
    return nbytes


class _Averaging:
    """Replicas' collectives: a stage's Reduce, in the step's last micro-batch, hands its
    gradients to ``reduce`` (which averages them in place); replicas gather nothing; an
    Exchange goes to ``exchange``."""

    def __init__(self, module: TierflowModule, reduce: Callable[[list[torch.Tensor]], None],
                 exchange: Callable[[list[float], str], list[list[float]]] | None):
        self.module = module
        self.reduce = reduce
        self._exchange = exchange

    def reduce_stage(self, stage: int) -> None:
        deferred = self.module._deferred  # updates inside the backward: one micro-batch a step
        if deferred is not None and deferred.micro != deferred.grad_accum - 1:
            return
        grads = [p.grad for p in self.module.optimizer.stage_params[stage] if p.grad is not None]
        if grads:
            self.reduce(grads)

    def gather_stage(self, stage: int) -> None:
        raise AssertionError(f"replicas gather nothing (stage {stage})")

    def wait_gathered(self) -> None:
        """Nothing was gathered."""

    def exchange(self, values: list[float], what: str) -> list[list[float]]:
        assert self._exchange is not None, "reduce_gradients_with checks it is given"
        return self._exchange(values, what)
