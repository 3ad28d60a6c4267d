"""Shared test helpers: a tiny model, a padded time-major batch, made-up costs, a little corpus, quiet training, the
fuzz settings."""
import pytest
import torch
from hypothesis import HealthCheck, settings

VOCAB = 61
# hypothesis settings for the fuzz tests: a few dozen examples, no deadline (a busy machine is slow)
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def make_batch(T=9, B=8, vocab=VOCAB, seed=0, carry_state=False):
    """A (T, B) batch whose columns have different lengths, so padding is exercised."""
    from mpedu.lm import Batch
    g = torch.Generator().manual_seed(seed)
    targets = torch.randint(3, vocab, (T, B), generator=g)
    lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
    lengths[0] = T
    for b in range(B):
        targets[lengths[b]:, b] = 0
    inputs = torch.cat([torch.full((1, B), 2), targets[:-1]])   # <eos> first, then targets shifted
    inputs[targets == 0] = 0
    return Batch(inputs, targets, targets != 0, T, carry_state)


def tiny_model(num_layers=3, seed=0, **overrides):
    from mpedu.lm import LSTMLM
    torch.manual_seed(seed)
    return LSTMLM.from_config("tiny", VOCAB, num_layers=num_layers, **overrides)


# Per-layer cost shapes (seconds per time step per column, and a fixed per-step part), the decoder the heaviest.
WEIGHT = {"embed": 0.2, "lstm0": 1.0, "lstm1": 1.3, "lstm2": 0.9, "decode": 2.0}


def fake_costs(names, T, b, per_call=0.0):
    """Costs of a (T, b) micro-batch shaped like a profile: time a + c b per step (plus `per_call`
    seconds each time a layer runs), bytes per position."""
    from mpedu.predict import Costs
    per = [T * (0.05 + WEIGHT[n] * b) * 1e-3 + per_call for n in names]
    act = [T * b * 400 * (k + 1) for k in range(len(names))]
    return Costs(list(names), forward=per, backward=[2 * x for x in per], backward_input=[x for x in per],
                 backward_weight=[x for x in per], activation_bytes=act,
                 output_bytes=[0 if k == len(names) - 1 else T * b * 128 for k in range(len(names))],
                 param_bytes=[20_000 * (k + 1) for k in range(len(names))], shared_bytes=[0] * len(names),
                 micro_batch=(T, b))


@pytest.fixture(scope="module")
def corpus():
    """The embedded corpus."""
    from mpedu.lm import load_corpus
    return load_corpus()


def first_batch(sentences, batch_size=6):
    """The first batch of `sentences`, unshuffled."""
    from mpedu.lm import BucketIterator
    return next(iter(BucketIterator(sentences, batch_size, shuffle=False)))


@pytest.fixture(scope="module")
def little():
    """A slice of the embedded corpus: 16 batches of (at most) 16 an epoch, so a run takes about a second."""
    from mpedu.lm import Corpus, load_corpus
    corpus = load_corpus()
    return Corpus(corpus.vocab, corpus.train[:200], corpus.valid[:40], corpus.test[:40], name="little")


def lm(corpus, seed=0, **overrides):
    """The tiny config for `corpus`'s vocabulary, initialised from `seed`."""
    from mpedu.lm import LSTMLM
    torch.manual_seed(seed)
    return LSTMLM.from_config("tiny", vocab_size=len(corpus.vocab), **overrides)


def quiet(lines=None, **kw):
    """train() keyword arguments: no progress bars, log lines dropped (or appended to `lines`), plus `kw`."""
    log = (lambda line: None) if lines is None else lines.append
    return dict(progress=False, log=log, **kw)


def reference(model, batch):
    """The single-device model's loss (mean NLL per real token) and gradients {name: grad}; leaves
    the model's .grad zeroed. What every pipeline, stage and device placement must reproduce."""
    from mpedu.lm import nll_sum
    model.zero_grad()
    logits, _ = model(batch.inputs)
    loss = nll_sum(logits, batch.targets) / batch.tokens
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    return loss.item(), grads


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: may run on CUDA GPUs; unmarked tests see only virtual devices")
    config.addinivalue_line("markers", "notebooks: a notebook's cell under nbval (every item of notebooks/*.ipynb)")
    config.addinivalue_line("markers", "torchrun: starts torchrun jobs of 2 or 4 processes (tests/test_distributed.py)")


@pytest.hookimpl(tryfirst=True)         # before -m deselects: `-m "not notebooks"` leaves the course out
def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.notebooks)


@pytest.fixture(autouse=True)
def virtual_unless_cuda(request, monkeypatch):
    """Unmarked tests see no GPU: a device count (`Pipeline(model, 2)`, `get_devices(2)`, the command
    line's --devices) picks CUDA GPUs where the machine has enough, while these tests expect vgpu
    names and hold CPU tolerances. Tests that run GPU placements are marked `cuda`."""
    if request.node.get_closest_marker("cuda") is None:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module: tiny ops gain little from two, and two threads stall
    badly (10x) when other work shares the cores, as on a busy CI machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def batch():
    return make_batch()


@pytest.fixture
def python_handles_ctrl_c():
    """Python's own SIGINT handler (KeyboardInterrupt), as in a terminal or Jupyter. A process started in the
    background by a non-interactive shell (`nohup ./run.sh test &`, some CI runners) inherits SIGINT ignored,
    and Python keeps it ignored: then no Ctrl-C reaches anything, and a Ctrl-C test would fail for that alone."""
    import signal
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture
def drawn_masks(monkeypatch) -> list:
    """Every dropout mask drawn from now on, from any device's thread: (layer, position, mask), in draw order."""
    from mpedu.lm import dropout, keep_mask
    drawn = []

    def recording(p, layer, shape, where, device="cpu"):
        mask = keep_mask(p, layer, shape, where, device)
        drawn.append((layer, where, mask))
        return mask

    monkeypatch.setattr(dropout, "keep_mask", recording)
    return drawn


def train_both(make_model, corpus, pipeline, **train_args):
    """Train a fresh model from make_model() one epoch on one device, then another through
    Pipeline(model, **pipeline), with the same train() arguments: [(history, model) on one device, the same
    through the pipeline], for a test to compare."""
    from mpedu.core import Pipeline, SingleDevice
    from mpedu.training import train
    runs = []
    for pipelined in (False, True):
        model = make_model()
        runner = Pipeline(model, **pipeline) if pipelined else SingleDevice(model)
        try:
            history = train(model, corpus, runner=runner, epochs=1, progress=False, log=lambda *a: None, **train_args)
        finally:
            runner.close()
        runs.append((history, model))
    return runs
