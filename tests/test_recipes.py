"""Recipes: each config's paper settings in mpedu's learning-rate convention (loss = mean NLL per token)."""
import pytest

from mpedu.lm import CONFIGS
from mpedu.training import BATCH_SIZE, CLIP, CONFIG, EPOCHS, LR, RECIPES, recipe_for


def test_the_tiny_config_trains_with_mpedus_defaults_and_the_default_config_is_the_laptop_job():
    assert CONFIG == "laptop" and CONFIG in CONFIGS
    tiny = recipe_for("tiny")
    assert (tiny.lr, tiny.epochs, tiny.batch_size, tiny.clip, tiny.bptt, tiny.decay) == (LR, EPOCHS, BATCH_SIZE,
                                                                                        CLIP, None, None)
    laptop = recipe_for(CONFIG)        # bucketed, the halving rule; its own batch, lr, micro-batches and split
    assert (laptop.bptt, laptop.decay, laptop.micro_batches) == (None, None, 8)
    assert laptop.placement == "embed,lstm0,lstm1:vgpu0 | decode:vgpu1"


@pytest.mark.parametrize("name", ["small", "medium", "large"])
def test_zarembas_lr_1_and_clip_are_scaled_by_the_window(name):
    recipe = RECIPES[name]
    clip = 10 if name == "large" else 5               # the papers' clips, for a loss summed over T steps
    assert recipe.lr == pytest.approx(1 * recipe.bptt) and recipe.clip == pytest.approx(clip / recipe.bptt)
    assert recipe.decay is not None and "Zaremba" in recipe.describe()


def test_every_recipe_names_a_config_and_a_config_without_one_gets_the_defaults():
    assert set(RECIPES) <= set(CONFIGS)
    assert recipe_for("no such config") is recipe_for("tiny")
    assert "halved when validation perplexity gains < 1" in recipe_for(CONFIG).describe()
