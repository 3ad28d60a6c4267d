"""The LSTM language model: named layers, shapes, sizes, weight tying, loss over real tokens only."""
import pytest
import torch

from mpedu.lm import CONFIGS, LMConfig, LSTMLM, detach_state, nll_sum

V, T, B = 50, 7, 3


def tokens(seed=0, t=T, b=B, vocab=V):
    return torch.randint(3, vocab, (t, b), generator=torch.Generator().manual_seed(seed))


def test_layer_names_in_order():
    model = LSTMLM.from_config("tiny", vocab_size=V)
    assert model.layer_names == ["embed", "lstm0", "lstm1", "decode"]
    assert LSTMLM.from_config("mxnet8", vocab_size=V).layer_names == (
        ["embed"] + [f"lstm{i}" for i in range(8)] + ["decode"])


def test_shapes_through_each_layer():
    cfg = CONFIGS["tiny"]
    model = LSTMLM.from_config("tiny", vocab_size=V)
    x = tokens()
    x, state = model.layers["embed"](x)
    assert x.shape == (T, B, cfg.embed_size) and state is None
    for i in range(cfg.num_layers):
        x, (h, c) = model.layers[f"lstm{i}"](x)
        assert x.shape == (T, B, cfg.hidden_size)
        assert h.shape == c.shape == (1, B, cfg.hidden_size)
    x, state = model.layers["decode"](x)
    assert x.shape == (T, B, V) and state is None


def lstm_params(n_in, h):
    return 4 * h * (n_in + h) + 8 * h  # W_ih, W_hh and two bias vectors of 4 gates


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_config_builds_with_its_sizes(name):
    cfg = CONFIGS[name]
    model = LSTMLM.from_config(name, vocab_size=V)
    assert model.config == cfg
    assert model.layers["embed"].embedding.weight.shape == (V, cfg.embed_size)
    for i in range(cfg.num_layers):
        lstm = model.layers[f"lstm{i}"].lstm
        assert (lstm.input_size, lstm.hidden_size) == (cfg.embed_size if i == 0 else cfg.hidden_size, cfg.hidden_size)
    assert model.layers["decode"].linear.weight.shape == (V, cfg.hidden_size)
    assert model.layers["embed"].drop.p == cfg.dropout


def test_small_parameter_count_matches_the_formula():
    vocab = 10_000
    model = LSTMLM.from_config("small", vocab_size=vocab)
    e = h = 200
    expected = vocab * e + lstm_params(e, h) + lstm_params(h, h) + (h * vocab + vocab)
    assert sum(p.numel() for p in model.parameters()) == expected == 4_653_200  # Zaremba et al.: "4.6M"


def test_init_is_uniform_in_init_scale():
    model = LSTMLM.from_config("medium", vocab_size=V)
    for p in model.parameters():
        assert p.abs().max() <= 0.05


def test_weight_tying_shares_one_parameter():
    model = LSTMLM.from_config("small", vocab_size=V, tie_weights=True)
    assert model.layers["decode"].linear.weight is model.layers["embed"].embedding.weight
    untied = LSTMLM.from_config("small", vocab_size=V)
    assert sum(p.numel() for p in untied.parameters()) - sum(p.numel() for p in model.parameters()) == V * 200


def test_weight_tying_with_mismatched_sizes_is_refused():
    with pytest.raises(ValueError, match="embed_size == hidden_size"):
        LSTMLM.from_config("mxnet8", vocab_size=V, tie_weights=True)  # 200 vs 400


def test_unknown_config_and_tiny_vocab_are_refused():
    with pytest.raises(ValueError, match="unknown model config 'huge'"):
        LSTMLM.from_config("huge", vocab_size=V)
    with pytest.raises(ValueError, match="vocab_size=3"):
        LSTMLM.from_config("tiny", vocab_size=3)


def test_forward_equals_the_layers_composed_by_hand():
    torch.manual_seed(0)
    model = LSTMLM.from_config("tiny", vocab_size=V).eval()
    x = tokens()
    logits, state = model(x)
    layers = model.layers
    e = layers["embed"].embedding(x)
    y0, s0 = layers["lstm0"].lstm(e)
    y1, s1 = layers["lstm1"].lstm(y0)
    by_hand = y1 @ layers["decode"].linear.weight.T + layers["decode"].linear.bias
    torch.testing.assert_close(logits, by_hand)
    torch.testing.assert_close(state["lstm1"][0], s1[0])
    assert state["embed"] is None and state["decode"] is None


def test_state_carries_over_like_one_long_sequence():
    model = LSTMLM.from_config("tiny", vocab_size=V).eval()
    x = tokens(t=10)
    whole, _ = model(x)
    first, state = model(x[:4])
    second, _ = model(x[4:], detach_state(state))
    torch.testing.assert_close(torch.cat([first, second]), whole)


def test_nll_sum_ignores_padding():
    torch.manual_seed(0)
    logits = torch.randn(T, B, V)
    targets = tokens()
    targets[5:, 0] = 0     # column 0 is a short sentence, padded
    targets[3:, 2] = 0
    base = nll_sum(logits, targets)
    changed = logits.clone()
    changed[5:, 0] = torch.randn(T - 5, V) * 100   # garbage where the targets are padding
    changed[3:, 2] = 1e4
    torch.testing.assert_close(nll_sum(changed, targets), base)
    # and a real position does count
    changed[0, 0] += torch.randn(V)
    assert not torch.allclose(nll_sum(changed, targets), base)


def test_nll_sum_is_a_sum_over_real_tokens():
    logits = torch.zeros(T, B, V)                  # uniform: every real token costs log V
    targets = tokens()
    targets[4:, 1] = 0
    real = int((targets != 0).sum())
    torch.testing.assert_close(nll_sum(logits, targets), torch.tensor(real * torch.log(torch.tensor(float(V))).item()))


def test_same_seed_same_model_and_output():
    def build(seed):
        torch.manual_seed(seed)
        return LSTMLM.from_config("tiny", vocab_size=V, dropout=0.3)
    a, b, c = build(1), build(1), build(2)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert not torch.equal(next(a.parameters()), next(c.parameters()))
    torch.manual_seed(5)
    out_a, _ = a(tokens())
    torch.manual_seed(5)
    out_b, _ = b(tokens())
    assert torch.equal(out_a, out_b)  # dropout masks too


def test_config_to_dict_round_trips():
    cfg = CONFIGS["mxnet8"]
    assert LMConfig(**cfg.to_dict()) == cfg
