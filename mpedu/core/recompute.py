"""Activation recomputation: which stages re-run their forward in the backward, and for which micro-batches."""
from __future__ import annotations

from typing import Mapping

# Activation recomputation, per stage (torchgpipe's `checkpoint` modes, GPipe paper section 2.3):
#   None            keep what autograd saves, from the forward to the backward (no extra time)
#   "all"           keep only the stage's input; the backward first runs the forward again
#                   (an "R" box before the B) to rebuild what it needs, then frees it
#   "all-but-last"  "all", except the last micro-batch (torchgpipe's default). torchgpipe's backward
#                   runs the micro-batches in reverse, so the last one's backward follows its forward
#                   at once and re-running it would save nothing. mpedu's GPipe runs them in forward
#                   order (B0 first): there the last micro-batch's activations stay for the whole
#                   backward phase, so this mode saves less than "all" (bench/recompute.py measures it)
MODES = (None, "all", "all-but-last")


def recompute_modes(recompute, num_stages: int) -> list[str | None]:
    """One mode per stage from None, a mode for every stage, or {stage index: mode} (others keep)."""
    if recompute is None or isinstance(recompute, str):
        check_mode(recompute, "recompute")
        return [recompute] * num_stages
    if isinstance(recompute, Mapping):
        modes: list[str | None] = [None] * num_stages
        for stage, mode in recompute.items():
            if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < num_stages:
                raise ValueError(f"recompute names stage {stage!r}, but the pipeline has stages 0..{num_stages - 1}; "
                                 "name those (--recompute 0=all,1=none; in Python {stage index: mode})")
            check_mode(mode, f"recompute[{stage}]")
            modes[stage] = mode
        return modes
    if isinstance(recompute, (list, tuple)) and len(recompute) == num_stages:
        for s, mode in enumerate(recompute):
            check_mode(mode, f"recompute[{s}]")
        return list(recompute)
    raise ValueError(f"recompute={recompute!r}: give None, 'all', 'all-but-last', or a dict {{stage: mode}}")


def parse_recompute(text: str):
    """--recompute text: "none", "all", "all-but-last", or per stage "0=all,2=all-but-last"."""
    text = text.strip()
    if "=" not in text:
        mode = None if text == "none" else text
        check_mode(mode, "--recompute")
        return mode
    modes = {}
    for item in text.split(","):
        stage, _, mode = (part.strip() for part in item.partition("="))
        if not stage.isdigit():
            raise ValueError(f"--recompute {item!r}: write STAGE=MODE with a stage number, e.g. 0=all")
        if int(stage) in modes:
            raise ValueError(f"--recompute {text!r} gives stage {int(stage)} twice; give each stage once")
        modes[int(stage)] = None if mode == "none" else mode
        check_mode(modes[int(stage)], f"--recompute stage {stage}")
    return modes


def check_mode(mode, what: str) -> None:
    if mode not in MODES:
        raise ValueError(f"{what}={mode!r} is not a recomputation mode; choose none (keep activations; None in "
                         "Python), all (recompute every micro-batch) or all-but-last")


def recomputes(mode: str | None, mb: int, micro_batches: int) -> bool:
    """Whether micro-batch `mb` of a stage in this mode re-runs its forward during its backward."""
    return mode == "all" or (mode == "all-but-last" and mb != micro_batches - 1)


def recompute_table(modes: list[str | None], micro_batches: int) -> dict[bool, list[list[bool]]]:
    """{training: per stage, per micro-batch, whether its forward is re-run in the backward}: what every step
    reads on its critical path, worked out once. Evaluation (False) keeps nothing, so re-runs nothing."""
    return {True: [[recomputes(mode, i, micro_batches) for i in range(micro_batches)] for mode in modes],
            False: [[False] * micro_batches for _ in modes]}


def describe_modes(modes: list[str | None]) -> str:
    """A runner's repr of its per-stage modes: "" for none, ", recompute='all'" for one, else by stage."""
    kinds = set(modes)
    if kinds == {None}:
        return ""
    if len(kinds) == 1:
        return f", recompute={modes[0]!r}"
    return f", recompute={ {s: m for s, m in enumerate(modes) if m} }"
