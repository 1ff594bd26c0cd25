"""What is measured before planning, and every probe of the machine.

``profiler.py`` measures each distinct stage of a chain once (times, bytes kept for
backward, transients; ``tensor_ledger.py`` counts the host's tensor bytes op by op and
``head_chunk.py`` sizes the fused LM head's chunks before it runs); ``optimizer_probe.py``
measures what an optimizer keeps and costs; ``machine.py`` probes the machine (native bf16,
matmul peak, memcpy, disk, AdamW and bus rates, peak RSS) and ``layer_probe.py`` splits a
decoder layer's time for ``tierflow calibrate``.

Nothing is imported here.
"""
