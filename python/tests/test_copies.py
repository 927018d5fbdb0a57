"""The adapters' working copies cast once a forward (qmm._copies): in a watched model (patch_bnb watches the models
it patches) one cast launch for every adapter of a forward, made again by the next forward whatever changed the
adapters in between (also writes that move no version counter, as bitsandbytes' optimizers make), never written
over while a backward still needs them, and computing exactly what the ops compute casting their own copies."""
import gc

import pytest
import torch
import torch.utils.checkpoint

import qmm
from qmm import _copies

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and qmm.cuda_device_count() > 0 else [])


def randn(shape, seed, device):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device)


class Layer(torch.nn.Module):
    """A decoder layer's projections as the patched model runs them: q/k/v as one op (stacked adapters), o, and the
    MLP block (gate/up stacked, down apart), NF4 bases, float32 adapters of ranks 4 and 8, bf16 activations; its
    forwards announced to qmm._copies unless `watched` is False."""

    def __init__(self, device, hidden=64, inter=96, watched=True):
        super().__init__()
        q8 = lambda shape, s: qmm.Nf4Weight.quantize(randn(shape, s, device) * 0.3)  # noqa: E731
        self.qkv = [q8((hidden, hidden), 1), q8((32, hidden), 2), q8((32, hidden), 3)]
        self.o, self.gate, self.up, self.down = (q8((hidden, hidden), 4), q8((inter, hidden), 5),
                                                 q8((inter, hidden), 6), q8((hidden, inter), 7))
        shapes = [((4, hidden), (hidden, 4)), ((8, hidden), (32, 8)), ((4, hidden), (32, 4)),
                  ((4, hidden), (hidden, 4)), ((8, hidden), (inter, 8)), ((8, hidden), (inter, 8)),
                  ((4, inter), (hidden, 4))]
        self.params = [(randn(a, 10 + i, device) * 0.2).requires_grad_() for i, (a, _) in enumerate(shapes)] + \
            [(randn(b, 20 + i, device) * 0.2).requires_grad_() for i, (_, b) in enumerate(shapes)]
        if watched:
            _copies.watch(self)

    def lora(self, i, scale=2.0):
        return qmm.Lora(self.params[i], self.params[7 + i], scale)

    def forward(self, x):
        q, k, v = qmm.lora_nf4_linears(x, self.qkv, [self.lora(0), self.lora(1), self.lora(2)])
        h = qmm.lora_nf4_linear(q + torch.cat([k, v], -1), self.o, self.lora(3))
        return qmm.lora_nf4_mlp(h, self.gate, self.up, self.down, self.lora(4), self.lora(5), self.lora(6, 0.5))


def run(layer, x, dy):
    """The layer's output and every gradient (x's and the adapters') for the output gradient dy."""
    for p in layer.params:
        p.grad = None
    xr = x.clone().requires_grad_()
    y = layer(xr)
    y.backward(dy)
    return [y.detach(), xr.grad] + [p.grad for p in layer.params]


def assert_equal(got, want, what):
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"{what}: tensor {i} differs by {(g.float() - w.float()).abs().max().item()}"


@pytest.fixture
def casts(monkeypatch):
    """Counts the cast launches qmm makes from Python (_copies' and each op's own; the grouped ops' casts in C++ are
    skipped for copies _copies made: their sources are the destinations)."""
    seen = []
    real = qmm._qmm.cast

    def counting(*args, **kwargs):
        seen.append(len(args[0]))
        return real(*args, **kwargs)

    monkeypatch.setattr(qmm._qmm, "cast", counting)
    return seen


def uncached(monkeypatch):
    """Switches the cache off: each op casts its own copies, as the compiled ops do."""
    monkeypatch.setattr(_copies, "get", lambda *args: None)


@pytest.mark.parametrize("device", DEVICES)
def test_one_cast_a_forward_reading_the_adapters_as_they_are_then(device, casts, monkeypatch):
    layer = Layer(device)
    x = randn((3, 5, 64), 30, device).to(torch.bfloat16)
    dy = randn((3, 5, 64), 31, device).to(torch.bfloat16)
    run(layer, x, dy)  # the first forward makes each op's entry
    results = []
    for step in range(3):
        with torch.no_grad():  # what an optimizer that writes through raw pointers does: no version counter moves
            for p in layer.params:
                p.data.mul_(0.9).add_(0.01 * (step + 1))
        del casts[:]
        results.append(run(layer, x, dy))
        assert casts == [14], f"step {step}: casts of {casts} matrices, not one cast of all fourteen"
    uncached(monkeypatch)
    again = Layer(device)
    for step, got in enumerate(results):
        with torch.no_grad():
            for p in again.params:
                p.data.mul_(0.9).add_(0.01 * (step + 1))
        assert_equal(got, run(again, x, dy), f"step {step} against each op casting its own copies")


@pytest.mark.parametrize("device", DEVICES)
def test_unwatched_ops_cast_their_own_copies(device, casts, monkeypatch):
    """Ops outside an announced forward (a module no patched model holds, called as it is): each op casts its own
    copies at every call, as the compiled ops do, and reads the adapters as they are then."""
    layer = Layer(device, watched=False)
    x = randn((63, 64), 35, device).to(torch.bfloat16)
    dy = randn((63, 64), 36, device).to(torch.bfloat16)
    got = []
    for step in range(2):
        with torch.no_grad():
            for p in layer.params:
                p.data.mul_(0.5)
        del casts[:]
        got.append(run(layer, x, dy))
        assert casts == [6, 2, 4, 2], casts  # q/k/v, o, gate/up, down
    uncached(monkeypatch)
    ref = Layer(device, watched=False)
    for step in range(2):
        with torch.no_grad():
            for p in ref.params:
                p.data.mul_(0.5)
        assert_equal(got[step], run(ref, x, dy), f"step {step}")


