"""The command line, `python -m mpedu train | corpus`: its options (shared with mpedu.distributed) and
commands. Imports the layers below (runtime ... course)."""
from .commands import main
from .options import (add_training_options, apply_recipe, count, join_dash_values, json_line, non_negative_float,
                      parse_link, parse_memory_cap, positive_float, positive_int)

__all__ = [
    "add_training_options", "apply_recipe", "count", "join_dash_values", "json_line", "main",
    "non_negative_float", "parse_link", "parse_memory_cap", "positive_float", "positive_int",
]
