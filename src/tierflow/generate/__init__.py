"""Generation from a checkpoint: ``tierflow generate`` and ``tierflow quantize``.

- ``sample.py``: the sampling loop with a KV cache (``run`` is what ``tierflow generate``
  runs; ``generate`` and ``sample_ids`` are the text- and token-level functions under it);
- ``options.py``: the sampling defaults and the checks of a request, free of torch, so that
  the command line refuses bad input before it imports torch;
- ``memory.py``: what generation holds in RAM with every weight loaded, from the checkpoint's
  headers;
- ``stream.py``: under a ``--ram`` below that, which decoder layers stay in RAM and which
  are read from the checkpoint for every token; ``layer_stream.py`` reads them (an I/O
  thread filling slots ahead of the compute) and ``embedding_rows.py`` reads only the
  embedding rows a forward pass looks up;
- ``quantize.py``: an int8 copy of a checkpoint, one tensor at a time (the ``Int8Linear``
  layer it is loaded into is ``models/int8.py``).

Nothing is imported here: ``options.py`` must stay importable without torch.
"""