@pytest.mark.skipif(int(torch.__version__.split(".")[0]) < 2,
                    reason="PyTorch 1.x's non-reentrant checkpoint fails an internal assert on saved leaves")
@pytest.mark.parametrize("device", DEVICES)
def test_a_recomputation_under_checkpointing_reads_the_adapters_as_its_forward(device, casts, monkeypatch):
    """Gradient checkpointing recomputes the layer inside the backward, outside an announced forward: its ops cast
    their own copies there; the gradients are those of the forward without checkpointing."""
    class Model(torch.nn.Module):  # as Hugging Face's: the model watched, its layers checkpointed
        def __init__(self):
            super().__init__()
            self.layer = Layer(device, watched=False)
            _copies.watch(self)

        def forward(self, x):
            return torch.utils.checkpoint.checkpoint(self.layer, x, use_reentrant=False)

    model = Model()
    x = randn((2, 7, 64), 37, device).to(torch.bfloat16)
    dy = randn((2, 7, 64), 38, device).to(torch.bfloat16)
    want = run(Layer(device), x, dy)
    model(x)  # the entries exist: the next forward casts them all at once
    del casts[:]
    xr = x.clone().requires_grad_()
    y = model(xr)
    assert casts == [14]
    y.backward(dy)
    assert casts == [14, 6, 2, 4, 2]
    assert_equal([y.detach(), xr.grad] + [p.grad for p in model.layer.params], want, "checkpointed")


@pytest.mark.parametrize("device", DEVICES)
def test_a_backward_reads_the_copies_its_forward_read(device, monkeypatch):
    """Two forwards before their backwards (the second after the adapters changed, as between the forwards of a
    recomputation or of two losses): each backward gives what it gives with nothing between."""
    layer = Layer(device)
    x = randn((7, 64), 40, device).to(torch.bfloat16)
    dy = randn((7, 64), 41, device).to(torch.bfloat16)
    xr1 = x.clone().requires_grad_()
    y1 = layer(xr1)
    with torch.no_grad():
        for p in layer.params:
            p.data.mul_(-1.5)
    xr2 = x.clone().requires_grad_()
    y2 = layer(xr2)
    y1.backward(dy)
    first = [y1.detach(), xr1.grad] + [p.grad.clone() for p in layer.params]
    for p in layer.params:
        p.grad = None
    y2.backward(dy)
    second = [y2.detach(), xr2.grad] + [p.grad for p in layer.params]
    uncached(monkeypatch)
    ref = Layer(device)
    assert_equal(first, run(ref, x, dy), "the first forward's backward")
    with torch.no_grad():
        for p in ref.params:
            p.data.mul_(-1.5)
    assert_equal(second, run(ref, x, dy), "the second forward's backward")


@pytest.mark.parametrize("device", DEVICES)
def test_copies_made_in_inference_mode_are_not_trained_on(device, casts):
    """An evaluation under torch.inference_mode, then a training step: the step casts again (inference tensors
    cannot be saved for a backward) and trains as without the evaluation."""
    layer = Layer(device)
    x = randn((1, 64), 50, device).to(torch.bfloat16)
    dy = randn((1, 64), 51, device).to(torch.bfloat16)
    with torch.inference_mode():
        layer(x)
    want = run(Layer(device), x, dy)
    del casts[:]
    got = run(layer, x, dy)
    assert sum(casts) == 14
    assert_equal(got, want, "trained after an evaluation in inference mode")


@pytest.mark.parametrize("device", DEVICES)
def test_copies_go_with_their_adapters(device):
    gc.collect()  # earlier tests' layers, so that only this one's entries come and go
    before = len(_copies._entries)
    layer = Layer(device)
    x = randn((2, 64), 60, device).to(torch.bfloat16)
    with torch.no_grad():
        layer(x)
    assert len(_copies._entries) == before + 4  # q/k/v, o, gate/up, down
    del layer
    gc.collect()
    assert len(_copies._entries) == before


@pytest.mark.parametrize("device", DEVICES)
def test_adapters_in_the_activations_dtype_are_used_as_they_are(device, casts, monkeypatch):
    """bf16 adapters with bf16 activations: only the stacked ones' a are copied (into a_all), nothing else; results
    as each op computes them alone."""
    layer = Layer(device)
    with torch.no_grad():
        layer.params = [p.detach().to(torch.bfloat16).requires_grad_() for p in layer.params]
    x = randn((65, 64), 70, device).to(torch.bfloat16)
    dy = randn((65, 64), 71, device).to(torch.bfloat16)
    run(layer, x, dy)
    del casts[:]
    got = run(layer, x, dy)
    assert casts == [5]  # q/k/v's three a and gate/up's two
    uncached(monkeypatch)
    ref = Layer(device)
    with torch.no_grad():
        ref.params = [p.detach().to(torch.bfloat16).requires_grad_() for p in ref.params]
    assert_equal(got, run(ref, x, dy), "bf16 adapters")
