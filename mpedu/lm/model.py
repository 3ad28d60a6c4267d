"""The LSTM language model as an ordered list of named layers: embed, lstm0 … lstmN-1, decode."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from .dropout import PositionalDropout

# Every layer has one interface:  (x, state) -> (y, new_state)
#   embed   (T, B) int64        -> (T, B, E)   state: None
#   lstm_l  (T, B, in)          -> (T, B, H)   state: (h, c), each (1, B, H)
#   decode  (T, B, H)           -> (T, B, V)   state: None
# so any run of consecutive layers can become a pipeline stage (like picotron's
# identity modules, a stage never needs to know which layers it holds).


@dataclass(frozen=True)
class LMConfig:
    """Sizes of an LSTM language model. `num_layers` counts LSTM layers only."""

    embed_size: int
    hidden_size: int
    num_layers: int
    dropout: float = 0.0
    init_scale: float = 0.1      # weights start uniform in [-init_scale, init_scale]
    tie_weights: bool = False    # decode.weight is embed.weight (needs embed_size == hidden_size)

    def to_dict(self) -> dict:
        return asdict(self)


# Zaremba et al. (2014) small / medium / large; MXNet's model-parallel example (mxnet8); laptop: the command
# line's main job, `small`'s sizes trained on bucketed sentences (mpedu.training.recipes says why).
CONFIGS: dict[str, LMConfig] = {
    "tiny": LMConfig(embed_size=32, hidden_size=64, num_layers=2, dropout=0.0),
    "small": LMConfig(embed_size=200, hidden_size=200, num_layers=2, dropout=0.0),
    "laptop": LMConfig(embed_size=200, hidden_size=200, num_layers=2, dropout=0.0),
    "medium": LMConfig(embed_size=650, hidden_size=650, num_layers=2, dropout=0.5, init_scale=0.05),
    "large": LMConfig(embed_size=1500, hidden_size=1500, num_layers=2, dropout=0.65, init_scale=0.04),
    "mxnet8": LMConfig(embed_size=200, hidden_size=400, num_layers=8, dropout=0.5),
}


class Embed(nn.Module):
    """Token ids -> vectors, then dropout (positional: see mpedu.lm.dropout)."""

    def __init__(self, vocab_size: int, embed_size: int, dropout: float):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embed_size)
        self.drop = PositionalDropout(dropout, layer=0)

    def forward(self, tokens, state=None):  # (T, B) -> (T, B, E)
        return self.drop(self.embedding(tokens)), None


class LSTMLayer(nn.Module):
    """One LSTM layer over the whole sequence, then dropout. State (h, c) is (1, B, H) each."""

    def __init__(self, input_size: int, hidden_size: int, dropout: float, index: int = 0):
        super().__init__()
        self.lstm = nn.LSTM(input_size, hidden_size)  # time-major: (T, B, in)
        self.drop = PositionalDropout(dropout, layer=index + 1)   # lstm_l draws mask l + 1 (embed: 0)

    def forward(self, x, state=None):  # (T, B, in) -> (T, B, H)
        y, new_state = self.lstm(x, state)
        return self.drop(y), new_state


class Decode(nn.Module):
    """Hidden vectors -> logits over the vocabulary."""

    def __init__(self, hidden_size: int, vocab_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, vocab_size)

    def forward(self, x, state=None):  # (T, B, H) -> (T, B, V)
        return self.linear(x), None


class LSTMLM(nn.Module):
    """A stacked LSTM language model whose layers are addressed by name.

    `model.layers` is an ordered ModuleDict (`embed`, `lstm0`, …, `decode`); these
    are the names a Placement maps to devices (MXNet's group2ctx groups).
    """

    def __init__(self, vocab_size: int, config: LMConfig):
        super().__init__()
        if config.tie_weights and config.embed_size != config.hidden_size:
            raise ValueError(
                f"tie_weights needs embed_size == hidden_size, got {config.embed_size} and "
                f"{config.hidden_size}; set both to the same value or tie_weights=False")
        self.vocab_size = vocab_size
        self.config = config
        layers: dict[str, nn.Module] = {"embed": Embed(vocab_size, config.embed_size, config.dropout)}
        for i in range(config.num_layers):
            in_size = config.embed_size if i == 0 else config.hidden_size
            layers[f"lstm{i}"] = LSTMLayer(in_size, config.hidden_size, config.dropout, index=i)
        layers["decode"] = Decode(config.hidden_size, vocab_size)
        self.layers = nn.ModuleDict(layers)
        self.reset_parameters()
        if config.tie_weights:
            # One Parameter used by two layers: its gradient is the sum of both uses.
            # A pipeline must then keep embed and decode on the same device.
            self.layers["decode"].linear.weight = self.layers["embed"].embedding.weight

    @classmethod
    def from_config(cls, name: str, vocab_size: int, **overrides) -> "LSTMLM":
        """Build a named config (`tiny`, `small`, `laptop`, `medium`, `large`, `mxnet8`), optionally overriding fields."""
        if name not in CONFIGS:
            raise ValueError(f"unknown model config {name!r}; choose one of {', '.join(CONFIGS)}")
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
            raise TypeError(f"vocab_size must be a whole number, got {type(vocab_size).__name__}; give "
                            "len(corpus.vocab)")
        if vocab_size < 4:
            raise ValueError(f"vocab_size={vocab_size} is too small: the vocabulary holds at least <pad>, <unk>, <eos> and one word")
        return cls(vocab_size, replace(CONFIGS[name], **overrides))

    def reset_parameters(self) -> None:
        s = self.config.init_scale
        for p in self.parameters():
            nn.init.uniform_(p, -s, s)

    @property
    def layer_names(self) -> list[str]:
        return list(self.layers.keys())

    def forward(self, tokens: torch.Tensor, state: dict | None = None):
        """tokens (T, B) -> logits (T, B, V) and the new per-layer state dict."""
        state = state or {}
        x, new_state = tokens, {}
        for name, layer in self.layers.items():
            x, new_state[name] = layer(x, state.get(name))
        return x, new_state


def nll_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed negative log-likelihood over real tokens; padding (id 0) never counts.

    logits (T, B, V), targets (T, B). Summing (not averaging) lets micro-batch losses
    add up exactly to the batch loss once each is divided by the batch's token count.
    """
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=0, reduction="sum")


def detach_state(state):
    """Cut the graph at a batch boundary (stream mode carries state, not its history)."""
    if state is None:
        return None
    if isinstance(state, torch.Tensor):
        return state.detach()
    if isinstance(state, dict):
        return {k: detach_state(v) for k, v in state.items()}
    return tuple(detach_state(s) for s in state)
