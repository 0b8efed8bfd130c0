"""The training side: from a recipe to a trained run directory.

* option resolution — :mod:`~poetxq.training.recipe` (the recipe schema and every check of how
  its options combine), :mod:`~poetxq.training.recipe_files` (YAML files, composition,
  overrides), :mod:`~poetxq.training.precision` (fp32 / autocast / bf16-true),
  :mod:`~poetxq.training.plan` (every run-level decision resolved once into a ``RunPlan``);
* building — :mod:`~poetxq.training.build` (the model a recipe asks for, on its device),
  :mod:`~poetxq.training.baseline_methods` (a baseline method's model, optimizer and summary);
* the step engine — :mod:`~poetxq.training.optim` (POET AdamW, merges, schedule),
  :mod:`~poetxq.training.loss` (plain or chunked cross-entropy), :mod:`~poetxq.training.lowmem`
  (activation checkpointing and offload, optimizer in backward),
  :mod:`~poetxq.training.cudagraph` and :mod:`~poetxq.training.graph_optim` (the micro-step,
  and the optimizer inside it, replayed from one CUDA graph);
* the loop — :mod:`~poetxq.training.train`, :mod:`~poetxq.training.evaluate`,
  :mod:`~poetxq.training.distributed` (several processes);
* the run directory — :mod:`~poetxq.training.rundir` (naming, locking, the files a run writes),
  :mod:`~poetxq.training.checkpoint` (full training state) and :mod:`~poetxq.training.resume`
  (what ``--resume`` continues).

It uses :mod:`poetxq.model`, :mod:`poetxq.data` and :mod:`poetxq.baselines`; nothing here
imports :mod:`poetxq.tools`.
"""
