"""The model side: what a POET-X(Q) model is made of, and how a Llama becomes one.

Reading order, bottom up (each module imports only the ones above it and ``quant_kernels``):

* the recipe's ``model`` and ``poet`` sections — :mod:`~poetxq.model.config`;
* weight formats — :mod:`~poetxq.model.quant` (the frozen ``W0``: int8 row-wise, NF4/FP4
  blockwise, or unquantized);
* orthogonal parameterization — :mod:`~poetxq.model.orthogonal` (one side's Cayley–Neumann
  ``R`` or ``P``), :mod:`~poetxq.model.flat` (many small parameters in one buffer),
  :mod:`~poetxq.model.blockcache` (every layer's ``R``/``P`` blocks in one batched call);
* the POET layer — :mod:`~poetxq.model.store` (the frozen store seen through a layer's policy),
  :mod:`~poetxq.model.swiglu` (the SwiGLU maps), :mod:`~poetxq.model.functions` (every autograd
  Function of the layer), :mod:`~poetxq.model.layout` (the row- and feature-major layouts and
  the choice between them), :mod:`~poetxq.model.layer` (the modules: ``POETXLinear``,
  ``POETXSwiGLUMLP``, ``FrozenLinear``);
  :mod:`~poetxq.model.attention` and :mod:`~poetxq.model.fuse` (compiled RMSNorm / rotary /
  SwiGLU) speed up the rest of the decoder;
* model surgery — :mod:`~poetxq.model.surgery` (build a Llama, swap its linears for POET
  layers), :mod:`~poetxq.model.pretrained` (start from a transformers checkpoint),
  :mod:`~poetxq.model.relayout` (lay the built model's device tensors out end to end).

Nothing here imports :mod:`poetxq.training`, :mod:`poetxq.data` or :mod:`poetxq.tools`.
"""
