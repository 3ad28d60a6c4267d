"""measure_cores: how many virtual devices' worth of work the machine does at once, from the model's own work or not."""
import pytest

from conftest import make_batch, tiny_model
from mpedu.predict import measure_cores


def test_measure_cores_reports_how_many_workers_run_at_once():
    cores = measure_cores(2, repeats=1)
    assert 0 < cores <= 2
    with pytest.raises(ValueError, match="n >= 2"):
        measure_cores(1)


def test_measure_cores_can_run_the_models_own_work():
    model = tiny_model(num_layers=1)
    assert 0 < measure_cores(2, repeats=1, model=model, batch=make_batch()) <= 2
    assert all(p.grad is None for p in model.parameters()), "the workers must train copies, not the model"


def test_each_worker_runs_its_own_share_of_the_layers_and_more_workers_than_layers_get_copies():
    from mpedu.predict.cores import _model_shares
    model, batch = tiny_model(num_layers=1), make_batch()          # embed, lstm0, decode
    calls = []
    for name in model.layer_names:
        model.layers[name].register_forward_hook(lambda m, i, o, name=name: calls.append(name))
    jobs = _model_shares(model, batch, 2)
    calls.clear()
    for job in jobs:
        job()
    assert calls == ["embed", "lstm0", "decode"], "two shares, in order, each layer once"
    assert all(p.grad is None for p in model.parameters())
    jobs = _model_shares(model, batch, 5)                           # 3 shares, then 2 repeated on a second copy
    calls.clear()
    for job in jobs:
        job()
    assert calls == ["embed", "lstm0", "decode", "embed", "lstm0"]
