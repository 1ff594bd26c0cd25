"""The ``tierflow`` command line, one module per command (torchtune's layout).

``main.py`` builds the parser and runs the command named (``python -m tierflow`` and the
``tierflow`` script); ``args.py`` is what the commands share: the parser whose errors are
one line and the argparse types of sizes and numbers. Each command's module has
``register(sub)``, which adds its parser with every flag's help, and ``run(args)``, which does
the work or calls the package that does: ``tokenize`` (``data/``), ``train`` (its flags and
``--config`` TOML file here, the options' checks in ``train/options.py``, the loop in
``train/``), ``eval`` (the loss of a model on token files, as ``train`` evaluates:
``train/evaluate.py``), ``generate`` and ``quantize`` (``generate/``), ``plot`` (reads a
training log and draws it), ``plan``, ``sweep`` and ``calibrate`` (``sim/``), ``demo``
(tokenize, train, generate and plot on the Python standard library) and ``compare`` (plain
PyTorch against tierflow, measured by ``measure.py``, whose children run as
``python -m tierflow.cli.measure``).

Nothing is imported here: ``main.py`` imports the commands.
"""
