"""The command-line options and argument types shared by `python -m mpedu` and `python -m mpedu.distributed`
(each error names the value and what is expected; the number checks themselves are mpedu.runtime.values')."""
from __future__ import annotations

import argparse
import json
import math

from ..lm.model import CONFIGS
from ..runtime.link import LINKS, Link, format_bandwidth, format_seconds
from ..runtime.values import shorten
from ..training.recipes import CONFIG, recipe_for

# ---------------------------------------------------------------- the command lines

def folder(text: str) -> str:
    """An --out folder: not empty (which would write into the current folder without a word)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} names no folder; give one, e.g. runs/mine, or . for the "
                                         "current folder")
    return text


def _whole(text: str, minimum: int, maximum: int = 2**63) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not minimum <= value < maximum:
        raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}"
                                         + (f" and < {maximum}" if maximum < 2**63 else "") + f", got {text}")
    return value


def positive_int(text: str) -> int:
    return _whole(text, 1)


def micro_batch_option(text: str) -> int | list[int]:
    """--micro-batches: a count (4: equal micro-batches) or the sentences of each, "8,16,24,16" (unequal; they add
    up to --batch-size, which the command checks)."""
    if "," not in text:
        return positive_int(text)
    parts = [part.strip() for part in text.split(",")]
    try:
        return [_whole(part, 1) for part in parts]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a count such as 4, or sentences per micro-batch such as "
                                         f"8,16,24,16 (whole numbers >= 1), got {text!r}") from None


def count(text: str) -> int:
    return _whole(text, 0)


def _number(text: str, minimum: float, strict: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value < minimum or (strict and value == minimum):
        raise argparse.ArgumentTypeError(f"expected a finite number {'>' if strict else '>='} {minimum:g}, got {text}")
    return value


def positive_float(text: str) -> float:
    return _number(text, 0.0, strict=True)


def non_negative_float(text: str) -> float:
    return _number(text, 0.0, strict=False)


def parse_memory_cap(text: str):
    """'2MB' for every device, or 'vgpu:0=2MB,vgpu:1=4MB' per device; sizes checked by parse_size."""
    from ..runtime.values import parse_size
    try:
        if "=" not in text:
            parse_size(text)
            return text
        caps = {}
        for item in text.split(","):
            device, _, size = item.partition("=")
            if not device.strip():
                raise ValueError(f"{shorten(item)!r} names no device; write DEVICE=SIZE, e.g. vgpu:0=2MB")
            parse_size(size)
            if device.strip() in caps:
                raise ValueError(f"--memory-cap gives {shorten(device.strip())} twice ({caps[device.strip()]} and "
                                 f"{size}); give each device one cap")
            caps[device.strip()] = size
        return caps
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_link(text: str):
    """A Link from --link text (a preset, PRESET/FACTOR, or LATENCY,BANDWIDTH), checked by Link.parse."""
    try:
        return Link.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def link_help() -> str:
    presets = ", ".join(f"{name} ({format_seconds(k.latency_s)}, {format_bandwidth(k.bandwidth_Bps)})"
                        for name, k in LINKS.items())
    return ("emulate the interconnect between virtual devices for real: a transfer of n bytes reaches the "
            f"other device latency + n / bandwidth after it is sent (the receiver waits). Presets: {presets}; "
            "shared is the default and adds no delay. PRESET/FACTOR is a link FACTOR times slower (latency x "
            "FACTOR, bandwidth / FACTOR): a CPU core computes these layers about 100x slower than a GPU, so "
            "10gbe/100 gives virtual devices the compute-to-communication ratio of GPUs on 10 Gb Ethernet. "
            "Or LATENCY,BANDWIDTH, e.g. 5ms,10MB/s. Virtual devices only: GPUs copy for real")


def add_training_options(parser: argparse.ArgumentParser, clip_over: str, resume: bool = True,
                         config: str = CONFIG) -> None:
    """The options every `train` command takes (here and under torchrun), with the same checks.
    `resume`: the command has --resume (its --lr help says what a given lr does then); `config`: the
    default --config."""
    parser.add_argument("--data", metavar="DIR", help="folder with ptb.train.txt, ptb.valid.txt and ptb.test.txt "
                        "(default: the embedded synthetic corpus)")
    # --epochs, --batch-size, --lr and --clip default to None: the --config's recipe fills them
    # (apply_recipe), so that what the user gave can be told apart and wins.
    default = recipe_for(config)
    parser.add_argument("--config", choices=list(CONFIGS), default=config,
                        help=f"model size, and the recipe it is trained with (default: {config})")
    parser.add_argument("--epochs", type=positive_int, help=f"default: the recipe's ({config}: {default.epochs})")
    parser.add_argument("--batch-size", type=positive_int, metavar="B",
                        help=f"sentences (or stream columns) per batch (default: the recipe's; {config}: "
                             f"{default.batch_size})")
    parser.add_argument("--lr", type=positive_float,
                        help=f"SGD learning rate for a loss that is the mean NLL per token (a paper's lr for a "
                             f"loss summed over T time steps is about lr x T here); decayed by the recipe's rule "
                             f"(default: the recipe's; {config}: {default.lr:g}, halved when validation "
                             f"perplexity gains < 1)"
                             + (". Given on --resume and unlike the run's first lr, it replaces the checkpoint's"
                                if resume else ""))
    parser.add_argument("--clip", type=non_negative_float,
                        help=f"norm clip over {clip_over}, 0 for none (default: the recipe's; {config}: "
                             f"{default.clip:g})")
    parser.add_argument("--seed", type=count, default=0,
                        help="fixes the run: initialisation, data order and dropout masks, which depend on "
                             "(seed, step, layer, position) only, so every placement and schedule draws the "
                             "same (default: 0)")
    parser.add_argument("--skip-bad-batches", action="store_true",
                        help="skip a batch whose loss or gradient is NaN or inf (counted in the summary) instead "
                             "of stopping")


def apply_recipe(args, log=print):
    """Fill the training options the user did not give from the --config's recipe; return the recipe.

    Prints which recipe is used and which of its values the user's options replaced. For a
    parser without --bptt (torchrun: stream mode is not offered there) the recipe's bptt is dropped."""
    recipe = recipe_for(args.config)
    names = {"epochs": "epochs", "batch_size": "batch-size", "lr": "lr", "clip": "clip", "bptt": "bptt"}
    given = []
    args.given = {key for key in names if getattr(args, key, None) is not None}
    for key, flag in names.items():
        if not hasattr(args, key):
            continue
        if getattr(args, key) is None:
            setattr(args, key, getattr(recipe, key))
        elif getattr(args, key) != getattr(recipe, key) and not (key == "bptt" and args.bptt == 0 and not recipe.bptt):
            given.append(f"--{flag} {getattr(args, key):g}")
    if hasattr(args, "bptt"):
        args.bptt = args.bptt or None             # --bptt 0: bucketed sentences
    log(f"recipe {args.config!r}: {recipe.describe()}" + (f"; given: {', '.join(given)}" if given else ""))
    if recipe.bptt and not hasattr(args, "bptt"):
        log(f"note: the recipe's stream mode (bptt {recipe.bptt}) is not offered here; batches are bucketed "
            "sentences, so its lr may need lowering")
    return recipe


