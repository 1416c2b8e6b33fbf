"""The ``multihead`` subcommands: one module each (``textbook``, ``inspect``, ``generate``,
``train``, ``compare``, ``convert``, ``prune``, ``export``), listed in ``multihead.cli``.

Each has ``add_arguments(parser)`` (its description and flags) and ``run(args) -> int``,
which checks everything inside ``checking.checking()`` before its work starts. The other
modules are what the commands share: ``checking`` (the user's mistakes and bugs told
apart), ``imports`` (``--import MODULE``), ``paths`` (files read and folders written),
``tokens`` and ``run_dir`` (texts and run directories), ``gpt_inputs``,
``encoder_inputs``, ``prune_hf``, ``recovery_option``, ``head_scores`` and ``parity``. What a library user would want
lives in the library (``multihead.tools``, ``multihead.hf``, ``multihead.train``).
"""
