"""A whole training step (forward, backward, optimizer step) replayed as one CUDA graph.

A patched QLoRA step of a small model spends most of its wall time on the host (Python, autograd, one launch per
kernel) while the GPU waits. Captured once, the step replays with one launch:

    opt = torch.optim.AdamW(params, lr=1e-4, capturable=True)   # fused=True too if wanted: capturable is what counts

    def step(input_ids, labels):
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss

    step = qmm.graph_step(step)
    for batch in loader:
        loss = step(batch["input_ids"].cuda(), batch["labels"].cuda())   # a tensor the next call overwrites

Limits: the step's inputs are tensors and every other value the step reads is fixed at capture (Python numbers,
the learning rate unless the optimizer keeps it in a tensor, which layers run). Each new input signature (shapes,
dtypes, strides, device) runs `warmup` eager steps and then captures a graph of its own, with memory of its own
(pad batches to a few fixed shapes). The step may not synchronize with the host (`.item()`, printing a tensor,
data-dependent shapes, a checked label count: qmm's fused loss skips that check while capturing) and its outputs
are overwritten by the next replay (clone what you keep); they come without autograd history (eager calls' too,
in the same containers: tensors, tuples, lists, dicts, a transformers ModelOutput).
A loss of an eager step run before on another stream (PyTorch's default one) that is still referenced when the
graph is captured keeps that step's gradient accumulators, tied to that stream, in use: let it go (`loss.item()`
or `loss.detach()` keep the value) before the step's first calls. Hugging Face models check an attention mask's
values (and, building no KV cache, the position ids) to skip the mask when nothing is padded or packed, which they
cannot do while capturing: pass no attention_mask for unpadded batches, and without a KV cache patch the model
with patch_bnb(fused_loss=True), or the graph holds the explicit-mask attention. On the CPU the step runs eagerly.

Launching a graph of many kernels keeps the GPU waiting for the host before the graph's first kernel runs. With
pieces=p > 1 the step is captured as p graphs of one memory pool, replayed one after the other, cut between qmm's
calls in the step's forward (counted in the last warm-up call, on the calling thread): the first graph small, each
next one about eight times larger, so that the GPU starts early and each later launch overlaps the work of the
graphs before it. The results are those of one graph.

Capturing qmm's ops with torch.cuda.graph yourself: warm them up on the stream you capture on (qmm keeps a context
per stream; graph_step does this)."""
import copy
import gc
import threading

import torch

from . import _base, _copies
from ._base import _error


class GraphStep:
    """See the module's documentation; made by qmm.graph_step."""

    def __init__(self, step, warmup, pieces):
        self._step = step
        self._warmup = warmup
        self._pieces = pieces
        self._entries = {}  # input signature -> _Capture
        self._side_streams = {}  # device -> the stream the warm-up calls run on

    def __call__(self, *inputs):
        for i, t in enumerate(inputs):
            if not isinstance(t, torch.Tensor):
                raise _error("InvalidArgument", f"graph_step: input {i} is a {type(t).__name__}; the step's inputs "
                                                "must be tensors (other values are fixed when the step is captured)")
        if len({t.device for t in inputs}) > 1:
            raise _error("InvalidArgument", "graph_step: the inputs are on different devices: "
                                            + ", ".join(str(t.device) for t in inputs))
        if not inputs or not inputs[0].is_cuda:
            return _detached(self._step(*inputs))
        device = inputs[0].device
        key = tuple((tuple(t.shape), t.dtype, t.stride()) for t in inputs) + (device,)
        entry = self._entries.get(key)
        if entry is None:
            if device not in self._side_streams:  # one per device: qmm keeps a context per stream it sees
                self._side_streams[device] = torch.cuda.Stream(device)
            entry = self._entries[key] = _Capture(device, self._side_streams[device])
        if entry.eager_calls < self._warmup:
            entry.eager_calls += 1
            count = self._pieces > 1 and entry.eager_calls == self._warmup
            return entry.run_eagerly(self._step, inputs, count)
        if entry.graphs is None:
            entry.capture(self._step, inputs, self._pieces)
        return entry.replay(inputs)

    @property
    def captured(self):
        """How many input signatures this step has captured (each finished its warm-up)."""
        return sum(e.graphs is not None for e in self._entries.values())

    @property
    def graphs(self):
        """The graphs each captured signature replays, in capture order (pieces of them, or fewer where the forward
        made too few qmm calls to cut)."""
        return [len(e.graphs) for e in self._entries.values() if e.graphs is not None]


class _CallHook:
    """Installed as _base._on_cuda_call for the duration of a `with`: counts the qmm calls this thread makes (the
    step's forward: autograd runs the backward on threads of its own) and runs cut() before the calls numbered in
    cuts."""

    def __init__(self, cuts=(), cut=None):
        self.thread = threading.get_ident()
        self.calls = 0
        self.cuts = set(cuts)
        self.cut = cut

    def __call__(self):
        if threading.get_ident() != self.thread:
            return
        if self.calls in self.cuts:
            self.cut()
        self.calls += 1

    def __enter__(self):
        self.previous = _base._on_cuda_call
        _base._on_cuda_call = self
        return self

    def __exit__(self, *exc):
        _base._on_cuda_call = self.previous


