"""The tools around training: the ``poetxq`` command line and what it runs besides training.

* :mod:`~poetxq.tools.cli` — the ``poetxq`` command (``python -m poetxq``; the console script
  :mod:`~poetxq.tools.console` imports it): its sub-commands'
  parsers and error handling; :mod:`~poetxq.tools.cli_train_flags` adds training's flags,
  :mod:`~poetxq.tools.cli_train` runs it, :mod:`~poetxq.tools.cli_tools` adds
  ``estimate-memory``, ``plan``, ``bench`` and ``report``;
  :mod:`~poetxq.tools.cli_common` holds what they share;
* :mod:`~poetxq.tools.estimate_report` — the text of the analytic GPU-memory estimate
  (:mod:`poetxq.training.estimate`, which the trainer's memory plans read too);
* :mod:`~poetxq.tools.bench` and :mod:`~poetxq.tools.profiling` — timed training steps;
* :mod:`~poetxq.tools.report` — tables and plots of finished runs (a run directory read by
  :mod:`~poetxq.tools.run_dir`);
* :mod:`~poetxq.tools.export` — a run as a Hugging Face / bitsandbytes checkpoint (the
  per-layer weights in :mod:`~poetxq.tools.export_weights`).

Tools sit on top: they import :mod:`poetxq.training`, :mod:`poetxq.model` and
:mod:`poetxq.data`, and nothing there imports them.
"""