def _finite_or_null(value):
    """JSON has no inf or NaN: a figure that is not finite is written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(v) for v in value]
    return value


def json_line(summary: dict) -> str:
    """The --json summary: strict JSON (non-finite figures are null)."""
    return json.dumps(_finite_or_null(summary), allow_nan=False)


def join_dash_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`--memory-cap -5MB` -> `--memory-cap=-5MB`: argparse takes a word that starts with '-' (and is not
    a plain negative number) for an option, and says "expected one argument"; joined, the option's
    own check names the bad value."""
    takes_value = {flag for action in _all_actions(parser) if action.option_strings and action.nargs is None
                   for flag in action.option_strings}
    joined, i = [], 0
    while i < len(argv):
        word = argv[i]
        if word in takes_value and i + 1 < len(argv) and argv[i + 1][:1] == "-" and argv[i + 1][1:2] not in ("", "-") \
                and argv[i + 1] not in takes_value:
            joined.append(f"{word}={argv[i + 1]}")
            i += 2
        else:
            joined.append(word)
            i += 1
    return joined


def _all_actions(parser):
    for action in parser._actions:
        yield action
        for sub in getattr(action, "choices", None) or {}:
            if isinstance(action.choices, dict) and isinstance(action.choices[sub], argparse.ArgumentParser):
                yield from _all_actions(action.choices[sub])
