"""Glue between training frameworks and :class:`trainhealth.Monitor`.

One module per framework, each imported only by the jobs that use it (this package itself
imports nothing, so ``import collectors`` stays standard library + redis-py):

- :mod:`trainhealth.collectors.integrations.torch` — ``global_grad_norm``, ``grad_norm_value`` (needs torch).
- :mod:`trainhealth.collectors.integrations.hf` — ``TrainHealthCallback`` for ``transformers.Trainer``.
- :mod:`trainhealth.collectors.integrations.lightning` — ``TrainHealthCallback`` for ``lightning.pytorch.Trainer``.

Install the framework with the matching extra: ``pip install 'trainhealth[torch]'``,
``'trainhealth[hf]'`` or ``'trainhealth[lightning]'``. The callbacks run on **every** rank,
as the Monitor must; their hooks never raise into training.
"""

from __future__ import annotations

__all__: list[str] = []
