"""Integrations of grpo_ext with other training libraries.

Each submodule imports its library when it is imported itself, never from ``import grpo_ext``:

- :mod:`grpo_ext.integrations.trl`: TRL's own ``GRPOTrainer`` with its loss and log-prob passes computed by
  grpo_ext (``GRPOExtTrainer`` or ``patch(trainer)``).
- :mod:`grpo_ext.integrations.verl`: verl 0.9.1's policy-loss and advantage-estimator registries gain ``grpo_ext``,
  ``grpo_ext_grpo`` and ``grpo_ext_rloo`` (loaded by ``import verl`` through the ``verl.plugins`` entry point).
"""
