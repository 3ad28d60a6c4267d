"""History: what a run records per epoch, as JSON, and its summary."""
import json
import math

import pytest

from conftest import lm, quiet
from mpedu.training import History, perplexity, train


pytestmark = pytest.mark.usefixtures("one_thread")   # see conftest.one_thread


# ---------------------------------------------------------------- records

def test_history_is_json_and_complete(little):
    history = train(lm(little), little, epochs=2, batch_size=16, **quiet())
    back = History.from_dict(json.loads(history.to_json()))
    assert back == history
    assert set(history.epochs[0]) >= {"epoch", "lr", "train_ppl", "valid_ppl", "tokens_per_s", "seconds"}
    assert history.epochs[1]["epoch"] == 2 and history.test_ppl > 1
    assert history.epochs[0]["tokens"] == little.tokens("train")  # every token once an epoch
    assert history.summary()["bubble_fraction"] is None           # no timelines on one device


def test_perplexity_is_exp_of_the_mean_nll_and_inf_once_that_overflows():
    assert perplexity(2 * math.log(5.0), 2) == pytest.approx(5.0)
    assert perplexity(1e6, 1) == math.inf


def test_the_summary_weighs_every_step_the_same():
    epoch = dict(lr=1.0, train_ppl=9.0, valid_ppl=8.0, tokens=100, seconds=2.0, train_seconds=1.0)
    history = History([dict(epoch, epoch=1, steps=1, bubble_fraction=0.5),
                       dict(epoch, epoch=2, steps=3, bubble_fraction=0.1, skipped_batches=2)], test_ppl=7.0)
    summary = history.summary()
    assert summary["bubble_fraction"] == pytest.approx((0.5 * 1 + 0.1 * 3) / 4)
    assert (summary["steps"], summary["skipped_batches"], summary["tokens_per_s"]) == (4, 2, 100.0)
    assert History().summary() == {"epochs": 0, "test_ppl": None}
