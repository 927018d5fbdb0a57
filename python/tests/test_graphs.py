"""qmm.graph_step: a whole training step replayed as one CUDA graph. On the CPU it must be the step itself; on a GPU
its replays must train exactly as the eager step does (the same kernels on the same inputs: the same bits)."""
import collections

import pytest
import torch

import qmm
from qmm import _copies

HAS_GPU = torch.cuda.is_available() and qmm.cuda_device_count() > 0
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")


def randn(shape, seed, device):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device)


def qlora_mlp(device, hidden=64, inter=96):
    """A QLoRA SwiGLU block on NF4 weights with nonzero adapters (B = 0 would leave A's gradient zero), the same
    on every call."""
    torch.manual_seed(0)  # the adapters' A
    weights = [qmm.Nf4Weight.quantize(randn(shape, s, device) * 0.2)
               for s, shape in ((1, (inter, hidden)), (2, (inter, hidden)), (3, (hidden, inter)))]
    mlp = qmm.QLoraSwiGluMlp(*weights, rank=4, alpha=8.0)
    with torch.no_grad():
        for i, ad in enumerate((mlp.gate_lora, mlp.up_lora, mlp.down.lora)):
            ad.lora_b.copy_(randn(ad.lora_b.shape, 10 + i, device) * 0.1)
    return mlp


