"""Stage: a run of consecutive layers on one device; forward, backward (B) and weight-gradient (W) per micro-batch."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from ..lm import dropout
from ..lm.model import nll_sum
from ..runtime.devices import Device

# A stage's contract with its neighbours, per micro-batch i and time chunk c:
#   forward(i, c, x)          x: (T, b) token ids on stage 0, else (T, b, H) floats
#                             -> (T, b, H) activation for the next stage, or on the
#                                last stage the scaled loss (a scalar)
#   backward(i, c, grad_out)  grad_out: d loss / d output, (T, b, H); None on the last stage
#                             -> d loss / d x for the previous stage (None on stage 0)
# Inputs are detached at the boundary and made leaves that require grad, so each
# stage's backward stops at its own input and runs on its own device's thread.
# Recurrent state (h, c) flows from chunk c to chunk c+1 inside the stage; its
# gradient flows back from chunk c+1's backward to chunk c's (BPTT).


@dataclass
class _Saved:
    """What backward needs from one forward: the graph's ends and its leaves."""

    x: torch.Tensor | None                    # the detached input leaf (None for token ids)
    output: torch.Tensor | None               # activation sent on, or the loss (None until R re-runs a recomputed one)
    # per LSTM layer, by name (a frozen layer's state may want no gradient while a later layer's does):
    state_in: dict[str, tuple] = field(default_factory=dict)     # leaves (h, c): state from chunk c-1
    state_out: dict[str, tuple] = field(default_factory=dict)    # (h, c) handed to chunk c+1
    grads: list | None = None                 # kept by B for W: (outputs, grad_outputs)
    saved_bytes: int = 0                      # activations autograd keeps for backward
    replay: tuple | None = None               # recomputation: (input, state before, targets, scale, dropout Position)


def _keep_nothing(_tensor):
    return None


def _kept_nothing(_):
    raise RuntimeError("a recomputing stage's first forward keeps nothing for backward; R runs it again")


