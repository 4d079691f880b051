"""The thin training layer: GRPOConfig, GRPOTrainer, built-in rewards and the embedded demo.

Importing this package pulls in only the config and rewards; ``GRPOTrainer`` (which needs ``transformers`` and
``tqdm``) is imported on first use.
"""

from .config import GRPOConfig
from .rewards import accuracy_reward, format_reward, graded_answer_reward, make_format_reward


def __getattr__(name: str):
    if name == "GRPOTrainer":
        from .trainer import GRPOTrainer

        return GRPOTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "GRPOConfig",
    "GRPOTrainer",
    "accuracy_reward",
    "format_reward",
    "graded_answer_reward",
    "make_format_reward",
]
