"""The values people give: train()'s number checks and the command-line types both command lines share."""
import argparse
import json
import math

import pytest

from mpedu.cli import (add_training_options, apply_recipe, count, join_dash_values, json_line,
    non_negative_float, parse_link, parse_memory_cap, positive_float, positive_int)
from mpedu.runtime import check_number, shorten


@pytest.mark.parametrize("value, kw", [(3, dict(integer=True)), (0.5, dict(above=True)), (None, dict(none_ok=True)),
                                       (7, dict(integer=True, minimum=1, maximum=8))])
def test_check_number_returns_a_good_value(value, kw):
    assert check_number("x", value, **kw) == value


@pytest.mark.parametrize("value, kw, words", [
    (2.5, dict(integer=True), "a whole number >= 0"), (True, {}, "a finite number"), (math.nan, {}, "finite"),
    (0, dict(above=True), "> 0"), (8, dict(maximum=8), "< 8"), (None, {}, "expected"), ("3", {}, "'3'")])
def test_check_number_names_the_value_and_what_it_should_be(value, kw, words):
    with pytest.raises(ValueError, match="x=") as error:
        check_number("x", value, **kw)
    assert words in str(error.value)


def test_the_argument_types_accept_good_text_and_explain_bad_text():
    assert (positive_int("3"), count("0"), positive_float("0.5"), non_negative_float("0")) == (3, 0, 0.5, 0.0)
    for parse, text, words in [(positive_int, "0", ">= 1"), (count, "x", "whole number"),
                               (positive_float, "0", "> 0"), (non_negative_float, "inf", "finite"),
                               (parse_memory_cap, "vgpu:0=1MB,vgpu:0=2MB", "twice"),
                               (parse_link, "warp9", "unknown link")]:
        with pytest.raises(argparse.ArgumentTypeError, match=words):
            parse(text)
    assert parse_memory_cap("2MB") == "2MB" and parse_memory_cap("vgpu:0=1kB") == {"vgpu:0": "1kB"}
    assert parse_link("10gbe/100").emulated


def test_the_recipe_fills_what_was_not_given_and_names_what_was():
    parser = argparse.ArgumentParser()
    add_training_options(parser, clip_over="the gradients")
    lines = []
    args = parser.parse_args(["--config", "small", "--lr", "5"])
    recipe = apply_recipe(args, lines.append)
    assert (args.lr, args.epochs, args.clip) == (5, recipe.epochs, recipe.clip) and args.given == {"lr"}
    assert "given: --lr 5" in lines[0]
    assert any("stream mode" in line for line in lines)    # this parser has no --bptt: the recipe's is dropped


def test_json_line_writes_non_finite_figures_as_null():
    line = json_line({"ppl": math.inf, "nested": [math.nan, 1.5], "ok": 2})
    assert json.loads(line) == {"ppl": None, "nested": [None, 1.5], "ok": 2}


def test_a_dash_value_is_joined_to_its_option_and_long_text_is_shortened():
    parser = argparse.ArgumentParser()
    parser.add_argument("--memory-cap")
    parser.add_argument("--json", action="store_true")
    assert join_dash_values(parser, ["--memory-cap", "-5MB", "--json"]) == ["--memory-cap=-5MB", "--json"]
    assert join_dash_values(parser, ["--memory-cap", "--json"]) == ["--memory-cap", "--json"]
    assert shorten("x" * 10) == "x" * 10 and shorten("x" * 100).endswith("(100 characters)")