def trainer(device, fused=False, watched=False):
    """A fresh block, its optimizer and its training step (forward, backward, AdamW, gradients cleared): AdamW
    capturable on a GPU (a capture needs that), fused (PyTorch's one-kernel AdamW, transformers' Trainer's default) or
    not. watched: the block's forwards announced to qmm (as patch_bnb's models announce theirs: its adapters'
    working copies then come from one cast a forward, qmm._copies) and run in bf16."""
    mlp = qlora_mlp(device)
    dtype = torch.bfloat16 if watched else torch.float32
    if watched:
        _copies.watch(mlp)
    fused_arg = dict(fused=True) if fused else {}  # (older PyTorch has no fused AdamW)
    opt = torch.optim.AdamW(mlp.parameters(), lr=1e-2, capturable=device == "cuda", **fused_arg)

    def step(x, target):
        loss = torch.nn.functional.mse_loss(mlp(x.to(dtype)).float(), target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return mlp, step


def batches(device, n, tokens=33):
    return [(randn((tokens, 64), 100 + i, device), randn((tokens, 64), 200 + i, device)) for i in range(n)]


def test_graph_step_on_the_cpu_is_the_step_itself():
    mlp_a, step_a = trainer("cpu")
    mlp_b, step_b = trainer("cpu")
    graphed = qmm.graph_step(step_b, warmup=1)
    for x, target in batches("cpu", 4):
        assert torch.equal(graphed(x, target), step_a(x, target))
    assert graphed.captured == 0
    assert all(torch.equal(a, b) for a, b in zip(mlp_a.parameters(), mlp_b.parameters()))


def test_graph_step_outputs_come_without_history_in_their_containers():
    """Whatever the step returns comes back detached, in the same containers (a named tuple, a list, a dict
    subclass: an OrderedDict standing in for transformers' ModelOutput), other values as they are."""
    Pair = collections.namedtuple("Pair", "loss count")
    w = torch.ones(3, requires_grad=True)

    def step(x):
        loss = (w * x).sum()
        return Pair(loss, 3), [loss * 2, "text"], collections.OrderedDict(loss=loss, none=None)

    pair, items, mapping = qmm.graph_step(step)(torch.ones(3))
    assert type(pair) is Pair and pair.count == 3 and pair.loss.item() == 3.0 and not pair.loss.requires_grad
    assert type(items) is list and items[1] == "text" and items[0].item() == 6.0 and items[0].grad_fn is None
    assert type(mapping) is collections.OrderedDict and list(mapping) == ["loss", "none"]
    assert mapping["loss"].grad_fn is None and mapping["none"] is None


@pytest.mark.parametrize("bad,fragment", [(None, "callable"), ("step", "callable")])
def test_graph_step_refuses_what_is_not_a_step(bad, fragment):
    with pytest.raises(qmm.Error) as e:
        qmm.graph_step(bad)
    assert e.value.code == "InvalidArgument" and fragment in str(e.value)


@pytest.mark.parametrize("warmup", [0, -1, 1.5, True, "2"])
def test_graph_step_refuses_a_bad_warmup(warmup):
    with pytest.raises(qmm.Error) as e:
        qmm.graph_step(lambda x: x, warmup=warmup)
    assert e.value.code == "InvalidArgument" and "warmup" in str(e.value)


def test_graph_step_inputs_must_be_tensors():
    calls = []
    graphed = qmm.graph_step(lambda *a: calls.append(a))
    with pytest.raises(qmm.Error) as e:
        graphed(torch.zeros(2), 3.0)
    assert e.value.code == "InvalidArgument" and "input 1 is a float" in str(e.value)
    assert calls == []  # refused before the step ran
    with pytest.raises(qmm.Error) as e:
        graphed(torch.zeros(2), torch.zeros(2, device="meta"))
    assert e.value.code == "InvalidArgument" and "different devices" in str(e.value)
    assert calls == []


@needs_gpu
@pytest.mark.parametrize("fused, watched", [(False, False), (True, False), (False, True)])
def test_graph_step_trains_as_the_eager_step_bit_for_bit(fused, watched):
    """Ten steps on changing batches: the replayed step's losses and trained weights equal the eager step's (AdamW
    capturable, or fused). Two warm-up calls run eagerly, the third captures (and replays) the graph. Watched, the
    captured step casts the adapters' working copies once, inside the graph: every replay casts them again from the
    weights the previous replay's AdamW wrote."""
    mlp_e, step_e = trainer("cuda", fused, watched)
    mlp_g, step_g = trainer("cuda", fused, watched)
    graphed = qmm.graph_step(step_g, warmup=2)
    for i, (x, target) in enumerate(batches("cuda", 10)):
        want = step_e(x, target).item()
        got = graphed(x, target)
        assert got.item() == want, f"step {i}"
    assert graphed.captured == 1
    for e, g in zip(mlp_e.parameters(), mlp_g.parameters()):
        assert torch.equal(e, g)


@needs_gpu
def test_graph_step_after_an_eager_step_on_the_default_stream():
    """A training loop whose first step ran eagerly on PyTorch's default stream (to build the optimizer's state, say),
    its loss still referenced while graph_step warms up: that loss holds the step's gradient accumulators, tied to
    the default stream, into the warm-up; the warm-up's returned loss must not carry them into the capture. The
    outputs come back without autograd history, and training matches the eager loop bit for bit."""
    mlp_e, step_e = trainer("cuda")
    mlp_g, step_g = trainer("cuda")
    graphed = qmm.graph_step(step_g, warmup=1)
    data = batches("cuda", 5)
    loss = step_g(*data[0])
    assert step_e(*data[0]).item() == loss.item()
    for i, (x, target) in enumerate(data[1:]):
        want = step_e(x, target).item()
        loss = graphed(x, target)
        assert loss.grad_fn is None and not loss.requires_grad
        assert loss.item() == want, f"step {i + 1}"
    assert graphed.captured == 1
    for e, g in zip(mlp_e.parameters(), mlp_g.parameters()):
        assert torch.equal(e, g)


@needs_gpu
def test_graph_step_captures_once_per_input_shape():
    _, step = trainer("cuda")
    graphed = qmm.graph_step(step, warmup=1)
    for tokens in (33, 33, 7, 33, 7, 7):
        loss = graphed(*batches("cuda", 1, tokens)[0])
        assert torch.isfinite(loss)
    assert graphed.captured == 2


@needs_gpu
def test_graph_step_that_synchronizes_is_refused_by_name():
    _, step = trainer("cuda")

    def step_with_item(x, target):
        loss = step(x, target)
        print(loss.item())  # a host sync: not capturable
        return loss

    graphed = qmm.graph_step(step_with_item, warmup=1)
    x, target = batches("cuda", 1)[0]
    graphed(x, target)
    with pytest.raises(qmm.Error) as e:
        graphed(x, target)
    assert e.value.code == "Unsupported" and "could not be captured" in str(e.value)


@needs_gpu
def test_qmm_op_first_seen_inside_a_capture():
    """The first qmm call on a stream makes qmm's context for it; inside torch.cuda.graph (global capture mode) that
    must not break the capture, and the replay computes what the eager call does."""
    w4 = qmm.Nf4Weight.quantize(randn((256, 512), 1, "cuda"))
    a = randn((65, 512), 2, "cuda").to(torch.bfloat16)
    want = qmm.nf4_gemm(a, w4)
    out = torch.full_like(want, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.Stream()):  # a stream qmm has never seen
        qmm.nf4_gemm(a, w4, out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


@needs_gpu
def test_a_capture_of_ones_own_casts_each_ops_copies_inside():
    """A watched block captured with torch.cuda.graph by hand (not graph_step): qmm caches no working copies for
    that capture, each op casts its own inside it, so that a replay reads the adapters as they are then (here after
    an eager forward left copies behind and the adapters changed)."""
    mlp = qlora_mlp("cuda")
    _copies.watch(mlp)
    x = randn((33, 64), 5, "cuda").to(torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):  # warm-up on the capture's stream
        mlp(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph, stream=side):
        out = mlp(x)
    with torch.no_grad():
        for p in mlp.parameters():
            p.data.mul_(-0.5)
        want = mlp(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


@pytest.mark.parametrize("pieces", [0, -2, 2.0, True, "3"])
def test_graph_step_refuses_bad_pieces(pieces):
    with pytest.raises(qmm.Error) as e:
        qmm.graph_step(lambda x: x, pieces=pieces)
    assert e.value.code == "InvalidArgument" and "pieces" in str(e.value)


@pytest.mark.parametrize("calls, pieces, cuts", [(0, 3, []), (1, 3, []), (2, 2, [1]), (40, 1, []), (40, 3, [2, 20]),
                                                 (40, 4, [2, 20]), (1000, 4, [7, 62, 500]), (10, 5, [5])])
def test_graph_step_cuts_each_graph_about_eight_times_the_one_before(calls, pieces, cuts):
    from qmm import graphs
    assert graphs._cut_points(calls, pieces) == cuts


def stacked_trainer(device, blocks=8):
    """A stack of QLoRA blocks (qmm calls enough to cut its forward's capture), its AdamW and training step."""
    torch.manual_seed(0)
    mlps = torch.nn.Sequential(*[qlora_mlp(device) for _ in range(blocks)])
    opt = torch.optim.AdamW(mlps.parameters(), lr=1e-2, capturable=device == "cuda")

    def step(x, target):
        loss = torch.nn.functional.mse_loss(mlps(x), target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return mlps, step


@needs_gpu
def test_graph_step_in_pieces_trains_as_the_eager_step_bit_for_bit():
    """pieces=3: the captured step is three graphs of one memory pool, cut in its forward, replayed in turn; ten
    steps train exactly as the eager step does."""
    mlps_e, step_e = stacked_trainer("cuda")
    mlps_g, step_g = stacked_trainer("cuda")
    graphed = qmm.graph_step(step_g, warmup=2, pieces=3)
    for i, (x, target) in enumerate(batches("cuda", 10)):
        want = step_e(x, target).item()
        assert graphed(x, target).item() == want, f"step {i}"
    assert graphed.captured == 1 and graphed.graphs == [3]
    for e, g in zip(mlps_e.parameters(), mlps_g.parameters()):
        assert torch.equal(e, g)


@needs_gpu
def test_graph_step_in_pieces_reports_the_steps_own_error():
    """A step that cannot be captured, cut into pieces: the error names the step's call, and the capture in progress
    is ended (the next capture of another step works)."""
    _, step = stacked_trainer("cuda", blocks=2)

    def step_with_item(x, target):
        loss = step(x, target)
        print(loss.item())
        return loss

    graphed = qmm.graph_step(step_with_item, warmup=1, pieces=2)
    x, target = batches("cuda", 1)[0]
    graphed(x, target)
    with pytest.raises(qmm.Error) as e:
        graphed(x, target)
    assert e.value.code == "Unsupported" and "could not be captured" in str(e.value)
    assert not torch.cuda.is_current_stream_capturing()
    _, other = stacked_trainer("cuda", blocks=2)
    again = qmm.graph_step(other, warmup=1, pieces=2)
    for x, target in batches("cuda", 3):
        assert torch.isfinite(again(x, target))
    assert again.graphs == [2]


def test_graph_step_call_hook_counts_this_threads_calls_and_cuts_before_the_numbered_ones():
    """The hook graph_step installs while it counts or captures (qmm._base._on_cuda_call): calls on other threads
    (autograd's backward) are not counted, cut() runs before the calls numbered in cuts, and the previous hook is
    back after the `with`."""
    import threading

    from qmm import _base, graphs
    seen = []
    hook = graphs._CallHook(cuts=[1, 3], cut=lambda: seen.append(hook.calls))
    with hook:
        assert _base._on_cuda_call is hook
        for _ in range(5):
            _base._on_cuda_call()
        other = threading.Thread(target=_base._on_cuda_call)
        other.start()
        other.join()
    assert hook.calls == 5 and seen == [1, 3]
    assert _base._on_cuda_call is None