def count_saved(storages: dict[int, int], skip: set[int]):
    """A saved-tensors pack hook that records each storage autograd keeps for backward as
    {address: bytes}, once however many tensors view it, leaving out the addresses in `skip`."""
    def pack(t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in skip:
            storages[ptr] = storage.nbytes()
        # Detached (same storage, no history): an output saved as itself would point back at its
        # own grad_fn, a cycle only backward breaks; a step that fails before its backward would
        # then leak the whole graph (bench/soak.py measured 0.4 MB per failed step).
        return t.detach()
    return pack


def _parameters(module: torch.nn.Module, seen: set | None = None) -> list[torch.nn.Parameter]:
    """`list(module.parameters())`, in its order and without its repeats, read straight from the modules'
    own dicts: a step reads every stage's weights at its start, and the generators of `parameters()`
    cost 20 us a step on a small model, on the step's critical path."""
    seen = set() if seen is None else seen
    out = []
    for p in module._parameters.values():
        if p is not None and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    for child in module._modules.values():
        if child is not None:
            out += _parameters(child, seen)
    return out


def is_recurrent(layer: torch.nn.Module) -> bool:
    """Whether the layer runs a recurrent kernel (nn.LSTM, nn.GRU, nn.RNN), whose backward computes the
    weight gradients whenever it runs, asked for or not (mkldnn on CPU; cuDNN recomputes the data part)."""
    return any(isinstance(m, torch.nn.RNNBase) for m in layer.modules())


class Stage:
    """Layers `names` of a model, run on `device`."""

    def __init__(self, index: int, names: list[str], layers: list[torch.nn.Module], device: Device,
                 is_last: bool):
        self.index = index
        self.names = names
        self.layers = layers
        self.device = device
        self.is_first = index == 0
        self.is_last = is_last
        # (the layers are fixed for the stage's life: a Pipeline refuses a replaced one)
        self._last_recurrent = max((k for k, layer in enumerate(layers) if is_recurrent(layer)), default=-1)
        self._weights_seen = None              # (ids, storages) of the weights last read
        self._read_weights()
        self.saved: dict[tuple[int, int], _Saved] = {}
        self.state: dict[int, dict] = {}        # micro-batch -> per-layer (h, c) after its latest chunk
        self.carry, self.chunks = True, 1       # the step's: keep the final state for the next? time chunks
        self.state_grad: dict[tuple[int, int], dict[str, tuple]] = {}   # (mb, chunk): {layer: (dh, dc)}
        self.nll: dict[tuple[int, int], torch.Tensor] = {}   # last stage: summed NLL per (mb, chunk)
        self._saved_bytes: dict[tuple, int] = {}   # what a kind of forward keeps for backward (see forward)

    def __repr__(self) -> str:
        return f"Stage({self.index}, {','.join(self.names)} on {self.device})"

    def _read_weights(self) -> None:
        """The layers' weights, read again at every step's start (reset): a weight the caller replaced after the
        pipeline was built (a pretrained embedding) is the one forward uses, so backward must ask for its
        gradient, not the old one's. Split backward (zero bubble): the weights of the layers up to the last
        recurrent one get their gradients in B, not W. B runs those layers' backward kernels anyway, and a W
        would walk back through them again to reach the weights below: an LSTM stage's W would cost a second
        full backward."""
        params = [p for layer in self.layers for p in _parameters(layer)]
        # what the step's forwards and backwards read of the weights and the layers, fixed for the step
        self._trained = [p for p in params if p.requires_grad]
        self._flags = (tuple(p.requires_grad for p in params), tuple(m.training for m in self.layers))
        # the same weights, in the same memory, as at the last step: nothing to redo (the ids are of weights
        # self._all_params still holds, so none of them can have been reused by a new one; a tensor's own
        # data_ptr, not its storage's: asking for the storage makes an object per weight, every step)
        seen = ([id(p) for p in params], [p.data_ptr() for p in params])
        if self._weights_seen == seen:
            return
        self._weights_seen = seen
        self._all_params = params
        self._weights_in_b = {id(p) for layer in self.layers[:self._last_recurrent + 1] for p in _parameters(layer)}
        self._param_storages = {p.untyped_storage().data_ptr() for p in params}

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """The weights backward trains: those that require grad at the step's start (reset: a layer frozen or
        thawed after the pipeline was built counts as it is at the step)."""
        return self._trained

    def reset(self, keep_state: bool = False, carry: bool = True, chunks: int = 1) -> None:
        """Forget a step's saved tensors (and, unless carrying it, the recurrent state). For the step to
        come: `chunks` time chunks; `carry`: its final state goes on to the next step (stream mode).
        Without carry only a chunk's state for the next chunk is kept: a step of m micro-batches would
        otherwise keep m x layers x (h, c) tensors only to free them at the next step."""
        self.carry, self.chunks = carry, chunks
        self._read_weights()
        self.saved.clear()
        self.state_grad.clear()
        self.nll.clear()
        if not keep_state:
            self.state.clear()

    # -- forward --------------------------------------------------------------------
    def forward(self, mb: int, chunk: int, x: torch.Tensor, targets: torch.Tensor | None = None,
                scale: float = 1.0, train: bool = True, where: dropout.Position | None = None,
                recompute: bool = False) -> torch.Tensor:
        """Run the layers on one micro-batch; on the last stage return `nll_sum * scale`.

        `where`: the step's dropout Position at this (micro-batch, chunk)'s first column and time
        step, so that its masks are that slice of the one-device masks (mpedu.lm.dropout).
        `recompute`: save nothing for backward but the input (and the recurrent state it started
        from); `recompute_forward` runs the layers again before the backward. The same Position
        draws the same dropout masks again, so the gradients are exact."""
        if not train:
            with torch.no_grad():
                return self._run(mb, chunk, x, targets, scale, train=False)[0]
        if x.is_floating_point():
            x = x.detach().requires_grad_(True)     # boundary: backward stops here
        if recompute:
            before = self.state.get(mb, {})
            # Autograd on, as on one device (an LSTM's kernels without autograd round differently, and R
            # must differentiate the very numbers sent on), but nothing kept: each tensor is dropped as saved.
            with torch.autograd.graph.saved_tensors_hooks(_keep_nothing, _kept_nothing), dropout.at(where):
                out = self._run(mb, chunk, x, targets, scale, train=True)[0].detach()
            kept = x.untyped_storage().nbytes() if x.is_floating_point() else 0    # token ids: the step holds them
            # not `out`: the next stage has it (on a GPU, its own copy), and R makes the output backward starts from
            self.saved[mb, chunk] = _Saved(x if x.is_floating_point() else None, None, saved_bytes=kept,
                                           replay=(x, before, targets, scale, where))
            return out
        # What autograd keeps depends only on the shapes, on whether a state comes in (and wants a gradient),
        # on which weights train, on train/eval mode and on the dropout kind (positional, or torch's own outside
        # a runner's step): counted once per such kind of forward, by saved-tensor hooks, whose Python calls
        # (one per saved tensor, in the backward too, each taking the interpreter lock from the other
        # devices) cost a small stage's action 5-15% (bench/fidelity.py's time chunks).
        kind = (x.shape, None if targets is None else targets.shape, chunk > 0, bool(self.state.get(mb)),
                self._flags, where is None)
        storages: dict[int, int] | None = None if kind in self._saved_bytes else {}
        counting = (contextlib.nullcontext() if storages is None else
                    torch.autograd.graph.saved_tensors_hooks(self._counting_hook(storages, x, targets), lambda t: t))
        with counting, dropout.at(where):
            out, state_in, state_out = self._run(mb, chunk, x, targets, scale, train=True)
        if storages is not None:
            self._saved_bytes[kind] = sum(storages.values())
        self.saved[mb, chunk] = _Saved(x if x.requires_grad else None, out, state_in, state_out,
                                       saved_bytes=self._saved_bytes[kind])
        return out

    def recompute_forward(self, mb: int, chunk: int) -> int:
        """R: run again the forward of a (micro-batch, chunk) that `forward(..., recompute=True)` ran,
        this time keeping what backward needs. Returns the bytes it adds to what the stage holds."""
        saved = self.saved[mb, chunk]
        x, before, targets, scale, where = saved.replay
        storages: dict[int, int] = {}
        with torch.autograd.graph.saved_tensors_hooks(self._counting_hook(storages, x, targets), lambda t: t), \
                dropout.at(where):
            out, state_in, state_out = self._run(mb, chunk, x, targets, scale, train=True, before=before)
        if saved.x is not None:             # the kept input, counted once if the graph saves it too
            storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        self.saved[mb, chunk] = _Saved(saved.x, out, state_in, state_out, saved_bytes=sum(storages.values()))
        return self.saved[mb, chunk].saved_bytes - saved.saved_bytes

    def recomputes(self, mb: int, chunk: int = 0) -> bool:
        """Whether (mb, chunk)'s forward kept only its input, to be recomputed before its backward."""
        saved = self.saved.get((mb, chunk))
        return saved is not None and saved.replay is not None

    def measure(self, x: torch.Tensor, targets: torch.Tensor | None = None):
        """A dry run for the memory estimate: run the layers on one micro-batch from a fresh state,
        store nothing, and return (outputs, [per layer: {storage: bytes} autograd saved for backward],
        [per layer: output bytes], [per layer: bytes of its own input it saves]).

        Each layer is weighed as the first of a stage would be (its input wanting a gradient), as
        `profile` weighs it, whatever the layers before it here: a frozen layer after frozen ones saves
        nothing in this stage but would in another (Costs.stages counts a frozen lead as nothing).
        The outputs (one per layer, the last one the stage's) keep their graphs, so the saved storages
        stay allocated (and their addresses unique) while the caller holds them; detach before passing on.
        """
        per_layer, outputs, input_saved, graphs = [], [], [], []
        for k, layer in enumerate(self.layers):
            if x.is_floating_point():
                x = x.detach().requires_grad_(True)
            storages: dict[int, int] = {}
            inp = x
            with torch.autograd.graph.saved_tensors_hooks(self._counting_hook(storages, x, targets), lambda t: t):
                x, _ = layer(x, None)
                last = self.is_last and k == len(self.layers) - 1
                if last:
                    x = nll_sum(x, targets)
            per_layer.append(storages)
            outputs.append(0 if last else x.numel() * x.element_size())
            input_saved.append(storages.get(inp.untyped_storage().data_ptr(), 0) if inp.is_floating_point() else 0)
            graphs.append(x)
        return graphs, per_layer, outputs, input_saved

    def _counting_hook(self, storages: dict[int, int], x: torch.Tensor, targets: torch.Tensor | None):
        """`count_saved` for this stage. Not counted: weights, and the step's token ids and targets
        (the pipeline holds those for the whole step, cut from one block per batch, so no backward
        frees them)."""
        data = {t.untyped_storage().data_ptr() for t in (x, targets) if t is not None and not t.is_floating_point()}
        return count_saved(storages, self._param_storages | data)

    def saved_bytes(self, mb: int, chunk: int = 0) -> int:
        """Activation bytes held for the backward of (mb, chunk); 0 once it has run."""
        saved = self.saved.get((mb, chunk))
        return saved.saved_bytes if saved is not None else 0

    def _run(self, mb, chunk, x, targets, scale, train, before=None):
        """The layers on one (micro-batch, chunk). `before`: a recomputation, from the state the first
        run started from; it records nothing (the state and the loss are the first run's)."""
        previous = self.state.get(mb, {}) if before is None else before
        keep = before is None and (self.carry or chunk < self.chunks - 1)    # a later chunk or step reads it
        state_in, state_out, new_state = {}, {}, {}
        for name, layer in zip(self.names, self.layers):
            state = previous.get(name)
            if state is not None:
                # chunk > 0: the state is a leaf whose grad goes back to chunk - 1, if anything there wants one
                # (the layer trains, or its input leads back to a weight): a frozen layer on token ids would
                # only keep a graph no backward uses. Carried across steps (stream mode): a leaf without grad.
                wanted = train and chunk > 0 and (x.requires_grad or any(p.requires_grad for p in layer.parameters()))
                state = tuple(t.detach().requires_grad_(wanted) for t in state)
                if wanted:
                    state_in[name] = state
            x, state = layer(x, state)
            if state is not None:
                if keep:
                    new_state[name] = tuple(t.detach() for t in state)
                state_out[name] = state
        if keep:
            self.state[mb] = new_state
        if self.is_last:
            nll = nll_sum(x, targets)
            if before is None:
                self.nll[mb, chunk] = nll.detach()
            x = nll * scale
        return x, state_in, state_out

    # -- backward -------------------------------------------------------------------
    def backward(self, mb: int, chunk: int, grad_out: torch.Tensor | None, weights: bool = True):
        """B: return d loss / d input (None on stage 0). With weights=False, leave the weight
        gradients for a later `backward_weight` (zero-bubble W), but those of the layers up to the
        stage's last recurrent one, which this backward computes anyway."""
        saved = self.saved[mb, chunk]
        outputs, grads = [saved.output], [grad_out]   # grad None: the loss itself (d loss / d loss = 1)
        state_grads = self.state_grad.pop((mb, chunk), None)
        if state_grads is not None:                     # from chunk + 1's backward, layer by layer
            for name, layer_grads in state_grads.items():
                for t, g in zip(saved.state_out[name], layer_grads):
                    if g is not None and t.requires_grad:   # else nothing before it trains
                        outputs.append(t)
                        grads.append(g)
        state_leaves = [t for state in saved.state_in.values() for t in state]
        leaves = ([saved.x] if saved.x is not None else []) + state_leaves
        params = self.params
        if not leaves and not (params and saved.output.requires_grad):
            # Nothing here wants a gradient: frozen layers whose input is token ids (or whose
            # output does not depend on a trainable weight). autograd refuses an empty `inputs`,
            # and there is nothing to compute: hand nothing upstream. (Split B/W: W drops what
            # forward kept, as it would have.)
            if weights:
                del self.saved[mb, chunk]
            return None
        if weights:
            torch.autograd.backward(outputs, grads, inputs=leaves + params)
            leaf_grads = [t.grad for t in leaves]
            del self.saved[mb, chunk]
        else:
            early = [p for p in params if id(p) in self._weights_in_b]
            if early:               # recurrent layers: their weights now, with the input gradient
                torch.autograd.backward(outputs, grads, inputs=leaves + early, retain_graph=True)
                leaf_grads = [t.grad for t in leaves]
                for t in leaves:    # handed on below; the leaves stay until W, their gradients need not
                    t.grad = None
            else:
                leaf_grads = (torch.autograd.grad(outputs, leaves, grads, retain_graph=True, allow_unused=True)
                              if leaves else [])
            saved.grads = [outputs, grads]
            # held for W too: the output's gradient (the next stage's; none on the last, which starts from the loss)
            saved.saved_bytes += sum(g.numel() * g.element_size() for g in grads if g is not None)
        if saved.state_in:                             # hand the state gradient to chunk - 1
            given = iter(leaf_grads[-len(state_leaves):])
            self.state_grad[mb, chunk - 1] = {name: tuple(next(given) for _ in state)
                                              for name, state in saved.state_in.items()}
        return leaf_grads[0] if saved.x is not None else None

    def backward_weight(self, mb: int, chunk: int) -> None:
        """W: accumulate the weight gradients of a micro-batch whose B already ran (those of the layers
        after the stage's last recurrent one; the others came with B)."""
        saved = self.saved.pop((mb, chunk))
        if saved.grads is None:       # B found nothing to differentiate (frozen layers on token ids)
            return
        outputs, grads = saved.grads
        params = [p for p in self.params if id(p) not in self._weights_in_b]    # the rest went in B
        if params and outputs[0].requires_grad:
            torch.autograd.backward(outputs, grads, inputs=params)
