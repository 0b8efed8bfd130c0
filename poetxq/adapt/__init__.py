"""Forward-only MLP adaptation (FPO; Patil, Dennis et al., arXiv 2608.14563).

A pretrained Llama-family model is adapted by updating the MLP matrices of a few target layers
from a signal computed at the output, without back-propagation through the layer stack:

* :mod:`~poetxq.adapt.signal` — the output error ``e = softmax(z) − onehot(y)``, the residual-
  stream signal ``g = e · W_lm`` and its closed-form vector–Jacobian product through the final
  RMSNorm, ``g̃``;
* :mod:`~poetxq.adapt.fpo` — forward hooks that cache each target MLP's input and its gate / up
  activations, the per-layer pseudo-gradients of ``down_proj`` (W3), ``gate_proj`` (W1) and
  ``up_proj`` (W2), and :class:`~poetxq.adapt.fpo.FPOAdapter`, the update step (fp32 masters,
  AdamW or SGD with momentum, relative clipping);
* :mod:`~poetxq.adapt.diagnose` — the per-layer cosine between pseudo-gradient and autograd
  gradient on a calibration batch, the suggested target layers and a starting learning rate;
* :mod:`~poetxq.adapt.loop` — the adaptation loop: batches, evaluation, resumable state, the
  adapted model saved for transformers;
* :mod:`~poetxq.adapt.lowbit` — every non-target linear frozen in our int8 / NF4 / FP4 stores;
* :mod:`~poetxq.adapt.reference` — SFT-partial and full fine-tuning through the same update.

``docs/FPO.md`` gives the method, the choices where the paper is not explicit, and results.

Imports :mod:`poetxq.model`, :mod:`poetxq.data` and :mod:`poetxq.training`; only
:mod:`poetxq.tools` imports this package.
"""
