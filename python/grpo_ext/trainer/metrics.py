"""Metrics of GRPOTrainer: what a step and a rollout log, the JSONL file, TensorBoard, completions, the plot."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from ..results import GroupAdvantages
from . import distributed as dist_utils
from .config import GRPOConfig
from .run_folder import write_text_atomic

# Metrics that depend on the wall clock: they differ between two otherwise identical runs.
TIMING_METRICS = ("step_time", "tokens_per_second")

PLOTTED_METRICS = (
    ("reward", "reward"),
    ("kl", "KL"),
    ("loss", "loss"),
    ("clip_ratio/region_mean", "clip ratio"),
    ("completions/mean_length", "completion length"),
)
# Drawn in the panel of the first metric, with a legend, when logged: the held-out reward beside the training one.
PLOTTED_OVERLAYS = {"reward": ("eval/reward", "held-out (greedy)")}


def read_metrics(path: str | os.PathLike) -> tuple[list[dict[str, Any]], bool]:
    """The rows of a metrics JSONL file, and whether its last line was torn (a kill in mid-write: dropped).

    Raises:
        ValueError: a line other than the last is not JSON (naming the file and the line number).
    """
    lines = Path(path).read_text().splitlines()
    rows, torn = [], False
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            if number == len(lines):
                torn = True
                break
            raise ValueError(f"{path}:{number}: not a JSON line ({err.msg}); fix or delete that line") from None
    return rows, torn


def rollout_metrics(
    total: Tensor,
    rewards: Tensor,
    reward_names: list[str],
    lengths: Tensor,
    truncated: Tensor,
    prompt_lengths: Tensor,
    adv: GroupAdvantages,
    sampling_rounds: int | None,
) -> dict[str, float]:
    """The logged metrics of one global generation batch of ``N`` rows.

    The reward means and stds are taken in float64: finite float32 rewards up to 3.4e38 never log inf (issue 40).

    Args:
        total: ``[N]`` weighted reward sums (float64: a sum of float32 rewards may exceed float32's range).
        rewards: ``[N, K]`` float32 rewards of the K functions (NaN: not scored).
        reward_names: the K functions' names.
        lengths: ``[N]`` float32 completion lengths (tokens in the mask).
        truncated: ``[N]`` bool, no EOS within ``max_completion_length``.
        prompt_lengths: ``[N]`` float32 prompt lengths (tokens in the mask).
        adv: the batch's advantages (group stds, zero-std groups); float64 statistics where a float32 group std
            was beyond float32's range (:meth:`RolloutGenerator.generate_batch`).
        sampling_rounds: dynamic sampling's rounds (None: not logged).
    """
    terminated = lengths[~truncated]
    metrics = {
        "reward": total.double().mean().item(),
        "reward_std": adv.group_std.double().mean().item(),
        "frac_reward_zero_std": adv.zero_std.float().mean().item(),
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": truncated.float().mean().item(),
        "completions/mean_terminated_length": terminated.mean().item() if terminated.numel() else 0.0,
        "num_tokens": prompt_lengths.sum().item() + lengths.sum().item(),
    }
    if sampling_rounds is not None:
        metrics["sampling_rounds"] = float(sampling_rounds)
    for k, name in enumerate(reward_names):
        column = rewards[:, k]
        valid = column[~column.isnan()].double()
        metrics[f"rewards/{name}/mean"] = valid.mean().item() if valid.numel() else math.nan
        metrics[f"rewards/{name}/std"] = valid.std().item() if valid.numel() > 1 else 0.0
    return metrics


class StepMetrics:
    """Sums one optimizer step's loss, entropy and loss-op metrics over its micro-batches, then over the ranks.

    Args:
        per_row_ratios: the op's ratio metrics are shares of rows (weighted by rows); otherwise, and ``kl`` always,
            they are weighted by loss tokens.
        device: where the float64 sums live.
    """

    def __init__(self, per_row_ratios: bool, device: torch.device) -> None:
        self.per_row_ratios = per_row_ratios
        self.metric_sums: dict[str, Tensor] = {}
        self.loss_total = torch.zeros((), dtype=torch.float64, device=device)
        self.entropy_total = torch.zeros((), dtype=torch.float64, device=device)
        self.entropy_count = torch.zeros((), dtype=torch.float64, device=device)

    def add(self, out: Any, entropy: Tensor, rows: int, tokens: int) -> None:
        """Adds one micro-batch.

        Args:
            out: the loss op's output (scalar ``loss``, ``metrics`` of scalar tensors; their ``entropy`` is skipped).
            entropy: 0-dim mean entropy of the micro-batch's tokens entering the loss.
            rows: the micro-batch's rows.
            tokens: the micro-batch's tokens entering the loss.
        """
        self.loss_total += out.loss.detach()
        for name, value in out.metrics.items():
            if name == "entropy":
                continue
            weight = rows if self.per_row_ratios and name != "kl" else tokens
            self.metric_sums[name] = self.metric_sums.get(name, 0.0) + value.double() * weight
        self.entropy_total += entropy.detach().double() * tokens
        self.entropy_count += tokens

    def reduce(self, step_tokens: int, step_rows: int) -> tuple[dict[str, float], float, float]:
        """All-reduces the sums over ranks (a collective: every rank calls it).

        Args:
            step_tokens: the step's loss tokens over all ranks (at least 1).
            step_rows: the step's rows over all ranks.

        Returns:
            The op's metrics per token (per row for ratios with ``per_row_ratios``), the loss summed over ranks, and
            the mean entropy of the tokens entering the loss.
        """
        names = list(self.metric_sums)  # the op's order, the same on every rank
        packed = torch.stack(
            [self.loss_total, self.entropy_total, self.entropy_count, *(self.metric_sums[n] for n in names)]
        )
        packed = dist_utils.all_reduce_sum(packed).tolist()
        metrics = {
            name: value / (step_rows if self.per_row_ratios and name != "kl" else step_tokens)
            for name, value in zip(names, packed[3:], strict=True)
        }
        return metrics, packed[0], packed[1] / max(packed[2], 1.0)


class MetricsLogger:
    """Rank 0's outputs of a run: ``metrics.jsonl``, TensorBoard events, sample completions, ``metrics.png``.

    Args:
        output_dir: the run's folder.
        config: the options (``report_to``, ``num_completions_to_print``).
    """

    def __init__(self, output_dir: Path, config: GRPOConfig) -> None:
        self.config = config
        self.output_dir = output_dir
        self.metrics_path = output_dir / "metrics.jsonl"
        self.plot_path = output_dir / "metrics.png"
        self._tb_writer = None

    def open(self, step: int) -> None:
        """Start (or resume at ``step``): drop lines logged after it, open TensorBoard when asked for."""
        self._truncate_metrics_file(step)
        self._open_tensorboard(step)

    def _open_tensorboard(self, step: int) -> None:
        """A SummaryWriter in ``output_dir/runs`` (events after ``step`` purged) if ``report_to`` asks for it."""
        if self.config.report_to != "tensorboard":
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboard is optional
            return
        self._tb_writer = SummaryWriter(log_dir=str(self.output_dir / "runs"), purge_step=step + 1)

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Append ``metrics`` as a JSON line, and to TensorBoard at ``step`` as ``train/<name>`` (``eval/...`` as is).

        Raises:
            OSError: naming the file when it cannot be written (a full disk: the run stops, the checkpoints stay).
        """
        try:
            with self.metrics_path.open("a") as f:
                f.write(json.dumps(metrics) + "\n")
                f.flush()
                os.fsync(f.fileno())  # on the disk before a later checkpoint is: a power loss keeps the lines it has
        except OSError as err:
            raise OSError(err.errno, f"cannot append step {step} to {self.metrics_path}: {err.strerror}; free some "
                          "space and resume with --resume") from err  # fmt: skip
        if self._tb_writer is not None:
            for name, value in metrics.items():
                if name != "step":
                    self._tb_writer.add_scalar(name if name.startswith("eval/") else f"train/{name}", value, step)

    def logged_after(self, step: int) -> bool:
        """Whether ``metrics.jsonl`` holds lines of steps after ``step`` (a torn last line is none).

        Raises:
            ValueError: a line other than the last is not JSON (see :func:`read_metrics`).
        """
        if not self.metrics_path.exists():
            return False
        rows, _ = read_metrics(self.metrics_path)
        return any(row["step"] > step for row in rows)

    def _truncate_metrics_file(self, step: int) -> None:
        """Drop lines logged after ``step`` (by a run that died after its last checkpoint, or one abandoned by a
        resume from an earlier step: :meth:`.TrainingLoopMixin.train` keeps a copy first), and a torn last line."""
        if not self.metrics_path.exists():
            return
        rows, torn = read_metrics(self.metrics_path)
        kept = [row for row in rows if row["step"] <= step]
        if torn:
            tqdm.write(f"{self.metrics_path}: dropped a torn last line (a run killed while writing it)")
        if torn or len(kept) != len(rows):  # in one rename: a kill or a full disk here loses no line
            write_text_atomic(self.metrics_path, "".join(json.dumps(row) + "\n" for row in kept))

    def print_completions(self, step: int, samples: list[tuple[str, str, float]]) -> None:
        """Print the first ``num_completions_to_print`` of ``(prompt, completion, reward)`` above the progress bar."""
        for prompt, completion, reward in samples[: self.config.num_completions_to_print]:
            tqdm.write(f"[step {step}] {prompt!r} -> {completion!r} (reward {reward:.3f})")

    def close(self) -> None:
        """Close the TensorBoard writer, if open."""
        if self._tb_writer is not None:
            self._tb_writer.close()
            self._tb_writer = None

    def plot(self) -> Path:
        """:func:`plot_metrics` of ``metrics.jsonl`` into ``metrics.png``."""
        return plot_metrics(self.metrics_path, self.plot_path)


def plot_metrics(metrics_path: str | os.PathLike, png_path: str | os.PathLike) -> Path:
    """Plot reward, KL, loss, clip ratio and completion length against step from a metrics JSONL file (the held-out
    ``eval/reward`` too, in the reward panel, when it was logged).

    Returns:
        The PNG's path. A metric never logged (e.g. ``kl`` when ``beta == 0``) gets an empty panel saying so.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, _ = read_metrics(metrics_path)
    fig, axes = plt.subplots(1, len(PLOTTED_METRICS), figsize=(4 * len(PLOTTED_METRICS), 3.2))
    for ax, (key, title) in zip(axes, PLOTTED_METRICS, strict=True):
        points = [(r["step"], r[key]) for r in rows if key in r]
        overlay_key, overlay_label = PLOTTED_OVERLAYS.get(key, (None, None))
        overlay = [(r["step"], r[overlay_key]) for r in rows if overlay_key in r]
        if points:
            steps, values = zip(*points, strict=True)
            ax.plot(steps, values, linewidth=0.8, label="training (sampled)")
        if overlay:
            steps, values = zip(*overlay, strict=True)
            ax.plot(steps, values, marker="o", markersize=3, linewidth=1.2, label=overlay_label)
            ax.legend(fontsize=8)
        if not points and not overlay:
            note = "not computed (beta = 0)" if key == "kl" else "not logged"
            ax.text(0.5, 0.5, note, ha="center", va="center", transform=ax.transAxes)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return Path(png_path)
