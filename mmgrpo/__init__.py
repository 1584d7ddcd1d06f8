"""mmgrpo: GRPO reinforcement learning for multimodal models.

The shared core: :mod:`mmgrpo.grpo` (pure tensor math), :mod:`mmgrpo.trainer` (the loop), :mod:`mmgrpo.config`,
:mod:`mmgrpo.registry`. Pipelines live in :mod:`mmgrpo.pipelines`, rewards in :mod:`mmgrpo.rewards`.
"""

__version__ = "0.1.0"