def _cut_points(calls, pieces):
    """Where to cut a forward of `calls` qmm calls into `pieces` graphs: before the calls at 1/2, 1/16, 1/128... of
    them (distinct, after the first call), so that each graph is about eight times the one before."""
    points = {calls // (2 * 8 ** i) for i in range(pieces - 1)}
    return sorted(p for p in points if 0 < p < calls)


class _Capture:
    def __init__(self, device, side_stream):
        self.device = device
        self.side = side_stream
        self.eager_calls = 0
        self.forward_calls = 0  # qmm calls of the counted warm-up's forward
        self.graphs = None
        self.inputs = None
        self.outputs = None

    def run_eagerly(self, step, inputs, count=False):
        # On a side stream, as the capture will run: lazy set-up (the optimizer's state, cuBLAS workspaces, qmm's
        # context for that stream) happens here, outside the graph.
        current = torch.cuda.current_stream(self.device)
        self.side.wait_stream(current)
        with torch.cuda.stream(self.side):
            if count:
                with _CallHook() as hook:
                    out = _detached(step(*inputs))
                self.forward_calls = hook.calls
            else:
                out = _detached(step(*inputs))
        current.wait_stream(self.side)
        return out

    def capture(self, step, inputs, pieces):
        self.inputs = [t.clone() for t in inputs]
        pool = torch.cuda.graph_pool_handle()
        graphs = [torch.cuda.CUDAGraph()]

        def cut():  # the graph so far ends here; the next one, of the same pool, begins
            graphs[-1].capture_end()
            graphs.append(torch.cuda.CUDAGraph())
            graphs[-1].capture_begin(pool=pool)

        # Nothing in flight, the warm-up's garbage gone and the cached blocks handed back (torch.cuda.graph's
        # preparation, which a capture cut into several graphs cannot use).
        torch.cuda.synchronize(self.device)
        gc.collect()
        torch.cuda.empty_cache()
        try:
            # On the stream the warm-up ran on: qmm keeps a context (cuBLASLt handle, plans) per stream, and a fresh
            # one would do its first-use set-up of large GEMM kernels inside the capture, which that cannot hold.
            # The adapters' working copies cast inside the capture: each replay casts them again (qmm._copies).
            with torch.cuda.stream(self.side), _copies.capturing(), \
                    _CallHook(_cut_points(self.forward_calls, pieces), cut):
                graphs[-1].capture_begin(pool=pool)
                try:
                    self.outputs = _detached(step(*self.inputs))
                except BaseException:  # the step's error is the one to report, not the broken capture's
                    try:
                        graphs[-1].capture_end()
                    except Exception:
                        pass
                    raise
                graphs[-1].capture_end()
        except Exception as e:  # what the step did that a graph cannot hold; the message says which call
            raise _error("Unsupported", f"graph_step: the step could not be captured into a CUDA graph: {e}. A "
                                        "captured step may not synchronize with the host (.item(), printing a "
                                        "tensor, data-dependent shapes), needs a capturable optimizer "
                                        "(capturable=True, fused or not), and no loss of an eager step run on "
                                        "another stream may still be referenced (see qmm.graphs)") from e
        self.graphs = graphs

    def replay(self, inputs):
        for static, t in zip(self.inputs, inputs):
            if static.data_ptr() != t.data_ptr():
                static.copy_(t)
        for graph in self.graphs:
            graph.replay()
        return self.outputs


def _detached(out):
    """The step's outputs without their autograd graphs, in the same containers (tuples, named ones, lists, dicts and
    their subclasses such as transformers' ModelOutput): a returned loss would hold its step's graph, and with it
    PyTorch's gradient accumulators of the stream that step ran on, into the next call (the capture)."""
    if isinstance(out, torch.Tensor):
        return out.detach()
    if isinstance(out, tuple):
        items = [_detached(o) for o in out]
        return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)
    if isinstance(out, list):
        return type(out)(_detached(o) for o in out)
    if isinstance(out, dict):
        copied = copy.copy(out)
        for k, v in out.items():
            copied[k] = _detached(v)
        return copied
    return out


def graph_step(step, warmup=2, pieces=1):
    """Wraps a training step `step(*tensors)` so that it replays as one CUDA graph (or `pieces` graphs, replayed in
    turn: see qmm.graphs) after `warmup` eager calls per input signature (see qmm.graphs for the limits). Returns a
    callable with step's signature."""
    if not callable(step):
        raise _error("InvalidArgument", f"graph_step: step must be callable, got a {type(step).__name__}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        raise _error("InvalidArgument", f"graph_step: warmup must be an int >= 1 (the optimizer's state and lazy "
                                        f"set-up happen outside the graph), got {warmup!r}")
    if isinstance(pieces, bool) or not isinstance(pieces, int) or pieces < 1:
        raise _error("InvalidArgument", f"graph_step: pieces must be an int >= 1 (the graphs a step is captured "
                                        f"as), got {pieces!r}")
    return GraphStep(step, warmup, pieces)
