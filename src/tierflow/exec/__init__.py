"""The executor: runs a ``Plan`` on real tensors and derives nothing from it.

``module.py`` is the drop-in ``tierflow.fit`` returns; ``function.py`` makes the step one
autograd node and ``runner.py`` walks the plan's compute ops, holding exactly the values the
plan says. ``transfers.py`` hands each transfer op to what carries it: stage weights
(``weights.py``, ``offload.py``, ``host_model.py``), tapes (``tapes.py``, ``selective.py``,
``recast.py``), checkpoints (``boundaries.py``), gradients (``gradients.py``), optimizer states
and host updates (``optimizer.py``, ``deferred.py``, ``host_update.py``) and collectives
(``collectives.py``). The stores behind them follow one protocol (``storage.py``): host RAM
(``host_store.py``, ``pinned.py``) and disk (``disk.py``, ``file_io.py``, ``buffers.py``); copies
to an accelerator run on side streams (``copy_stream.py``). ``memory.py`` measures what a tier
holds and keeps the RSS under the plan's peak, ``enforce.py`` has the kernel hold the process to
its RAM budget, ``trace.py`` records each op's measured start and end, and ``load.py`` is
``tierflow.load_model``, which builds or loads a model straight onto its disk tier.

Nothing is imported here: each module imports torch as it needs it.
"""
